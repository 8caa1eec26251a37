#include "mpi_transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include "errors.h"
#include "waiting.h"

namespace ringreduce {

namespace {

// A departure notice: why, completed, cause, cause_why (see DepartureNote).
constexpr int kNoticeWords = 4;

// How much of a refusal's text (see agree_to_create) the other ranks are told.
constexpr int kRefusalBytes = 1024;

// mpiexec labels output by MPI_COMM_WORLD's ranks: on a sub-communicator, messages give
// a rank's number there too (`in_world`, from world_ranks()).
std::string in_world_note(int rank, int in_world) {
  return in_world == rank || in_world == MPI_UNDEFINED
             ? std::string()
             : " (" + std::to_string(in_world) + " in MPI_COMM_WORLD)";
}

// The pending MPI_Comm_idup of each creation that gave up; the duplicates themselves
// (see the constructor) are never freed, as freeing is collective. Communicators may
// be made on several threads at once (on different communicators), hence the lock.
std::mutex abandoned_lock;
std::vector<MPI_Request>& abandoned_duplicates() {
  static auto* requests = new std::vector<MPI_Request>;  // never destroyed: used at exit
  return *requests;
}

// The duplicates this process will never free before MPI_Finalize: those of the
// Communicators it left, or on which another rank left (freeing one could hand stray
// messages to a later communicator that gets its context id), of those dropped
// unclosed below MPI_THREAD_MULTIPLE, and of creations given up at MPI_Comm_idup once
// the late ranks completed them. Named when MPI runs out of communicators.
std::atomic<int64_t> unfreed_duplicates{0};

void abandon_duplicate(MPI_Request request) {
  const std::lock_guard<std::mutex> hold(abandoned_lock);
  abandoned_duplicates().push_back(request);
}

// Set by stop_creations_on_other_threads(), at exit, and never unset: a daemon thread
// may begin a creation after that (one waiting for the lock of THREAD_SERIALIZED, say).
std::atomic<bool> creations_stopped{false};
std::atomic<std::thread::id> exiting_thread{};
std::mutex creations_stopped_mutex;
std::string creations_stopped_why;  // (set once, before creations_stopped)

// MPI_COMM_WORLD's ranks of the processes that departures said are ending on an
// uncaught exception (see MpiTransport::note_ended).
std::mutex ended_mutex;
std::set<int>& ended_world_ranks() {
  static auto* ranks = new std::set<int>;  // never destroyed: used at exit
  return *ranks;
}

// A rank of `comm` (of `size`) whose process is known to be ending, or -1.
int ended_rank(MPI_Comm comm, int size) {
  {
    std::lock_guard<std::mutex> lock(ended_mutex);
    if (ended_world_ranks().empty()) return -1;
  }
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  const std::vector<int> in_world = world_ranks(comm, ranks);
  std::lock_guard<std::mutex> lock(ended_mutex);
  for (int r = 0; r < size; ++r)
    if (in_world[r] != MPI_UNDEFINED && ended_world_ranks().count(in_world[r])) return r;
  return -1;
}

bool creation_stopped_on_this_thread() {
  return creations_stopped.load(std::memory_order_acquire) &&
         std::this_thread::get_id() != exiting_thread.load(std::memory_order_acquire);
}

std::atomic<int> creation_pause_step{0};
std::atomic<double> creation_pause_s{0};
std::atomic<double> departure_notice_pause_s{0};  // see set_departure_notice_pause()

}  // namespace

std::vector<int> world_ranks(MPI_Comm comm, const std::vector<int>& ranks) {
  std::vector<int> in_world(ranks.size(), MPI_UNDEFINED);
  MPI_Group group, world;
  if (MPI_Comm_group(comm, &group) != MPI_SUCCESS) return in_world;
  if (MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS) {
    MPI_Group_translate_ranks(group, static_cast<int>(ranks.size()), ranks.data(), world,
                              in_world.data());
    MPI_Group_free(&world);
  }
  MPI_Group_free(&group);
  return in_world;
}

void set_creation_pause(int step, double seconds) {
  creation_pause_s = seconds;
  creation_pause_step = step;
}

void set_departure_notice_pause(double seconds) { departure_notice_pause_s = seconds; }

void stop_creations_on_other_threads(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(creations_stopped_mutex);
    if (!creations_stopped.load(std::memory_order_relaxed)) creations_stopped_why = why;
  }
  exiting_thread.store(std::this_thread::get_id(), std::memory_order_release);
  creations_stopped.store(true, std::memory_order_release);
}

void MpiTransport::begin_creation_step() {
  if (++creation_steps_ != creation_pause_step.load()) return;
  creation_pause_step = 0;
  std::this_thread::sleep_for(std::chrono::duration<double>(creation_pause_s.load()));
}

void finish_abandoned_duplicates() {
  int finalized = 0;
  MPI_Finalized(&finalized);  // (at exit after a program's own MPI.Finalize(), say)
  if (finalized) return;
  const std::lock_guard<std::mutex> hold(abandoned_lock);
  std::vector<MPI_Request>& requests = abandoned_duplicates();
  for (size_t i = 0; i < requests.size();) {
    int done = 0;
    if (MPI_Test(&requests[i], &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) {
      // Counted only now: a duplicate whose late ranks never come was never made.
      ++unfreed_duplicates;
      requests.erase(requests.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

int64_t unfreed_duplicate_count() { return unfreed_duplicates.load(); }

void check_mpi(int rc, const char* call, int rank) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  const std::string where = rank >= 0 ? "on rank " + std::to_string(rank) : "(rank not yet known)";
  throw MpiError(std::string(call) + " failed " + where + ": " +
                 (len > 0 ? std::string(text, len) : "error code " + std::to_string(rc)));
}

MpiTransport::MpiTransport(MPI_Comm user_comm, double timeout_s,
                           const std::atomic<uint64_t>* interrupts,
                           const std::string& refusal) {
  stop_.watch(interrupts);
  stop_.arm();
  int initialized = 0, finalized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized", -1);
  check_mpi(MPI_Finalized(&finalized), "MPI_Finalized", -1);
  if (!initialized || finalized)
    throw MpiError("MPI is not initialised (or already finalised): import mpi4py.MPI first");
  if (user_comm == MPI_COMM_NULL) throw std::invalid_argument("comm is MPI.COMM_NULL");
  int is_inter = 0;
  check_mpi(MPI_Comm_test_inter(user_comm, &is_inter), "MPI_Comm_test_inter", -1);
  if (is_inter) throw std::invalid_argument("comm is an intercommunicator; use an intracommunicator");
  timeout_s_ = timeout_s;
  // The same on the duplicate: known now for messages while it is being made.
  check_mpi(MPI_Comm_rank(user_comm, &rank_), "MPI_Comm_rank", -1);
  check_mpi(MPI_Comm_size(user_comm, &size_), "MPI_Comm_size", -1);
  left_ = (rank_ + size_ - 1) % size_;
  right_ = (rank_ + 1) % size_;
  stop_.set_context(creation_context());
  check_creation_stopped();
  // Its duplicate would wait out the timeout for a rank that will never make it.
  const int ended = ended_rank(user_comm, size_);
  if (ended >= 0) {
    const std::vector<int> in_world = world_ranks(user_comm, {rank_, ended});
    throw TimeoutError("ringreduce.Communicator (rank " + std::to_string(rank_) +
                       in_world_note(rank_, in_world[0]) + " of " + std::to_string(size_) +
                       "): rank " + std::to_string(ended) + in_world_note(ended, in_world[1]) +
                       DepartureNote::what(Departure::Ended, -1) +
                       ", as a Communicator on this rank learnt. " + kEndedAdvice);
  }
  finish_abandoned_duplicates();
  // Always the non-blocking duplicate, with or without a timeout: MPI never pairs a
  // blocking collective with a non-blocking one, and ranks may differ in their timeout.
  // MPI writes the new handle when the duplicate completes, maybe after we gave up
  // (and this object is gone): so into a place that is never freed.
  auto* duplicate = new MPI_Comm(MPI_COMM_NULL);
  MPI_Request request = MPI_REQUEST_NULL;
  // MPI's own words for the likely cause of a failure here are "Other MPI error".
  auto with_hint = [](const MpiError& e) {
    const int64_t unfreed = unfreed_duplicates.load();
    return MpiError(
        std::string(e.what()) +
        " (MPI may have run out of communicators: each ringreduce Communicator holds one "
        "until close(), and one left by an exception in its `with` block, or after an "
        "error or a timeout in a call, until MPI_Finalize" +
        (unfreed > 0 ? "; this process holds " + std::to_string(unfreed) +
                           " such, left, given up while being made, dropped unclosed "
                           "below MPI_THREAD_MULTIPLE, or dropped after another rank left"
                     : std::string()) +
        ". In a loop, catch an exception that every rank raises inside the `with` block, "
        "so that the block ends and closes its Communicator)");
  };
  try {
    check(MPI_Comm_idup(user_comm, duplicate, &request), "MPI_Comm_idup");
  } catch (const MpiError& e) {
    throw with_hint(e);
  }
  bool done = false;
  try {
    done = wait_patiently(&request, "MPI_Test(MPI_Comm_idup)");
  } catch (const MpiError& e) {
    abandon_duplicate(request);
    throw with_hint(e);
  } catch (...) {
    abandon_duplicate(request);
    throw;
  }
  if (!done) {
    abandon_duplicate(request);
    throw TimeoutError(creation_timeout_text(
        "This rank's MPI_Comm_idup stays pending on the communicator passed, where a rank "
        "that comes late completes it; if one never comes, further collectives on that "
        "communicator are not safe (as after any collective a rank skipped)"));
  }
  comm_ = *duplicate;
  delete duplicate;
  try {
    // Errors come back as return codes, which we turn into exceptions with MPI's text,
    // rather than aborting the job from inside MPI.
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    int* tag_ub = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &found),
          "MPI_Comm_get_attr(MPI_TAG_UB)");
    if (found && tag_ub) tag_ub_ = *tag_ub;
    check(MPI_Comm_set_name(comm_, "ringreduce"), "MPI_Comm_set_name");
    // Every rank has its duplicate, and knows that every rank means to go on, before
    // anything is made on it.
    if (size_ > 1 || !refusal.empty()) {
      begin_creation_step();
      agree_to_create(refusal);
    }
  } catch (...) {
    // A constructor that throws runs no destructor: a duplicate still held here (an MPI
    // call above failed; the agreement's own ways out free or forget it) is left to
    // MPI_Finalize, as freeing is collective, and counted among those the hint names.
    forget_duplicate();
    throw;
  }
}

template <typename LetGo>
void MpiTransport::wait_in_creation(MPI_Request* request, const char* call, LetGo let_go) {
  // A rank that stops making it here has already joined this step, so the others may
  // complete it and go on to wait for it in the next one, each step with the whole
  // timeout: told nothing, they waited up to twice the timeout after a Ctrl-C, and
  // then blamed a rank that skipped the making. So a rank stopped here tells them on
  // the duplicate, as a rank that leaves a call does; its notice holds up every step
  // of the making and every call after it (completed -1), on ranks that made theirs
  // before it came too: the waits of their first call read it, over either wire (the
  // shared-memory wire's at most every ShmChannel::kNoticeCheckEvery, through its
  // also_check()). A creation stopped at exit (or at MPI.Finalize()) says Ended: the
  // others then make no new Communicator that waits for this process.
  const auto leave_creation = [&](Departure why) {
    DepartureNote note;
    note.rank = rank_;
    note.why = why;
    note.completed = -1;
    leave(note);  // (nothing of a call is pending: only sends the notices)
  };
  // Where this rank gives up without a word to the others: the duplicate is left to
  // MPI_Finalize (freeing it is collective), and nothing here uses it again.
  const auto leave_duplicate_to_finalize = [&] {
    let_go();
    forget_duplicate();
  };
  bool done = false;
  try {
    done = wait_patiently(request, call);
    // A rank that stopped after joining this step let it complete without it: its
    // notice, sent as it stopped, is here by now unless it stopped a moment ago.
    if (done) check_notices();
  } catch (const TimeoutError& told) {  // (a notice: another rank stopped making it)
    leave_duplicate_to_finalize();
    throw TimeoutError(creation_context() + told.what() + ", so this rank did not make it "
                       "either. This rank's duplicate of the communicator passed is left to "
                       "MPI_Finalize");
  } catch (const StoppedError&) {  // Ctrl-C, or the process is ending
    let_go();
    leave_creation(creation_stopped_on_this_thread() ? Departure::Ended : Departure::Left);
    throw;
  } catch (...) {
    leave_duplicate_to_finalize();
    throw;
  }
  if (!done) {
    // (No notice: the ranks that wait with it give up about as soon, and say why.)
    leave_duplicate_to_finalize();
    throw TimeoutError(creation_timeout_text(
        "This rank's duplicate of the communicator passed is left to MPI_Finalize"));
  }
}

void MpiTransport::agree_to_create(const std::string& refusal) {
  // MPI writes into these until the requests complete, maybe after this rank gave up
  // (a late rank completes them when this one next drives MPI): so they are on the
  // heap, and let go of for good after a timeout or a stop, like creation_allgather's.
  struct Agreement {
    int mine[2];    // the lowest rank that refused and minus the highest (size_ and 1:
    int agreed[2];  // none), in one reduction, where a barrier stood before
    char why[kRefusalBytes];
  };
  auto agreement = std::make_unique<Agreement>();
  const bool refused = !refusal.empty();
  int* mine = agreement->mine;
  int* agreed = agreement->agreed;
  mine[0] = refused ? rank_ : size_;
  mine[1] = refused ? -rank_ : 1;
  const auto let_go = [&] { agreement.release(); };
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallreduce(mine, agreed, 2, MPI_INT, MPI_MIN, comm_, &request), "MPI_Iallreduce");
  wait_in_creation(&request, "MPI_Test(MPI_Iallreduce)", let_go);
  if (agreed[0] == size_) return;
  // Every rank has begun the reduction, so every rank comes to this broadcast next.
  const int first = agreed[0], last = -agreed[1];
  char* why = agreement->why;  // (zeroed by make_unique)
  if (rank_ == first) {
    // Cut where a UTF-8 character begins: Python decodes the message.
    size_t n = std::min(refusal.size(), static_cast<size_t>(kRefusalBytes - 1));
    while (n > 0 && n < refusal.size() && (static_cast<unsigned char>(refusal[n]) & 0xC0) == 0x80)
      --n;
    refusal.copy(why, n);
  }
  check(MPI_Ibcast(why, kRefusalBytes, MPI_CHAR, first, comm_, &request), "MPI_Ibcast");
  wait_in_creation(&request, "MPI_Test(MPI_Ibcast)", let_go);
  const std::vector<int> in_world = world_ranks(comm_, {rank_, first});
  free();  // (every rank frees it: none goes on)
  throw std::invalid_argument(
      "ringreduce.Communicator (rank " + std::to_string(rank_) + in_world_note(rank_, in_world[0]) +
      " of " + std::to_string(size_) + "): rank " + std::to_string(first) +
      in_world_note(first, in_world[1]) + (last > first ? " (and at least one more)" : "") +
      " was passed a bad argument or setting, so no rank made this Communicator: " + why);
}

MpiTransport::~MpiTransport() {
  // A destructor cannot report errors; after MPI_Finalize the handle is gone anyway.
  // Below MPI_THREAD_MULTIPLE it may run on a thread MPI does not allow (garbage
  // collection runs anywhere), so MPI_Finalize frees the handle then.
  int finalized = 1, level = MPI_THREAD_SINGLE;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Query_thread(&level);
  if (!finalized && level == MPI_THREAD_MULTIPLE && comm_ != MPI_COMM_NULL) {
    // A rank that left sent this one a notice, maybe still on its way: once freed, the
    // duplicate's context id goes to a later communicator, which would receive it (a
    // spurious "rank N has left" there, N maybe another process). So a duplicate on
    // which any departure was seen is only forgotten. (Twice: MPICH's first probe may
    // only drive its progress.)
    bool departure_seen = !departures_.empty();
    for (int probe = 0; probe < 2 && !departure_seen; ++probe) {
      try {
        receive_notices();
      } catch (const std::exception&) {
        departure_seen = true;  // (an MPI error: better not free what cannot be read)
      }
      departure_seen = departure_seen || !departures_.empty();
    }
    if (!departure_seen) MPI_Comm_free(&comm_);
  }
  if (!finalized) forget_duplicate();  // (below MPI_THREAD_MULTIPLE: left to MPI_Finalize)
}

void MpiTransport::free() {
  if (comm_ != MPI_COMM_NULL) check(MPI_Comm_free(&comm_), "MPI_Comm_free");
}

Transport::Request MpiTransport::send_right(const void* buf, int64_t bytes, int tag) {
  bytes_sent_.store(bytes_sent_.load(std::memory_order_relaxed) + bytes,
                    std::memory_order_relaxed);
  used_ = true;
  requests_.push_back(MPI_REQUEST_NULL);
  is_send_.push_back(true);
  check(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, right_, wrap_tag(tag),
                  comm_, &requests_.back()),
        "MPI_Isend");
  return static_cast<Request>(requests_.size() - 1);
}

Transport::Request MpiTransport::recv_left(void* buf, int64_t bytes, int tag) {
  used_ = true;
  requests_.push_back(MPI_REQUEST_NULL);
  is_send_.push_back(false);
  check(MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, left_,
                  wrap_tag(tag), comm_, &requests_.back()),
        "MPI_Irecv");
  return static_cast<Request>(requests_.size() - 1);
}

std::string MpiTransport::creation_context() const {
  return "ringreduce.Communicator (rank " + std::to_string(rank_) + " of " +
         std::to_string(size_) + "): ";
}

std::string MpiTransport::creation_timeout_text(const char* left) const {
  return creation_context() + "not every rank made its Communicator within " +
         seconds_text(timeout_s_) +
         " (the timeout; MPI cannot say which have not): a rank skipped it, is stuck "
         "before it, or failed and is ending (MPI_Finalize keeps such a rank until every "
         "rank ends). " + left;
}

bool MpiTransport::wait_patiently(MPI_Request* request, const char* call) {
  StallTimer timer(timeout_s_);
  int done = 0, idle = 0;
  for (;;) {
    check(MPI_Test(request, &done, MPI_STATUS_IGNORE), call);
    if (done) return true;
    back_off(&idle);  // as MPI_Wait does: with more ranks than cores, spinning starves them
    if (timer.expired([&] { check_departures(); })) return false;
  }
}

void MpiTransport::wait(Request request) {
  if (wait_patiently(&requests_[request], "MPI_Test")) return;
  const bool send = is_send_[request];
  throw neighbour_timeout(timeout_s_, send ? right_ : left_, !send);
}

bool MpiTransport::test(Request request) {
  int flag = 0;
  check(MPI_Test(&requests_[request], &flag, MPI_STATUS_IGNORE), "MPI_Test");
  return flag != 0;
}

void MpiTransport::wait_all() {
  // One by one: each gets the timeout from when the one before it completed.
  for (size_t i = 0; i < requests_.size(); ++i)
    if (requests_[i] != MPI_REQUEST_NULL) wait(static_cast<Request>(i));
  requests_.clear();
  is_send_.clear();
}

void MpiTransport::allgather_bytes(const void* mine, void* all, int bytes) {
  // Non-blocking, to be able to give up (and measured faster than MPI_Allgather for
  // the header exchange: 3.2 vs 3.7 us on 2 ranks). Through buffers of our own: after
  // a timeout the collective stays pending, and a rank that joins late completes it,
  // writing into them (see leave()).
  start_allgather_bytes(mine, bytes);
  if (!wait_patiently(&exchange_, "MPI_Test(MPI_Iallgather)"))
    throw TimeoutError("waited " + seconds_text(timeout_s_) +
                       " (the timeout) for every rank to join this call (MPI cannot say which "
                       "have not): a rank skipped the call, or is stuck before it (in a call on another "
                       "Communicator that it makes first, say)",
                       -1, false, TimeoutError::Kind::kNotJoined);
  std::memcpy(all, exchange_recv_.data(), exchange_recv_.size());
}

void MpiTransport::start_allgather_bytes(const void* mine, int bytes) {
  exchange_send_.assign(static_cast<const char*>(mine), static_cast<const char*>(mine) + bytes);
  exchange_recv_.resize(static_cast<size_t>(bytes) * size_);
  check(MPI_Iallgather(exchange_send_.data(), bytes, MPI_BYTE, exchange_recv_.data(), bytes,
                       MPI_BYTE, comm_, &exchange_),
        "MPI_Iallgather");
}

bool MpiTransport::test_allgather_bytes(void* all) {
  int done = 0;
  check(MPI_Test(&exchange_, &done, MPI_STATUS_IGNORE), "MPI_Test(MPI_Iallgather)");
  if (!done) {
    check_notices();  // (not the stop request: the caller's loop sees an interrupt)
    return false;
  }
  std::memcpy(all, exchange_recv_.data(), exchange_recv_.size());
  return true;
}

void MpiTransport::creation_allgather(const void* mine, void* all, int bytes) {
  begin_creation_step();
  std::unique_ptr<char[]> send(new char[bytes]);
  std::unique_ptr<char[]> recv(new char[static_cast<size_t>(bytes) * size_]);
  std::memcpy(send.get(), mine, bytes);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallgather(send.get(), bytes, MPI_BYTE, recv.get(), bytes, MPI_BYTE, comm_,
                       &request),
        "MPI_Iallgather");
  // After a timeout or a stop the exchange stays pending, and a late rank completes it,
  // writing into its buffers: they are let go of for good.
  wait_in_creation(&request, "MPI_Test(MPI_Iallgather)", [&] {
    send.release();
    recv.release();
  });
  std::memcpy(all, recv.get(), static_cast<size_t>(bytes) * size_);
}

void MpiTransport::receive_notices() {
  if (comm_ == MPI_COMM_NULL) return;
  for (;;) {
    int flag = 0;
    MPI_Status status;
    check(MPI_Iprobe(MPI_ANY_SOURCE, tag_ub_, comm_, &flag, &status), "MPI_Iprobe");
    if (!flag) return;
    int64_t notice[kNoticeWords] = {};
    check(MPI_Recv(notice, kNoticeWords, MPI_INT64_T, status.MPI_SOURCE, tag_ub_, comm_,
                   MPI_STATUS_IGNORE),
          "MPI_Recv");
    DepartureNote note;
    note.rank = status.MPI_SOURCE;
    note.why = static_cast<Departure>(notice[0]);
    note.completed = notice[1];
    note.cause = static_cast<int>(notice[2]);
    note.cause_why = static_cast<Departure>(notice[3]);
    departures_.push_back(note);
  }
}

DepartureNote MpiTransport::first_departure(int64_t exchange) {
  receive_notices();
  DepartureNote first;
  for (const DepartureNote& note : departures_) first.prefer(note, exchange);
  return first;
}

void MpiTransport::check_departures() {
  stop_.check();
  if (creating_) check_creation_stopped();
  check_notices();
  if (also_check_) also_check_();
}

void MpiTransport::check_creation_stopped() const {
  if (!creation_stopped_on_this_thread()) return;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(creations_stopped_mutex);
    why = creations_stopped_why;
  }
  throw StoppedError(creation_context() + "stopped while making it: " + why +
                     ", and a rank had not made its own yet");
}

void MpiTransport::check_notices() {
  const DepartureNote reported = first_departure(exchange_number_);
  if (reported.holds_up(exchange_number_)) throw reported.timeout();
}

void MpiTransport::note_ended(int rank) const {
  if (comm_ == MPI_COMM_NULL) return;
  const int in_world = world_ranks(comm_, {rank})[0];
  if (in_world == MPI_UNDEFINED) return;
  std::lock_guard<std::mutex> lock(ended_mutex);
  ended_world_ranks().insert(in_world);
}

void MpiTransport::leave(const DepartureNote& note) {
  if (comm_ == MPI_COMM_NULL) return;
  // The notices: to every rank, as any of them may be waiting on a chunk that passed
  // through us. Small enough to be sent eagerly, so they need nothing more from us;
  // their buffer is never freed, as MPI reads it after we forget the requests.
  const auto* notice = new int64_t[kNoticeWords]{static_cast<int64_t>(note.why), note.completed,
                                                  note.cause,
                                                  static_cast<int64_t>(note.cause_why)};
  // Not to a rank known to have stopped using it: one that left never reads it again,
  // and one that dropped its Communicator unclosed (on shared memory, which told us)
  // may have freed its duplicate, whose context id a later communicator there gets,
  // with this notice on it.
  try {
    receive_notices();
  } catch (const std::exception&) {
  }
  std::set<int> gone = stopped_;
  for (const DepartureNote& known : departures_) gone.insert(known.rank);
  if (const double pause = departure_notice_pause_s.exchange(0); pause > 0) {
    // Driving MPI meanwhile, as a rank whose notices are merely slow would: a
    // collective this rank has joined (a step of the making) may need it to progress
    // before it completes on the others.
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(pause);
    while (std::chrono::steady_clock::now() < until) {
      int flag = 0;
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || gone.count(r)) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(notice, kNoticeWords, MPI_INT64_T, r, tag_ub_, comm_, &request) == MPI_SUCCESS)
      MPI_Request_free(&request);
  }
  // Receives still pending would write into the caller's buffers whenever the late
  // neighbour sends: cancel them (it takes effect at once unless the message is already
  // arriving; then the request is freed). Sends are freed; MPI still reads their
  // buffers if the late neighbour comes, so the Python layer keeps them alive for good.
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (requests_[i] == MPI_REQUEST_NULL) continue;
    if (!is_send_[i]) {
      MPI_Cancel(&requests_[i]);
      int done = 0;
      for (int tries = 0; tries < 1000 && !done; ++tries)
        MPI_Test(&requests_[i], &done, MPI_STATUS_IGNORE);
      if (done) continue;
    }
    MPI_Request_free(&requests_[i]);
  }
  requests_.clear();
  is_send_.clear();
  if (exchange_ != MPI_REQUEST_NULL) {
    // A collective's request can be neither cancelled nor freed: its buffers must
    // outlive us, so they go where nothing ever frees them.
    // (Communicators on other threads may leave at the same moment: one lock for all.)
    static auto* outliving_lock = new std::mutex;  // (never destroyed: used at exit)
    static auto* outliving = new std::vector<std::vector<char>>();
    const std::lock_guard<std::mutex> hold(*outliving_lock);
    outliving->push_back(std::move(exchange_send_));
    outliving->push_back(std::move(exchange_recv_));
    exchange_ = MPI_REQUEST_NULL;
  }
  // Not freed: freeing it could wait for the ranks still in a call, and, where MPI frees
  // it at once (MPICH under MPI_THREAD_MULTIPLE), would let a later communicator with
  // its context id receive the messages still on their way to this rank on it (these
  // notices, a chunk of a call left).
  forget_duplicate();
}

void MpiTransport::forget_duplicate() {
  if (comm_ == MPI_COMM_NULL) return;
  ++unfreed_duplicates;
  comm_ = MPI_COMM_NULL;
}

}  // namespace ringreduce
