#include "shm_channel.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "copy.h"
#include "errors.h"
#include "mpi_transport.h"
#include "reduce.h"
#include "waiting.h"

namespace ringreduce {

namespace {

constexpr int64_t kCounterBytes = 128;  // each counter on its own pair of cache lines
// A random token of its maker, on the published counter's second line (read only while
// the channel is made): a rank checks that the memory it mapped is the one offered.
constexpr int64_t kTokenAt = 64;
// The departure word shares the exchange counter's pair, on the second line: it is
// written once, when its rank leaves.
constexpr int64_t kDepartureAt = 2 * kCounterBytes + 64;
// The word's fields, from the lowest bit: why (3 bits), cause_why (3), cause + 1 (12;
// 0 when not known, as for a rank beyond the field: every rank here is on one machine),
// completed (46: years of calls).
constexpr int kWhyBits = 3;
constexpr int kCauseShift = 2 * kWhyBits;
constexpr int kCauseBits = 12;
constexpr int kCompletedShift = kCauseShift + kCauseBits;

bool shm_disabled_by_environment() {
  const char* value = std::getenv("RINGREDUCE_SHM");
  return value != nullptr && std::strcmp(value, "0") == 0;
}

// What each rank says in the first step of making the channel.
struct Offer {
  char host[128];      // the machine: host name and boot id (which tell two hosts apart)
  char name[64];       // where the others open this rank's memory
  uint64_t token[2];   // what that memory holds at kTokenAt
  int32_t ready;       // 1: made and mapped, and this rank wants the wire
  int32_t refused;     // if not: kTurnedOff, or the errno of the making (0: unknown)
  int32_t rank_order;  // 1: RINGREDUCE_RING=ranks here (see ring_order_by_machine)
  int32_t pid = 0;     // its process (see ShmChannel::check_alive())
};

constexpr int32_t kTurnedOff = -1;  // RINGREDUCE_SHM=0 on that rank

// 128 random bits (the clock, the pid and an address, should the system have no
// random device).
void random_token(uint64_t token[2]) {
  token[0] = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  token[1] = (static_cast<uint64_t>(getpid()) << 32) ^ reinterpret_cast<uintptr_t>(token);
  try {
    std::random_device random;
    for (int i = 0; i < 2; ++i)
      token[i] ^= (static_cast<uint64_t>(random()) << 32) ^ static_cast<uint64_t>(random());
  } catch (const std::exception&) {
  }
}

// A child made by fork() must not inherit the ring (it would see, and could write, the
// counters of a communicator that is not its own).
void not_for_children(void* base, size_t bytes) {
#ifdef MADV_DONTFORK
  madvise(base, bytes, MADV_DONTFORK);
#else
  (void)base;
  (void)bytes;
#endif
}

void machine_of_this_process(char* out, size_t size) {
  char host[65] = {0};
  gethostname(host, sizeof(host) - 1);
  // Tests only: ranks on one machine that say they are on several, to run the ring of
  // several machines (MPI messages, ranks in ring_order_by_machine's order) on one.
  // "a,b": MPI_COMM_WORLD's rank r says it is on the (r mod 2)th, as mpiexec places
  // ranks round-robin over two hosts. (reference.machine_of_this_process reads it too.)
  if (const char* pretend = std::getenv("RINGREDUCE_TEST_MACHINE"); pretend && *pretend) {
    std::vector<std::string> names(1);
    for (const char* c = pretend; *c; ++c) {
      if (*c == ',') names.emplace_back();
      else names.back() += *c;
    }
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    std::snprintf(host, sizeof host, "%s", names[world_rank % names.size()].c_str());
  }
  char boot[40] = {0};
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    if (std::fgets(boot, sizeof(boot), f) == nullptr) boot[0] = 0;
    std::fclose(f);
  }
  boot[std::strcspn(boot, "\n")] = 0;
  std::snprintf(out, size, "%s/%s", host, boot);
}

// This rank's memory, as a file the others open by `name` while this process holds it
// open (then each maps it, and the name is no longer needed).
#ifdef __linux__
// An anonymous memory file, which the others open through /proc: it has no name of its
// own, so nothing is left behind in /dev/shm when the job is killed mid-creation.
int make_memory_file(char* name, size_t size) {
  const int fd = memfd_create("ringreduce", MFD_CLOEXEC);
  if (fd >= 0) std::snprintf(name, size, "/proc/%d/fd/%d", static_cast<int>(getpid()), fd);
  return fd;
}
int open_memory_file(const char* name) { return open(name, O_RDWR | O_CLOEXEC); }
void forget_memory_file(const char* /*name*/) {}
#else
// Elsewhere a POSIX shared-memory object, named by this process, a count of the
// channels it made and a random part (under 31 characters, macOS's limit), and
// unlinked once all have mapped it.
int make_memory_file(char* name, size_t size) {
  static std::atomic<uint64_t> made{0};
  uint64_t salt[2];
  random_token(salt);
  std::snprintf(name, size, "/rr%x.%llx.%08x", static_cast<unsigned>(getpid()),
                static_cast<unsigned long long>(made++), static_cast<unsigned>(salt[0]));
  return shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
}
int open_memory_file(const char* name) { return shm_open(name, O_RDWR, 0); }
void forget_memory_file(const char* name) { shm_unlink(name); }
#endif

// This rank's memory, made and mapped (nullptr if not), and let go of once every rank
// has mapped it, or on the way out.
struct OwnMemory {
  Offer* offer;
  int fd = -1;
  char* make(size_t bytes) {
    fd = make_memory_file(offer->name, sizeof(offer->name));
    if (fd < 0) return nullptr;
#ifdef __linux__
    // Every page now, so that a lack of memory fails here, not with SIGBUS mid-call.
    const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));  // (not in errno)
    if (rc != 0) errno = rc;
    const bool sized = rc == 0;
#else
    const bool sized = ftruncate(fd, static_cast<off_t>(bytes)) == 0;
#endif
    void* base = sized ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                       : MAP_FAILED;
    if (base == MAP_FAILED) {
      const int error = errno;  // (for the message; let_go() may change it)
      let_go();
      errno = error;
      return nullptr;
    }
    not_for_children(base, bytes);
    return static_cast<char*>(base);
  }
  void let_go() {
    if (fd < 0) return;
    forget_memory_file(offer->name);
    close(fd);
    fd = -1;
  }
  ~OwnMemory() { let_go(); }
};

// Maps another rank's memory (of `bytes` bytes), or returns nullptr with *error the
// system's errno (0: a file of another size).
char* map_others(const char* name, size_t bytes, int* error) {
  *error = 0;
  const int fd = open_memory_file(name);
  if (fd < 0) {
    *error = errno;
    return nullptr;
  }
  struct stat st {};
  const bool sized = fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes;
  void* base = sized ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (sized && base == MAP_FAILED) *error = errno;
  close(fd);
  if (base == MAP_FAILED) return nullptr;
  not_for_children(base, bytes);
  return static_cast<char*>(base);
}

}  // namespace

std::unique_ptr<ShmChannel> ShmChannel::create(MpiTransport& transport, int64_t slot_bytes,
                                               int slots, int64_t board_bytes,
                                               std::string* why_not,
                                               std::vector<std::string>* machines,
                                               bool* ring_in_rank_order) {
  const int rank = transport.rank(), size = transport.size();
  machines->assign(size, std::string());
  *ring_in_rank_order = false;
  if (size == 1) {
    *why_not = "one rank: no ring";
    return nullptr;
  }
  std::unique_ptr<ShmChannel> channel(new ShmChannel());
  channel->comm_ = transport.comm();
  channel->stop_ = &transport.stop_request();
  channel->slot_bytes_ = slot_bytes;
  channel->slots_ = slots;
  channel->rank_ = rank;
  channel->board_stride_ = (board_bytes + kCounterBytes - 1) / kCounterBytes * kCounterBytes;
  // Per rank: three counters (published, consumed, exchanged; the departure word beside
  // the last), two boards, the slots.
  channel->part_bytes_ = static_cast<size_t>(kCounterBytes * 3 + channel->board_stride_ * 2 +
                                             slot_bytes * slots);
  channel->parts_.assign(size, nullptr);

  // Every rank's part is a memory file that it makes and the others map (see
  // make_memory_file). Made without MPI's shared windows, whose making (like
  // MPI_Comm_split_type) is a blocking collective: a rank that gave up on a step before
  // it (a timeout, a Ctrl-C) would have left the others waiting there for good. The two
  // steps here are timed exchanges instead; a rank that fails in one lets go of its
  // file, so the others cannot map it and fall back together, or time out.
  Offer mine{};
  machine_of_this_process(mine.host, sizeof(mine.host));
  mine.pid = static_cast<int32_t>(getpid());
  const char* ring_setting = std::getenv("RINGREDUCE_RING");
  mine.rank_order = ring_setting != nullptr && std::strcmp(ring_setting, "ranks") == 0;
  OwnMemory own{&mine};
  if (shm_disabled_by_environment()) {
    mine.refused = kTurnedOff;
  } else {
    errno = 0;
    channel->parts_[rank] = own.make(channel->part_bytes_);
    mine.ready = channel->parts_[rank] != nullptr;
    if (!mine.ready) mine.refused = errno;
    if (mine.ready) {
      random_token(mine.token);
      std::memcpy(channel->parts_[rank] + kTokenAt, mine.token, sizeof(mine.token));
    }
  }
  std::vector<Offer> offers(size);
  transport.creation_allgather(&mine, offers.data(), sizeof(Offer));
  // On every rank alike: all saw the same offers.
  // A ring in rank order if any rank asks: all see the same offers, so all agree.
  for (int r = 0; r < size; ++r) {
    offers[r].host[sizeof(offers[r].host) - 1] = 0;
    (*machines)[r] = offers[r].host;
    *ring_in_rank_order = *ring_in_rank_order || offers[r].rank_order;
  }
  for (int r = 0; r < size; ++r) {
    if (offers[r].ready) continue;
    *why_not = offers[r].refused == kTurnedOff
                   ? "RINGREDUCE_SHM=0 on rank " + std::to_string(r)
                   : "rank " + std::to_string(r) + " could not make its shared memory (" +
                         (offers[r].refused > 0 ? std::strerror(offers[r].refused)
                                                : std::string("unknown error")) +
                         ")";
    return nullptr;
  }
  for (int r = 0; r < size; ++r) {
    if (std::strcmp(offers[r].host, offers[0].host) == 0) continue;
    const char* boot0 = std::strchr(offers[0].host, '/');
    const char* boot = std::strchr(offers[r].host, '/');
    const bool one_boot = boot0 != nullptr && boot != nullptr && boot0[1] != 0 &&
                          std::strcmp(boot0, boot) == 0;
    *why_not = std::string(one_boot ? "the ranks have different host names on one machine "
                                      "(containers of their own?): "
                                    : "the ranks are on more than one machine: ") +
               "rank 0 on " + offers[0].host + ", rank " + std::to_string(r) + " on " +
               offers[r].host + " (host/boot id)";
    return nullptr;
  }

  // The machine's name can mislead (containers that do not see each other's processes
  // or /dev/shm), and so can a name: in another pid namespace, /proc/<pid>/fd/<fd> may
  // be some other process's file (even this rank's own). Mapping, and finding the
  // offered token there, decides.
  // failed: the rank whose memory this one could not map, and errno (0: not the file
  // offered, or none)
  int32_t mapped = 1, failed[2] = {-1, 0};
  for (int r = 0; r < size && mapped; ++r) {
    if (r == rank) continue;
    offers[r].name[sizeof(offers[r].name) - 1] = 0;
    int error = 0;
    char* part = map_others(offers[r].name, channel->part_bytes_, &error);
    if (part != nullptr &&
        std::memcmp(part + kTokenAt, offers[r].token, sizeof(offers[r].token)) != 0) {
      munmap(part, channel->part_bytes_);
      part = nullptr;
    }
    channel->parts_[r] = part;
    mapped = part != nullptr;
    if (!mapped) {
      failed[0] = r;
      failed[1] = error;
    }
  }
  // (Every counter and departure word starts at 0: a new memory file reads as zeros.)
  std::vector<int32_t> all_failed(2 * size);
  transport.creation_allgather(failed, all_failed.data(), sizeof(failed));
  for (int r = 0; r < size; ++r) {
    if (all_failed[2 * r] < 0) continue;
    const int error = all_failed[2 * r + 1];
    // Not there, not ours, or not the file offered: a process this one cannot see as
    // it is. Else the system's reason (no file descriptor left, say).
    const bool unseen = error == 0 || error == ENOENT || error == EACCES || error == EPERM;
    *why_not = "rank " + std::to_string(r) + " could not map the shared memory of rank " +
               std::to_string(all_failed[2 * r]) +
               (error != 0 ? std::string(" (") + std::strerror(error) + ")" : std::string()) +
               (unseen ? " (e.g. processes in other pid namespaces, or of other users)" : "");
    return nullptr;  // (the destructor unmaps what was mapped)
  }

  // (Every rank's pid is one of this rank's pid namespace: mapping through
  // /proc/<pid>/fd found the token offered.)
  for (int r = 0; r < size; ++r) channel->pids_.push_back(static_cast<pid_t>(offers[r].pid));
  const int64_t slots_at = kCounterBytes * 3 + channel->board_stride_ * 2;
  char* me = channel->parts_[rank];
  for (int r = 0; r < size; ++r) {
    char* part = channel->parts_[r];
    channel->exchanged_.push_back(reinterpret_cast<const uint64_t*>(part + 2 * kCounterBytes));
    channel->departures_.push_back(reinterpret_cast<const uint64_t*>(part + kDepartureAt));
    channel->boards_.push_back(part + 3 * kCounterBytes);
  }
  char* left = channel->parts_[(rank + size - 1) % size];
  char* right = channel->parts_[(rank + 1) % size];
  channel->my_published_ = reinterpret_cast<uint64_t*>(me);
  channel->my_consumed_ = reinterpret_cast<uint64_t*>(me + kCounterBytes);
  channel->my_slots_ = me + slots_at;
  channel->left_published_ = reinterpret_cast<const uint64_t*>(left);
  channel->left_slots_ = left + slots_at;
  channel->right_consumed_ = reinterpret_cast<const uint64_t*>(right + kCounterBytes);
  channel->my_exchanged_ = reinterpret_cast<uint64_t*>(me + 2 * kCounterBytes);
  channel->my_departure_ = reinterpret_cast<uint64_t*>(me + kDepartureAt);
  return channel;
}

ShmChannel::~ShmChannel() { free(); }

void ShmChannel::free() {
  // Local: the others' mappings (and so what they read of ours, even after we left)
  // stay valid until they unmap theirs.
  for (char*& part : parts_) {
    if (part != nullptr) munmap(part, part_bytes_);
    part = nullptr;
  }
  // Nothing left to point into it (a departure check after close() finds no ranks).
  exchanged_.clear();
  departures_.clear();
  pids_.clear();
  boards_.clear();
}

void ShmChannel::exchange() {
  __atomic_store_n(my_exchanged_, ++exchanges_, __ATOMIC_RELEASE);
  const int p = static_cast<int>(exchanged_.size());
  // Ranks whose count satisfies `test`, for messages.
  auto ranks_where = [&](auto test) {
    std::vector<int> ranks;
    for (int s = 0; s < p; ++s)
      if (test(__atomic_load_n(exchanged_[s], __ATOMIC_ACQUIRE))) ranks.push_back(s);
    return ranks;
  };
  StallTimer timer(timeout_s_);
  for (int r = 0; r < p; ++r) {
    int idle = 0;
    while (__atomic_load_n(exchanged_[r], __ATOMIC_ACQUIRE) < exchanges_) {
      back_off(&idle);
      // Looks at every rank's departure, not only this one's: any may hold up the call.
      if (timer.expired([&] { look_around(); })) {
        const std::vector<int> missing = ranks_where([&](uint64_t n) { return n < exchanges_; });
        throw TimeoutError(describe_ranks(missing) + (missing.size() == 1 ? " has" : " have") +
                           " not joined this call within " + seconds_text(timeout_s_) +
                           " (the timeout): a rank skipped the call, or is stuck before it (in a "
                           "call on another Communicator that it makes first, say)",
                           missing.empty() ? -1 : missing.front(), false,
                           TimeoutError::Kind::kNotJoined);
      }
    }
  }
}

DepartureNote ShmChannel::departure(int r) const {
  if (r < 0 || r >= static_cast<int>(departures_.size())) return {};  // (after free())
  return note_of_word(r, __atomic_load_n(departures_[r], __ATOMIC_ACQUIRE));
}

void ShmChannel::look_around() const {
  int flag = 0;
  if (comm_ != MPI_COMM_NULL)
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE);
  check_departures();
  check_alive();
  if (also_check_) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_notice_check_) {
      next_notice_check_ = now + kNoticeCheckEvery;
      also_check_();
    }
  }
}

bool process_ended(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;  // (EPERM: it is there)
#ifdef __linux__
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char stat[512];
  const ssize_t n = read(fd, stat, sizeof(stat) - 1);
  close(fd);
  if (n <= 0) return false;
  stat[n] = 0;
  // "pid (name) state ...": the name may hold anything, ')' too; the state follows the last.
  const char* name_end = std::strrchr(stat, ')');
  return name_end != nullptr && name_end[1] == ' ' && (name_end[2] == 'Z' || name_end[2] == 'X');
#else
  return false;
#endif
}

void ShmChannel::check_alive() const {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_alive_check_) return;
  next_alive_check_ = now + kAliveCheckEvery;
  for (int r = 0; r < static_cast<int>(pids_.size()); ++r) {
    // (One that left said so, and check_departures() judged that.)
    if (r == rank_ || pids_[r] <= 0 || __atomic_load_n(departures_[r], __ATOMIC_ACQUIRE) != 0)
      continue;
    if (!process_ended(pids_[r])) continue;
    // A note written just before it ended (after the look above) says why: that one.
    if (__atomic_load_n(departures_[r], __ATOMIC_ACQUIRE) != 0) {
      check_departures();
      continue;
    }
    throw TimeoutError("the process of rank " + std::to_string(r) + " (pid " +
                           std::to_string(pids_[r]) +
                           ") has ended without a word: killed by a signal or the "
                           "out-of-memory killer, or ended without its exit handlers, as "
                           "os._exit() does",
                       r, /*vanished=*/true);
  }
}

void ShmChannel::check_departures() const {
  if (stop_ != nullptr) stop_->check();
  const DepartureNote reported = first_departure(exchange_);
  if (reported.holds_up(exchange_)) throw reported.timeout();
}

DepartureNote ShmChannel::first_departure(int64_t exchange) const {
  DepartureNote first;
  // Not this rank's own word: its own timeout is no other rank's departure (close()
  // would take it for one, and return as if another rank had left).
  for (int r = 0; r < static_cast<int>(departures_.size()); ++r)
    if (r != rank_) first.prefer(departure(r), exchange);
  return first;
}

uint64_t ShmChannel::departure_word(const DepartureNote& note) {
  const uint64_t cause = static_cast<uint64_t>(note.cause + 1);
  return (static_cast<uint64_t>(note.completed) << kCompletedShift) |
         (cause < (1u << kCauseBits) ? cause << kCauseShift : 0) |
         (static_cast<uint64_t>(note.cause_why) << kWhyBits) | static_cast<uint64_t>(note.why);
}

DepartureNote ShmChannel::note_of_word(int r, uint64_t word) {
  DepartureNote note;
  if (word != 0) {
    note.rank = r;
    constexpr uint64_t kWhyMask = (1u << kWhyBits) - 1;
    note.why = static_cast<Departure>(word & kWhyMask);
    note.cause_why = static_cast<Departure>((word >> kWhyBits) & kWhyMask);
    note.cause = static_cast<int>((word >> kCauseShift) & ((1u << kCauseBits) - 1)) - 1;
    note.completed = static_cast<int64_t>(word >> kCompletedShift);
  }
  return note;
}

void ShmChannel::leave(const DepartureNote& note) {
  __atomic_store_n(my_departure_, departure_word(note), __ATOMIC_RELEASE);
  // Each rank that leaves (or drops its Communicator) reads the others' words next (see
  // RingCommunicator::depart() and ~RingCommunicator): without a full fence, the store
  // may wait in this core's store buffer past those loads (x86 does that), and two ranks
  // leaving at once could each miss the other's word; one would then send a notice that
  // the other, freeing its duplicate, hands to a later communicator.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

bool ShmChannel::can_send() const {
  return sent_ - __atomic_load_n(right_consumed_, __ATOMIC_ACQUIRE) < static_cast<uint64_t>(slots_);
}

bool ShmChannel::can_receive() const {
  return __atomic_load_n(left_published_, __ATOMIC_ACQUIRE) > received_;
}

void ShmChannel::sent() { __atomic_store_n(my_published_, ++sent_, __ATOMIC_RELEASE); }

void ShmChannel::received() { __atomic_store_n(my_consumed_, ++received_, __ATOMIC_RELEASE); }

namespace {
std::atomic<double> send_pause_s{0};  // see set_shm_send_pause()
}  // namespace

void set_shm_send_pause(double seconds) { send_pause_s = seconds; }

// The polling loop under every shared-memory call: publish our sends in order (send i
// once ready(i, chunks received so far) and the right neighbour has freed a slot), and
// consume the left neighbour's chunks in order as it publishes them. Each side of a
// link runs the same plan, so the left neighbour publishes exactly what we consume,
// in that order; and a send that waits on a receive waits on an earlier one, so the
// loop always has something that will become possible. A rank that comes late, or
// finishes late, to a call that another rank gave up raises too, even if the chunks
// it needed were all in the slots: every rank's call fails alike.
// until_taken: also wait until the right neighbour has taken every chunk we published.
template <typename Ready, typename Send, typename Receive>
void ShmChannel::pump(int64_t sends, int64_t recvs, int left, int right, Ready ready, Send send,
                      Receive receive, bool until_taken) {
  check_departures();
  int64_t next_send = 0, next_recv = 0;
  int idle = 0;
  StallTimer timer(timeout_s_);
  uint64_t taken = __atomic_load_n(right_consumed_, __ATOMIC_ACQUIRE);
  while (next_send < sends || next_recv < recvs || (until_taken && taken < sent_)) {
    bool progressed = false;
    if (until_taken) {
      const uint64_t now = __atomic_load_n(right_consumed_, __ATOMIC_ACQUIRE);
      progressed = now != taken;
      taken = now;
    }
    while (next_send < sends && ready(next_send, next_recv) && can_send()) {
      if (const double pause = send_pause_s.load(std::memory_order_relaxed); pause > 0)
        std::this_thread::sleep_for(std::chrono::duration<double>(pause));
      bytes_sent_.store(bytes_sent_.load(std::memory_order_relaxed) +
                            send(next_send, my_slot(sent_)), std::memory_order_relaxed);
      sent();
      ++next_send;
      progressed = true;
    }
    if (next_recv < recvs && can_receive()) {
      receive(next_recv, left_slot(received_));
      received();
      ++next_recv;
      progressed = true;
    }
    if (progressed) {
      idle = 0;
      timer.progressed();
    } else {
      back_off(&idle);
      // A neighbour that left never moves again; nor, then, does the ring.
      if (timer.expired([&] { look_around(); })) {
        const bool receiving = next_recv < recvs;
        throw neighbour_timeout(timeout_s_, receiving ? left : right, receiving);
      }
    }
  }
  check_departures();
}

// One ring phase: the schedule's chunks, sent and received step by step. A chunk
// forwarded at step k+1 is the one consumed (and reduced) at step k.
template <typename OnReceive, typename SendSource>
void ShmChannel::run_phase(const RingSchedule& sched, size_t elem_size, Phase phase,
                           OnReceive on_receive, SendSource send_source) {
  const int steps = sched.steps_per_phase();
  if (steps == 0) return;
  const std::vector<ChunkRef> sends = sched.phase_chunks(phase, /*sending=*/true);
  const std::vector<ChunkRef> recvs = sched.phase_chunks(phase, /*sending=*/false);
  std::vector<int64_t> recv_step_start(steps, static_cast<int64_t>(recvs.size()));
  for (int64_t i = static_cast<int64_t>(recvs.size()) - 1; i >= 0; --i)
    recv_step_start[recvs[i].step] = i;  // where each step's receives begin
  pump(
      static_cast<int64_t>(sends.size()), static_cast<int64_t>(recvs.size()), sched.left(),
      sched.right(),
      [&](int64_t i, int64_t received) {
        const ChunkRef& u = sends[i];
        return u.step == 0 || received > recv_step_start[u.step - 1] + u.chunk;
      },
      [&](int64_t i, char* slot) {
        const ChunkRef& u = sends[i];
        const Span ch = sched.chunk(u.segment, u.chunk);
        copy_to_slot(slot, send_source(u.step, ch), ch.count * elem_size);
        return ch.count * static_cast<int64_t>(elem_size);
      },
      [&](int64_t i, const char* slot) {
        const ChunkRef& u = recvs[i];
        on_receive(sched.chunk(u.segment, u.chunk), slot);
      });
}

void ShmChannel::reduce_scatter(const RingSchedule& sched, DType dtype, Op op, const void* input,
                                void* out, void* own_out) {
  const size_t es = dtype_size(dtype);
  const char* in = static_cast<const char*>(input);
  char* dst = static_cast<char*>(out);
  const ReduceTarget target(sched, es, out, own_out);
  run_phase(
      sched, es, Phase::ReduceScatter,
      [&](Span ch, const char* slot) {
        reduce(dtype, op, target(ch), in + ch.offset * es, slot, ch.count);
      },
      [&](int step, Span ch) { return (step == 0 ? in : dst) + ch.offset * es; });
}

void ShmChannel::allgather(const RingSchedule& sched, size_t elem_size, void* buf) {
  char* data = static_cast<char*>(buf);
  run_phase(
      sched, elem_size, Phase::AllGather,
      [&](Span ch, const char* slot) {
        copy_bytes(data + ch.offset * elem_size, slot, ch.count * elem_size);
      },
      [&](int, Span ch) { return data + ch.offset * elem_size; });
}

namespace {
std::atomic<double> broadcast_pause_s{0};  // see set_shm_broadcast_pause()
}  // namespace

void set_shm_broadcast_pause(double seconds) { broadcast_pause_s = seconds; }

void ShmChannel::broadcast(int root, void* buf, int64_t bytes, int64_t chunk_bytes) {
  const int p = static_cast<int>(exchanged_.size());
  if (p == 1 || bytes == 0) return;
  if (const double pause = broadcast_pause_s.exchange(0); pause > 0)
    std::this_thread::sleep_for(std::chrono::duration<double>(pause));
  // A chain, root -> root+1 -> ... -> root-1, chunk by chunk: each rank copies the chunk
  // out of its left neighbour's slot into buf, and from there (still in cache) into
  // its own slot for the right, unless the right is the root.
  char* data = static_cast<char*>(buf);
  const int position = ((rank_ - root) % p + p) % p;  // 0: the root
  const int64_t chunk = std::max<int64_t>(1, std::min(chunk_bytes, slot_bytes_));
  const int64_t chunks = (bytes + chunk - 1) / chunk;
  auto chunk_len = [&](int64_t c) { return std::min(chunk, bytes - c * chunk); };
  pump(
      position == p - 1 ? 0 : chunks, position == 0 ? 0 : chunks, (rank_ + p - 1) % p,
      (rank_ + 1) % p,
      [&](int64_t c, int64_t received) { return position == 0 || received > c; },
      [&](int64_t c, char* slot) {
        copy_to_slot(slot, data + c * chunk, chunk_len(c));
        return chunk_len(c);
      },
      [&](int64_t c, const char* slot) { copy_bytes(data + c * chunk, slot, chunk_len(c)); },
      // The root is done once its chunks are in its slots, while up to a slot ring's
      // worth may not have been taken yet. It waits until its right neighbour has taken
      // them: so its call lasts, as over MPI messages, until the data has left it, and
      // rank 0's tuner compares like with like.
      /*until_taken=*/position == 0);
}

}  // namespace ringreduce
