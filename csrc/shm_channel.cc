#include "shm_channel.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "errors.h"
#include "mpi_transport.h"
#include "reduce.h"
#include "waiting.h"

namespace ringreduce {

namespace {

constexpr int64_t kCounterBytes = 128;  // each counter on its own pair of cache lines
// The departure word shares the exchange counter's pair, on the second line: it is
// written once, when its rank leaves.
constexpr int64_t kDepartureAt = 2 * kCounterBytes + 64;
// The word's fields, from the lowest bit: why (2 bits), cause_why (2), cause + 1 (12;
// 0 when not known, as for a rank beyond the field: every rank here is on one machine),
// completed (48: years of calls).
constexpr int kCauseShift = 4;
constexpr int kCauseBits = 12;
constexpr int kCompletedShift = kCauseShift + kCauseBits;

bool shm_disabled_by_environment() {
  const char* value = std::getenv("RINGREDUCE_SHM");
  return value != nullptr && std::strcmp(value, "0") == 0;
}

}  // namespace

std::unique_ptr<ShmChannel> ShmChannel::create(MPI_Comm comm, int64_t slot_bytes, int slots,
                                               int64_t board_bytes, const StopRequest* stop) {
  int rank = 0, size = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", -1);
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size", rank);
  if (size == 1) return nullptr;

  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type", rank);
  check_mpi(MPI_Comm_set_errhandler(node, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", rank);
  int node_size = 0;
  check_mpi(MPI_Comm_size(node, &node_size), "MPI_Comm_size", rank);
  // With key = rank and the same members, node ranks equal our ranks, so the ring's
  // neighbours are the same processes in both.
  int usable = (node_size == size && !shm_disabled_by_environment()) ? 1 : 0;
  int all_usable = 0;
  check_mpi(MPI_Allreduce(&usable, &all_usable, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce", rank);
  if (!all_usable) {
    MPI_Comm_free(&node);
    return nullptr;
  }

  std::unique_ptr<ShmChannel> channel(new ShmChannel());
  channel->comm_ = comm;
  channel->stop_ = stop;
  channel->slot_bytes_ = slot_bytes;
  channel->slots_ = slots;
  channel->rank_ = rank;
  channel->board_stride_ = (board_bytes + kCounterBytes - 1) / kCounterBytes * kCounterBytes;
  MPI_Info info;
  check_mpi(MPI_Info_create(&info), "MPI_Info_create", rank);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");  // each rank's part on its own pages
  void* base = nullptr;
  // Per rank: three counters (published, consumed, exchanged; the departure word beside
  // the last), two boards, the slots.
  const MPI_Aint bytes = kCounterBytes * 3 + channel->board_stride_ * 2 + slot_bytes * slots;
  const int rc = MPI_Win_allocate_shared(bytes, 1, info, node, &base, &channel->win_);
  MPI_Info_free(&info);
  check_mpi(rc, "MPI_Win_allocate_shared", rank);
  check_mpi(MPI_Win_set_errhandler(channel->win_, MPI_ERRORS_RETURN), "MPI_Win_set_errhandler",
            rank);

  auto query = [&](int r) {
    MPI_Aint size_r = 0;
    int disp_unit = 0;
    void* ptr = nullptr;
    check_mpi(MPI_Win_shared_query(channel->win_, r, &size_r, &disp_unit, &ptr),
              "MPI_Win_shared_query", rank);
    return static_cast<char*>(ptr);
  };
  const int64_t slots_at = kCounterBytes * 3 + channel->board_stride_ * 2;
  std::vector<char*> parts(size);  // every rank's part of the window
  for (int r = 0; r < size; ++r) {
    parts[r] = r == rank ? static_cast<char*>(base) : query(r);
    channel->exchanged_.push_back(reinterpret_cast<const uint64_t*>(parts[r] + 2 * kCounterBytes));
    channel->departures_.push_back(reinterpret_cast<const uint64_t*>(parts[r] + kDepartureAt));
    channel->boards_.push_back(parts[r] + 3 * kCounterBytes);
  }
  char* mine = parts[rank];
  char* left = parts[(rank + size - 1) % size];
  char* right = parts[(rank + 1) % size];
  channel->my_published_ = reinterpret_cast<uint64_t*>(mine);
  channel->my_consumed_ = reinterpret_cast<uint64_t*>(mine + kCounterBytes);
  channel->my_slots_ = mine + slots_at;
  channel->left_published_ = reinterpret_cast<const uint64_t*>(left);
  channel->left_slots_ = left + slots_at;
  channel->right_consumed_ = reinterpret_cast<const uint64_t*>(right + kCounterBytes);
  __atomic_store_n(channel->my_published_, 0, __ATOMIC_RELEASE);
  __atomic_store_n(channel->my_consumed_, 0, __ATOMIC_RELEASE);
  channel->my_exchanged_ = reinterpret_cast<uint64_t*>(mine + 2 * kCounterBytes);
  __atomic_store_n(channel->my_exchanged_, 0, __ATOMIC_RELEASE);
  channel->my_departure_ = reinterpret_cast<uint64_t*>(mine + kDepartureAt);
  __atomic_store_n(channel->my_departure_, 0, __ATOMIC_RELEASE);
  // A passive-target epoch for the window's lifetime, as MPI's memory model asks for
  // direct load/store access; the counters' atomics do the actual ordering.
  check_mpi(MPI_Win_lock_all(MPI_MODE_NOCHECK, channel->win_), "MPI_Win_lock_all", rank);
  check_mpi(MPI_Win_sync(channel->win_), "MPI_Win_sync", rank);
  check_mpi(MPI_Barrier(node), "MPI_Barrier", rank);  // every counter is zero before use
  MPI_Comm_free(&node);
  return channel;
}

ShmChannel::~ShmChannel() {
  // MPI_Win_free is collective and may wait for the other ranks, which a destructor
  // must never do; free() is the collective way out, MPI_Finalize the fallback.
}

void ShmChannel::free() {
  if (win_ == MPI_WIN_NULL) return;
  MPI_Win_unlock_all(win_);
  check_mpi(MPI_Win_free(&win_), "MPI_Win_free", -1);
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
                           " (the timeout): a rank skipped the call, or is stuck before it");
      }
    }
  }
}

DepartureNote ShmChannel::departure(int r) const {
  return note_of_word(r, __atomic_load_n(departures_[r], __ATOMIC_ACQUIRE));
}

void ShmChannel::look_around() const {
  int flag = 0;
  if (comm_ != MPI_COMM_NULL)
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE);
  check_departures();
}

void ShmChannel::check_departures() const {
  if (stop_ != nullptr) stop_->check();
  const DepartureNote reported = first_departure(exchange_);
  if (reported.holds_up(exchange_)) throw TimeoutError(reported.text());
}

DepartureNote ShmChannel::first_departure(int64_t exchange) const {
  DepartureNote first;
  for (int r = 0; r < static_cast<int>(departures_.size()); ++r)
    first.prefer(departure(r), exchange);
  return first;
}

uint64_t ShmChannel::departure_word(const DepartureNote& note) {
  const uint64_t cause = static_cast<uint64_t>(note.cause + 1);
  return (static_cast<uint64_t>(note.completed) << kCompletedShift) |
         (cause < (1u << kCauseBits) ? cause << kCauseShift : 0) |
         (static_cast<uint64_t>(note.cause_why) << 2) | static_cast<uint64_t>(note.why);
}

DepartureNote ShmChannel::note_of_word(int r, uint64_t word) {
  DepartureNote note;
  if (word != 0) {
    note.rank = r;
    note.why = static_cast<Departure>(word & 3);
    note.cause_why = static_cast<Departure>((word >> 2) & 3);
    note.cause = static_cast<int>((word >> kCauseShift) & ((1u << kCauseBits) - 1)) - 1;
    note.completed = static_cast<int64_t>(word >> kCompletedShift);
  }
  return note;
}

void ShmChannel::leave(const DepartureNote& note) {
  const uint64_t word = departure_word(note);
  __atomic_store_n(my_departure_, word, __ATOMIC_RELEASE);
  win_ = MPI_WIN_NULL;
}

bool ShmChannel::can_send() const {
  return sent_ - __atomic_load_n(right_consumed_, __ATOMIC_ACQUIRE) < static_cast<uint64_t>(slots_);
}

bool ShmChannel::can_receive() const {
  return __atomic_load_n(left_published_, __ATOMIC_ACQUIRE) > received_;
}

void ShmChannel::sent() { __atomic_store_n(my_published_, ++sent_, __ATOMIC_RELEASE); }

void ShmChannel::received() { __atomic_store_n(my_consumed_, ++received_, __ATOMIC_RELEASE); }

// One ring phase as a polling loop: publish our next chunk when its data is ready and
// the right neighbour has freed a slot; consume the left neighbour's next chunk when
// it is published. The left neighbour publishes in exactly the order we consume
// (the schedule is the same on both sides), and a chunk forwarded at step k+1 is the
// one consumed at step k, so the loop always has something that will become possible.
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
  size_t next_send = 0, next_recv = 0;
  int idle = 0;
  StallTimer timer(timeout_s_);
  while (next_send < sends.size() || next_recv < recvs.size()) {
    bool progressed = false;
    while (next_send < sends.size()) {
      const ChunkRef& u = sends[next_send];
      // A forwarded chunk is ready once we have consumed (and reduced) it.
      if (u.step > 0 && static_cast<int64_t>(next_recv) <= recv_step_start[u.step - 1] + u.chunk)
        break;
      if (!can_send()) break;
      const Span ch = sched.chunk(u.segment, u.chunk);
      std::memcpy(my_slot(sent_), send_source(u.step, ch), ch.count * elem_size);
      bytes_sent_ += ch.count * static_cast<int64_t>(elem_size);
      sent();
      ++next_send;
      progressed = true;
    }
    if (next_recv < recvs.size() && can_receive()) {
      const ChunkRef& u = recvs[next_recv];
      on_receive(sched.chunk(u.segment, u.chunk), left_slot(received_));
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
        const bool receiving = next_recv < recvs.size();
        throw TimeoutError(neighbour_timeout_text(
            timeout_s_, receiving ? sched.left() : sched.right(), receiving));
      }
    }
  }
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
        std::memcpy(data + ch.offset * elem_size, slot, ch.count * elem_size);
      },
      [&](int, Span ch) { return data + ch.offset * elem_size; });
}

}  // namespace ringreduce
