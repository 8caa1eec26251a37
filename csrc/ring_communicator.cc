#include "ring_communicator.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <thread>

#include "copy.h"
#include "errors.h"
#include "reduce.h"

namespace ringreduce {

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::AllReduce: return "allreduce";
    case Collective::ReduceScatter: return "reduce_scatter";
    case Collective::AllGather: return "allgather";
    case Collective::Broadcast: return "broadcast";
    case Collective::Close: return "close";
  }
  return "<unknown collective>";
}

namespace {

// A call header's check as words: 0 for a plain call; else the kind of caller its top
// byte names (the Python layer's Communicator.CHECK_*), and the hash below it. A plain
// call is the script's own, or the all-reduce of an agreement that the Python layer
// begins a call with (gradients.agree_or_raise): said so, as a script in
// load_state_dict() there (met by the others' step, say) made no plain call itself.
std::string describe_check(int64_t check) {
  if (check == 0)
    return "a plain call (the script's own, or the agreement that a DistributedOptimizer's "
           "construction, load_state_dict() or broadcast_parameters() begins with)";
  const uint64_t bits = static_cast<uint64_t>(check);
  const uint64_t kind = bits >> 56, hash = bits & ((uint64_t{1} << 56) - 1);
  const std::string number = " (check " + std::to_string(hash) + ")";
  if (kind == 1) return "allreduce_gradients" + number;
  if (kind == 2) return "a DistributedOptimizer's step" + number;
  return "check " + std::to_string(check);
}

// Groups ranks by the value `field` gives; empty if all agree. Otherwise
// "<name>: <value> on ranks 0-1; <value> on rank 2".
std::string describe_disagreement(const std::vector<CallHeader>& headers, const char* name,
                                  const std::function<std::string(const CallHeader&)>& field) {
  std::map<std::string, std::vector<int>> groups;
  std::vector<std::string> order;
  for (int r = 0; r < static_cast<int>(headers.size()); ++r) {
    std::string value = field(headers[r]);
    if (groups.find(value) == groups.end()) order.push_back(value);
    groups[value].push_back(r);
  }
  if (groups.size() <= 1) return "";
  std::string text = std::string(name) + ": ";
  for (size_t i = 0; i < order.size(); ++i) {
    if (i > 0) text += "; ";
    text += order[i] + " on " + describe_ranks(groups[order[i]]);
  }
  return text;
}

// Whether the ranks' headers agree on everything agree() compares: the common case,
// told apart with integer comparisons only. Wherever it says no (it may where the
// texts would agree, as two unknown dtypes read alike), agree() builds the texts, which
// cost about a microsecond a call (maps and strings), to say what differs.
bool headers_agree(const std::vector<CallHeader>& headers) {
  const CallHeader& first = headers.front();
  const auto kind = static_cast<Collective>(first.collective);
  int64_t total_rows = 0;
  for (const CallHeader& h : headers) {
    if (h.magic != CallHeader::kMagic || h.invalid || h.collective != first.collective ||
        h.memory != first.memory || h.dtype != first.dtype)
      return false;
    if (first.memory == kDeviceMemory && h.host_limit != first.host_limit) return false;
    switch (kind) {
      case Collective::AllReduce:
      case Collective::ReduceScatter:
        if (h.op != first.op || h.count != first.count || h.check != first.check) return false;
        break;
      case Collective::Broadcast:
        if (h.count != first.count || h.extra != first.extra) return false;
        break;
      case Collective::AllGather:
        // (a shape's text also shows its elements, extra, where the tag holds a hash)
        if (h.shape_tag != first.shape_tag || h.extra != first.extra) return false;
        // Rows of no bytes may number 2^60 an array: their sum can pass int64, and a
        // wrapped one would pass for a small total (and every sum after agreement is safe).
        if (__builtin_add_overflow(total_rows, h.count, &total_rows)) return false;
        break;
      default:
        break;
    }
  }
  if (kind == Collective::AllGather)
    for (const CallHeader& h : headers)
      if (h.out_rows >= 0 && h.out_rows != total_rows) return false;
  return true;
}

std::string dtype_text(const CallHeader& h) {
  return is_valid_dtype(h.dtype) ? dtype_name(static_cast<DType>(h.dtype)) : "<invalid dtype>";
}
std::string op_text(const CallHeader& h) {
  return is_valid_op(h.op) ? std::string("'") + op_name(static_cast<Op>(h.op)) + "'" : "<invalid op>";
}
// allgather's row shape, "(2, 3)", from the tag (see CallHeader::shape_tag); a shape
// too big for the tag only by its element count.
std::string row_shape_text(const CallHeader& h) {
  constexpr int kDimBits = 20;
  const int64_t dims = h.shape_tag >> 60;
  if (dims > 3)
    return "a shape of " + std::to_string(h.extra) + " elements (with more than 3 dimensions, "
           "or one of 2**20 or more; hash " + std::to_string(h.shape_tag & ((1LL << 60) - 1)) + ")";
  std::string text = "(";
  for (int64_t i = 0; i < dims; ++i) {
    if (i > 0) text += ", ";
    text += std::to_string((h.shape_tag >> (kDimBits * i)) & ((1LL << kDimBits) - 1));
  }
  return text + (dims == 1 ? ",)" : ")");
}

std::atomic<bool> process_ending{false};  // see note_process_ending()

// How long agree(), meeting headers that disagree, looks for news that a rank gave up
// on this exchange before it raises MismatchError (departure_behind_mismatch()).
// Nothing makes that news come before the header the rank had posted: on shared memory
// it writes its departure word a few microseconds after it last looked at the others'
// posts (a rank that posts in between reads its header first), and over MPI messages
// its notice is a point-to-point message sent after it gave up, while its header left
// with the exchange begun before (a collective, which MPI does not order with
// point-to-point messages, and whose bytes may come through a third rank). A late rank
// usually comes long after, and finds the news at the first look; only one that comes
// just as the other gives up can miss it, for microseconds on one machine or a
// network's latency between machines: 20 ms also covers a rank on an oversubscribed
// core that loses it for a scheduler's time slice. Past that, MismatchError, and the
// next call says who left. Every rank that meets a mismatch pays it alike, on an error
// path (some 20 ms a MismatchError), and no agreeing call does.
constexpr std::chrono::milliseconds kMismatchNoticeGrace{20};

}  // namespace

void note_process_ending() { process_ending.store(true, std::memory_order_release); }

CallHeader make_header(Collective collective, DType dtype, Op op, int64_t count,
                       int64_t chunk_bytes, int64_t memory, int64_t check) {
  CallHeader h;
  h.check = check;
  h.memory = memory;
  h.collective = static_cast<int64_t>(collective);
  h.dtype = static_cast<int64_t>(dtype);
  h.op = static_cast<int64_t>(op);  // compared only for allreduce and reduce_scatter
  h.count = count;
  h.chunk_bytes = chunk_bytes;
  return h;
}

int64_t RingCommunicator::inline_capacity_for(int ranks, bool shm) {
  if (ranks <= 1) return 0;
  // 16-byte steps (and a header a multiple of 16 bytes) keep every rank's payload
  // aligned for the vector loads that reduce it.
  const int64_t most = shm ? kShmInlineMaxBytes : kInlineMaxBytes;
  const int64_t budget = shm ? kShmInlineBudgetBytes : kInlineBudgetBytes;
  return std::max<int64_t>(64, std::min<int64_t>(most, budget / (ranks - 1)) / 16 * 16);
}

RingCommunicator::RingCommunicator(MPI_Comm user_comm, double timeout_s,
                                   const std::atomic<uint64_t>* interrupts,
                                   const std::string& refusal)
    : transport_(std::make_unique<MpiTransport>(user_comm, timeout_s, interrupts, refusal)) {
  const int p = size();
  const int64_t board_payload = std::max(inline_capacity_for(p, true), kShmBroadcastInlineBytes);
  std::vector<std::string> machines;
  bool ring_in_rank_order = false;
  shm_ = ShmChannel::create(*transport_, kShmSlotBytes, kShmSlots,
                            sizeof(CallHeader) + board_payload, &why_not_shared_memory_,
                            &machines, &ring_in_rank_order);
  if (!shm_ && !ring_in_rank_order) {  // (shared memory: one machine, so rank order)
    ring_ = ring_order_by_machine(machines);
    ring_positions_.resize(ring_.size());
    for (size_t q = 0; q < ring_.size(); ++q) ring_positions_[ring_[q]] = static_cast<int>(q);
    const int position = ring_position(rank());
    transport_->set_neighbours(rank_at((position + p - 1) % p), rank_at((position + 1) % p));
  }
  if (shm_) {
    // Each wire's waits also look at what only the other one sees: killed processes,
    // and departure notices sent as MPI messages (by a rank stopped while making it).
    transport_->also_check([channel = shm_.get()] { channel->check_alive(); });
    shm_->also_check([transport = transport_.get()] { transport->check_notices(); });
  }
  inline_capacity_ = inline_capacity_for(p, shm_ != nullptr);
  broadcast_inline_capacity_ = shm_ ? board_payload : inline_capacity_;
  if (!shm_) {
    outgoing_.assign(slot_bytes(), 0);
    exchange_.assign(slot_bytes() * p, 0);
  }
  inline_scratch_.assign(2 * inline_capacity_, 0);
  world_ranks_note_ = world_ranks_note(user_comm);
  const char* shm_setting = std::getenv("RINGREDUCE_SHM");
  const bool streaming = shm_setting != nullptr && std::strcmp(shm_setting, "stream") == 0;
  tune_wire_ = !streaming && (shm_setting == nullptr || std::strcmp(shm_setting, "1") != 0);
  fixed_wire_ = streaming && kStreamingStores ? kWireShmStreaming : kWireShm;
  tuners_.fill(WireTuner(kStreamingStores));
  set_timeout(timeout_s);
  transport_->created();
}

std::vector<int> RingCommunicator::ring_order() const {
  std::vector<int> order(size());
  for (int q = 0; q < size(); ++q) order[q] = rank_at(q);
  return order;
}

std::string RingCommunicator::world_ranks_note(MPI_Comm comm) {
  // Messages name ranks of this communicator; mpiexec labels output by MPI_COMM_WORLD's.
  // On a sub-communicator the two differ, and "rank 1" would point at another process.
  int same = MPI_UNEQUAL;
  MPI_Comm_compare(comm, MPI_COMM_WORLD, &same);
  if (same == MPI_IDENT || same == MPI_CONGRUENT) return "";
  int p = 0;
  MPI_Comm_size(comm, &p);
  constexpr int kShown = 16;
  const int shown = std::min(p, kShown);
  std::vector<int> ranks(shown);
  for (int r = 0; r < shown; ++r) ranks[r] = r;
  const std::vector<int> in_world = world_ranks(comm, ranks);
  std::string text = " [ranks of this communicator; in MPI_COMM_WORLD: ";
  for (int r = 0; r < shown; ++r)
    text += (r ? ", " : "") + std::to_string(r) + " is " +
            (in_world[r] == MPI_UNDEFINED ? std::string("not in it")
                                          : std::to_string(in_world[r]));
  return text + (p > shown ? ", ...]" : "]");
}

void RingCommunicator::propose_wire(CallHeader* h, int64_t bytes) {
  if (rank() != 0 || !use_shm(bytes)) return;
  h->wire = tune_wire_ ? tuner(static_cast<Collective>(h->collective)).choose(bytes)
                      : fixed_wire_;
}

bool RingCommunicator::take_agreed_wire(int64_t bytes) {
  const bool shm = use_shm(bytes) && headers_[0].wire != kWireMpi;
  if (shm) shm_->set_streaming(headers_[0].wire == kWireShmStreaming);
  return shm;
}

RingSchedule RingCommunicator::agree_on_ring(CallHeader h, int64_t bytes, size_t elem_size,
                                             bool* shm) {
  propose_wire(&h, bytes);
  const int64_t agreed_chunk = agree(h);
  *shm = take_agreed_wire(bytes);
  return RingSchedule::split_evenly(rank(), size(), h.count,
                                    ring_chunk_elems(agreed_chunk, elem_size, *shm), ring_);
}

template <typename Run>
void RingCommunicator::run_tuned(Collective collective, int64_t bytes, Run run) {
  // Only calls whose wire rank 0's tuner chose (propose_wire()) teach it anything.
  if (rank() != 0 || !tune_wire_ || !use_shm(bytes) || headers_[0].wire == -1) {
    run();
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  run();
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  record_wire_time(collective, bytes, static_cast<int>(headers_[0].wire), took.count());
}

bool RingCommunicator::use_shm(int64_t total_bytes) const {
  // Shared memory passes each chunk through a slot: one copy more than MPI's
  // single-copy transfer of large messages, but no per-message cost. Measured on the
  // development machine, it wins up to a few MiB and loses beyond ~16 MiB. Below the
  // limit it is only a candidate: rank 0's WireTuner picks the wire (propose_wire()).
  return shm_ && total_bytes <= kShmMaxBytes;
}

int64_t RingCommunicator::ring_chunk_elems(int64_t agreed_chunk_bytes, size_t elem_size,
                                           bool shm) const {
  // Shared-memory chunks must fit a slot; MPI chunks only an int message size.
  return chunk_elems(shm ? std::min(agreed_chunk_bytes, shm_->slot_bytes()) : agreed_chunk_bytes,
                     elem_size);
}

void RingCommunicator::run_reduce_scatter(const RingSchedule& sched, DType dtype, Op op,
                                          const void* input, void* out, bool shm,
                                          void* own_out) {
  count_ring_steps(sched.steps_per_phase());
  if (shm) {
    shm_->reduce_scatter(sched, dtype, op, input, out, own_out);
  } else {
    ring_reduce_scatter(sched, *transport_, dtype, op, input, out,
                        recv_slots(sched, dtype_size(dtype)), own_out);
  }
}

int64_t RingCommunicator::copy_chunk_elems(int64_t chunk_elems, size_t elem_size) {
  const int64_t cap = Transport::kMaxMessageBytes / static_cast<int64_t>(elem_size);
  return std::min(cap, chunk_elems * kCopyChunkFactor);
}

RingSchedule RingCommunicator::copy_schedule(const RingSchedule& sched, size_t elem_size) {
  return sched.with_chunk_elems(copy_chunk_elems(sched.chunk_elems(), elem_size));
}

void RingCommunicator::run_allgather(const RingSchedule& sched, size_t elem_size, void* buf,
                                     bool shm, const void* own_input) {
  count_ring_steps(sched.steps_per_phase());
  if (shm) {
    shm_->allgather(sched, elem_size, buf);  // chunks must fit its slots
  } else {
    ring_allgather(copy_schedule(sched, elem_size), *transport_, elem_size, buf, kWindow,
                   own_input);
  }
}

Span RingCommunicator::segment_of(int rank, int size, int64_t count) {
  const int64_t base = count / size, extra = count % size;
  const int64_t offset = rank * base + std::min<int64_t>(rank, extra);
  return {offset, base + (rank < extra ? 1 : 0)};
}

void RingCommunicator::check_usable(const char* collective) const {
  if (closed_ || gave_up_ || broken_by_mpi_ || !broken_.empty()) {
    const std::string at = collective ? where(collective) : std::string();
    if (closed_) throw std::invalid_argument(at + "this ringreduce Communicator has been closed");
    if (gave_up_)
      throw TimeoutError(at + "this ringreduce Communicator gave up earlier: " + broken_);
    if (broken_by_mpi_)
      throw MpiError(at + "this ringreduce Communicator is unusable after an earlier MPI "
                     "error: " + broken_);
    throw std::runtime_error(at + "this ringreduce Communicator is unusable after an "
                             "earlier error on this rank: " + broken_);
  }
  // Every wait drives MPI now and then, which after MPI_Finalize ends the process.
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) throw MpiError("MPI has been finalised (MPI.Finalize()): no call can follow");
}

void RingCommunicator::set_timeout(double seconds) {
  transport_->set_timeout(seconds);
  if (shm_) shm_->set_timeout(seconds);
}

std::string RingCommunicator::where(const char* collective) const {
  return std::string("ringreduce.") + collective + " (rank " + std::to_string(rank()) + " of " +
         std::to_string(size()) + "): ";
}

void RingCommunicator::give_up(const char* collective, const TimeoutError& e) {
  gave_up_ = true;
  broken_ = where(collective) + e.what() + world_ranks_note_;
  const DepartureNote first = first_departure();
  const DepartureNote origin = first.origin();
  const bool ended = origin.rank >= 0 && origin.why == Departure::Ended;
  if (ended) transport_->note_ended(origin.rank);  // (before leaving: it needs the comm)
  if (first.rank >= 0)
    depart(Departure::Followed, -1, !first.seen_by_all);
  else
    depart(e.vanished ? Departure::Vanished : Departure::GaveUp, e.waited_for);
  if (ended) throw TimeoutError(broken_ + ". " + kEndedAdvice, -1, false, e.kind);
  // (The timeout's setting named only where the wait ran out: not after another
  // rank's departure, which no timeout would have waited out.)
  throw TimeoutError(broken_ +
                     ". This Communicator can no longer be used on this rank; to go on, make a "
                     "new one on every rank" +
                     (first.rank >= 0 || e.vanished ? ""
                                                    : " (Communicator(timeout=...) sets the timeout)"),
                     -1, false, e.kind);
}

void RingCommunicator::depart(Departure why, int waited_for, bool over_mpi) {
  if (departed_) return;
  departed_ = true;
  // Whatever made it leave (a call stopped at exit, say), the others must know that
  // this process is ending: then they make no new Communicator that waits for it.
  if (process_ending.load(std::memory_order_acquire)) why = Departure::Ended;
  DepartureNote note;
  note.rank = rank();
  note.why = why;
  // A call that failed here (a timeout too sets broken_), or a header exchange still
  // pending (a close at exit begun), was not seen through, so the ranks still in it are
  // held up.
  note.completed = exchanges_ - (broken_.empty() && !transport_->exchange_pending() ? 0 : 1);
  if (why == Departure::GaveUp || why == Departure::Vanished) note.cause = waited_for;
  if (why == Departure::Followed) {
    // Whom it follows: a rank that held up this call, rather than one that left
    // after finishing it; else any that left.
    DepartureNote first = first_departure(exchanges_);
    if (first.rank < 0) first = first_departure();
    first = first.origin();
    if (first.why != Departure::Followed) {  // (else whom it followed is not known)
      note.cause = first.rank;
      note.cause_why = first.why;
    }
  }
  if (shm_) {
    shm_->leave(note);
    // (Their MPI notices, if any, the transport sees for itself.)
    for (int r = 0; r < size(); ++r)
      if (r != rank() && shm_->departure(r).rank >= 0) transport_->note_stopped(r);
  }
  if (over_mpi)
    transport_->leave(note);
  else
    untold_.reset(new DepartureNote(note));
}

void RingCommunicator::tell_departure() {
  if (!untold_) return;
  transport_->leave(*untold_);
  untold_.reset();
}

void RingCommunicator::begin_exchange() {
  ++exchanges_;
  if (shm_) shm_->set_exchange(exchanges_);
  transport_->set_exchange(exchanges_);
}

void RingCommunicator::leave(bool over_mpi) {
  if (closed_) return;
  closed_ = true;
  if (size() > 1) depart(Departure::Left, -1, over_mpi);
}

void RingCommunicator::leave_unclosed() {
  if (closed_ || departed_ || size() == 1 || !shm_) return;
  // (Not departed_: no message of this rank's is in flight, so nothing must outlive it.)
  closed_ = true;
  DepartureNote note;
  note.rank = rank();
  note.why = Departure::Unclosed;
  note.completed = exchanges_;
  shm_->leave(note);
}

bool RingCommunicator::begin_close_at_exit() {
  if (closed_ || departed_ || !broken_.empty() || size() == 1) return false;
  if (shm_) {
    leave_unclosed();
    return false;
  }
  // A rank that made more calls waits for this one in the next; nothing but this header
  // can tell it, over MPI, without leaving a message unreceived (see check_closed_at_exit).
  CallHeader h = make_header(Collective::Close, DType::Float32, Op::Sum, 0, kDefaultChunkBytes);
  h.extra = CallHeader::kClosedAtExit;
  std::memcpy(outgoing_.data(), &h, sizeof(CallHeader));
  begin_exchange();
  try {
    transport_->start_allgather_bytes(outgoing_.data(), static_cast<int>(slot_bytes()));
  } catch (const std::exception&) {
    closed_ = true;  // (an MPI error: nothing more to do at exit)
    return false;
  }
  return true;
}

bool RingCommunicator::finish_close_at_exit() {
  if (closed_) return true;
  try {
    if (!transport_->test_allgather_bytes(exchange_.data())) return false;
  } catch (const std::exception&) {
    // Another rank left (it said why where it did), or an MPI error: the exchange stays
    // pending, so its buffers must outlive it.
    closed_ = true;
    depart(first_departure().rank >= 0 ? Departure::Followed : Departure::Left);
    return true;
  }
  closed_ = true;
  const int64_t slot = slot_bytes();
  for (int r = 0; r < size(); ++r) {
    CallHeader h;
    std::memcpy(&h, exchange_.data() + r * slot, sizeof(CallHeader));
    // A rank in a call raised, seeing this header: nothing is in flight, and nothing is
    // freed that it would have to free too.
    if (h.collective != static_cast<int64_t>(Collective::Close)) return true;
  }
  release_device();
  transport_->free();
  return true;
}

void RingCommunicator::check_closed_at_exit(const CallHeader& mine) {
  if (mine.collective == static_cast<int64_t>(Collective::Close)) return;
  bool gone = false;
  for (int r = 0; r < size(); ++r) {
    const CallHeader& h = headers_[r];
    if (h.collective != static_cast<int64_t>(Collective::Close) ||
        h.extra != CallHeader::kClosedAtExit)
      continue;
    DepartureNote note;
    note.rank = r;
    note.why = Departure::Unclosed;
    note.completed = exchanges_ - 1;  // it saw every call before this one through
    note.seen_by_all = true;
    transport_->note_departure(note);
    gone = true;
  }
  if (gone) transport_->check_departures();
}

void RingCommunicator::stop_soon(const std::string& why) { transport_->stop_soon(why); }

DepartureNote RingCommunicator::first_departure(int64_t exchange) {
  DepartureNote first = transport_->first_departure(exchange);
  if (shm_) first.prefer(shm_->first_departure(exchange), exchange);
  return first;
}

DepartureNote RingCommunicator::departure_behind_mismatch() {
  // Only departures that hold up this exchange: a rank that saw it through and left
  // later (a close() that met this rank's call, say) did disagree, and said so itself.
  // A completed exchange never waited, so never looked: a notice that came long ago is
  // found at the first look.
  const auto until = std::chrono::steady_clock::now() + kMismatchNoticeGrace;
  for (;;) {
    const DepartureNote gone = first_departure(exchanges_);  // (MPI's look drives MPI)
    if (gone.rank >= 0 || std::chrono::steady_clock::now() >= until) return gone;
    // (Not spinning: with more ranks than cores, the rank whose news it waits for may
    // need this core.)
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

RingCommunicator::~RingCommunicator() {
  if (getpid() != maker_pid_) {
    // A copy in a child made by fork(): the MPI communicator, the shared memory (not
    // mapped here: MADV_DONTFORK) and the GPU are the parent's. Freeing them would call
    // MPI, or unmap whatever the child has mapped since at those addresses.
    shm_.release();
    transport_.release();
    host_mirror_.release();
    device_scratch_.release();
    device_.release();
    return;
  }
  leave_unclosed();  // dropped unclosed: a rank still calling would wait for this one
  // A rank that left told this one over MPI messages too (maybe not yet here), and
  // freeing the duplicate would hand its notice to a later communicator (see
  // ~MpiTransport, which looks for the notices themselves). Ranks that merely dropped
  // theirs unclosed sent nothing.
  if (shm_ && !departed_ && transport_->comm() != MPI_COMM_NULL) {
    for (int r = 0; r < size(); ++r) {
      const DepartureNote note = shm_->departure(r);
      if (r != rank() && note.rank >= 0 && note.why != Departure::Unclosed) {
        transport_->forget_duplicate();
        break;
      }
    }
  }
  // (shm_ goes before transport_, which must not look into it then; nor, though
  // nothing waits on it any more, does shm_ look into transport_.)
  transport_->also_check(nullptr);
  if (shm_) shm_->also_check(nullptr);
  if (!departed_) {
    // GPU buffers freed with our GPU current: freed as members, on a thread without a
    // CUDA context (the garbage collector's), they would make one on GPU 0.
    release_device();
    return;
  }
  // MPI may still read (sends) or write (a receive it could not cancel) these whenever
  // a late rank comes: they must outlive everything, so they are leaked.
  scratch_.release();
  host_mirror_.release();
  device_scratch_.release();
  device_.release();
}

int64_t RingCommunicator::chunk_elems(int64_t chunk_bytes, size_t elem_size) const {
  const int64_t bytes = std::min(chunk_bytes, Transport::kMaxMessageBytes);
  return std::max<int64_t>(1, bytes / static_cast<int64_t>(elem_size));
}

RecvSlots RingCommunicator::recv_slots(const RingSchedule& sched, size_t elem_size) {
  // A slot holds one chunk, and no chunk is larger than the largest segment (the first,
  // in the np.array_split layout): a small call never needs chunk_bytes of scratch.
  int64_t slot_elems = 0;
  if (sched.size() > 1) slot_elems = std::min(sched.chunk_elems(), sched.segment(0).count);
  const int64_t slot_bytes = std::max<int64_t>(1, slot_elems * static_cast<int64_t>(elem_size));
  const int64_t needed = slot_bytes * kWindow;
  if (scratch_bytes_ < needed) {
    scratch_.reset(new char[needed]);  // uninitialised: every byte is received before use
    scratch_bytes_ = needed;
  }
  return RecvSlots{scratch_.get(), slot_bytes, kWindow};
}

int64_t RingCommunicator::agree(const CallHeader& mine, std::vector<CallHeader>* all,
                                const void* payload, int64_t payload_bytes) {
  const char* collective = collective_name(static_cast<Collective>(mine.collective));
  check_usable(collective);
  const int p = size();
  headers_.resize(p);
  CallHeader sent = mine;
  if (sent.memory == kDeviceMemory) sent.host_limit = device_host_reduce_bytes_;
  if (p == 1) {
    headers_[0] = sent;
  } else if (shm_) {
    begin_exchange();
    char* board = shm_->next_board();
    std::memcpy(board, &sent, sizeof(CallHeader));
    if (payload_bytes > 0) copy_bytes(board + sizeof(CallHeader), payload, payload_bytes);
    guarded(collective, [&] { shm_->exchange(); });
    for (int r = 0; r < p; ++r) std::memcpy(&headers_[r], shm_->posted(r), sizeof(CallHeader));
  } else {
    const int64_t slot = slot_bytes();
    std::memcpy(outgoing_.data(), &sent, sizeof(CallHeader));
    if (payload_bytes > 0)
      copy_bytes(outgoing_.data() + sizeof(CallHeader), payload, payload_bytes);
    // Only the bytes in use need to be right; the rest of the slot is ignored.
    begin_exchange();
    guarded(collective, [&] {
      transport_->allgather_bytes(outgoing_.data(), exchange_.data(), static_cast<int>(slot));
      for (int r = 0; r < p; ++r)
        std::memcpy(&headers_[r], exchange_.data() + r * slot, sizeof(CallHeader));
      check_closed_at_exit(sent);
    });
  }
  if (all) *all = headers_;
  if (mine.invalid) return 0;  // the caller raises its own, more precise error
  if (headers_agree(headers_)) return headers_[0].chunk_bytes;

  std::vector<std::string> problems;
  auto add = [&](std::string text) {
    if (!text.empty()) problems.push_back(std::move(text));
  };
  std::vector<int> invalid_ranks, rejected, failed;
  for (int r = 0; r < p; ++r)
    if (headers_[r].magic != CallHeader::kMagic)
      throw MpiError("rank " + std::to_string(r) + " sent a malformed call header; is every "
                     "rank running the same ringreduce version?");
    else if (headers_[r].invalid) {
      invalid_ranks.push_back(r);
      (headers_[r].invalid == CallHeader::kFailed ? failed : rejected).push_back(r);
    }
  if (!rejected.empty())
    add(describe_ranks(rejected) + " rejected " + (rejected.size() == 1 ? "its" : "their") +
        " arguments (see the error raised there)");
  if (!failed.empty())
    add(describe_ranks(failed) + " failed to prepare this call (see the error raised there)");
  const std::string kinds = describe_disagreement(headers_, "collective", [](const CallHeader& h) {
    return std::string(collective_name(static_cast<Collective>(h.collective)));
  });
  add(kinds);
  if (invalid_ranks.empty() && kinds.empty()) {
    const auto kind = static_cast<Collective>(mine.collective);
    add(describe_disagreement(headers_, "memory", [](const CallHeader& h) {
      return std::string(h.memory == kDeviceMemory ? "GPU (cupy)" : "host (numpy)");
    }));
    add(describe_disagreement(headers_, "dtype", dtype_text));
    if (kind == Collective::AllReduce || kind == Collective::ReduceScatter) {
      add(describe_disagreement(headers_, "op", op_text));
      add(describe_disagreement(headers_, "count (x.size)",
                                [](const CallHeader& h) { return std::to_string(h.count); }));
      // In words: a user who made a plain call never gave a check, and one made by
      // the Python layer's callers says in its top byte which kind of caller it is
      // (Communicator._check; the rest is a hash of what that caller reduces).
      add(describe_disagreement(headers_, "what made the call (the caller's check of it)",
                                [](const CallHeader& h) { return describe_check(h.check); }));
    } else if (kind == Collective::Broadcast) {
      add(describe_disagreement(headers_, "count (x.size)",
                                [](const CallHeader& h) { return std::to_string(h.count); }));
      add(describe_disagreement(headers_, "root",
                                [](const CallHeader& h) { return std::to_string(h.extra); }));
    } else if (kind == Collective::AllGather) {
      const std::string rows_differ =
          describe_disagreement(headers_, "x.shape[1:]", row_shape_text);
      add(rows_differ);
      int64_t total_rows = 0;
      bool too_many = false;
      for (const CallHeader& h : headers_)
        too_many = too_many || __builtin_add_overflow(total_rows, h.count, &total_rows);
      if (too_many) {
        const auto rows = [](const CallHeader& h) { return std::to_string(h.count); };
        const std::string each = describe_disagreement(headers_, "x.shape[0]", rows);
        add("the ranks' rows add up to more than 2**63 - 1, more than an array can have (" +
            (each.empty() ? "x.shape[0]: " + rows(headers_[0]) + " on every rank" : each) + ")");
      }
      std::vector<int> misfits;
      for (int r = 0; r < p; ++r)
        if (headers_[r].out_rows >= 0 && headers_[r].out_rows != total_rows) misfits.push_back(r);
      if (rows_differ.empty() && !too_many && !misfits.empty())
        add("out= on " + describe_ranks(misfits) + " does not have the " +
            std::to_string(total_rows) + " rows the ranks gather (out.shape[0]: " +
            std::to_string(headers_[misfits[0]].out_rows) + " on rank " +
            std::to_string(misfits[0]) + ")");
    }
    if (problems.empty() && mine.memory == kDeviceMemory)  // decides each GPU call's path
      add(describe_disagreement(headers_, "device_host_reduce_bytes", [](const CallHeader& h) {
        return std::to_string(h.host_limit);
      }));
  }
  if (!problems.empty()) {
    // A rank that gave up on this call (a timeout, or an error, while it waited for this
    // rank) left its header posted, and this rank, coming late, met it here: the ranks
    // do not disagree, that rank is gone, and the Communicator with it. Say so, as the
    // next call would (a MismatchError promises a usable Communicator).
    if (p > 1) {
      const DepartureNote gone = departure_behind_mismatch();
      if (gone.rank >= 0) give_up(collective, gone.timeout());
    }
    std::string text = std::string("ringreduce.") + collective +
                       ": ranks disagree (raised on rank " + std::to_string(rank()) + " of " +
                       std::to_string(p) + "): ";
    for (size_t i = 0; i < problems.size(); ++i) text += (i ? ". " : "") + problems[i];
    bool all_checked = true;
    std::vector<int64_t> checks;
    for (const CallHeader& h : headers_) {
      all_checked &= !h.invalid && h.collective == mine.collective && h.check != 0 &&
                     (h.check >> 56) == (mine.check >> 56);
      checks.push_back(h.check);
    }
    if (all_checked) throw CheckedCallsMismatch(text + world_ranks_note_, std::move(checks));
    throw MismatchError(text + world_ranks_note_, std::move(checks));
  }
  return headers_[0].chunk_bytes;
}

void RingCommunicator::announce_invalid(Collective collective, int64_t chunk_bytes,
                                        int64_t memory, int64_t why) {
  CallHeader h = make_header(collective, DType::Float16, Op::Sum, 0, chunk_bytes, memory);
  h.invalid = why;
  agree(h);
}


void RingCommunicator::allreduce(const void* input, void* out, int64_t count, DType dtype, Op op,
                                 int64_t chunk_bytes, int64_t check) {
  allreduce_host(make_header(Collective::AllReduce, dtype, op, count, chunk_bytes, kHostMemory,
                             check),
                 input, out);
}

void RingCommunicator::set_device_host_reduce_bytes(int64_t bytes) {
  if (bytes < 0) throw std::invalid_argument("device_host_reduce_bytes must be >= 0");
  device_host_reduce_bytes_ = bytes;
}

void RingCommunicator::allreduce_host(const CallHeader& header, const void* input, void* out) {
  CallHeader h = header;
  const auto dtype = static_cast<DType>(h.dtype);
  const auto op = static_cast<Op>(h.op);
  const int64_t count = h.count;
  const size_t es = dtype_size(dtype);
  const int64_t bytes = count * static_cast<int64_t>(es);
  if (rides_inline(bytes)) {
    h.inline_bytes = bytes;
    agree(h, nullptr, input, bytes);  // every rank agreed on count, so all inlined theirs
    allreduce_inline(out, count, dtype, op);
    return;
  }
  bool shm = false;
  const RingSchedule sched = agree_on_ring(h, bytes, es, &shm);
  guarded("allreduce", [&] {
    run_tuned(Collective::AllReduce, bytes, [&] {
      run_reduce_scatter(sched, dtype, op, input, out, shm);
      const Span mine = sched.segment(rank());
      if (op == Op::Avg && size() > 1)  // (x / 1 is x: one rank keeps its NaNs' bits)
        divide(dtype, static_cast<char*>(out) + mine.offset * es, mine.count, size());
      run_allgather(sched, es, out, shm);
    });
  });
}

void RingCommunicator::reduce_inline(int s, void* dst, int64_t count, DType dtype, Op op) {
  // Segment s in exactly the order the ring reduces it (see ring_schedule.h),
  // x[s] OP (x[s-1] OP (... OP x[s+1])), ranks as they go round the ring from s, so the
  // answer is the ring's, bit for bit. The first step reads two payloads and the last
  // writes into dst, so that on two ranks a segment is one pass; two scratch
  // accumulators take turns in between.
  const int p = size();
  const int q = ring_position(s);
  const size_t es = dtype_size(dtype);
  const Span seg = segment_of(s, p, count);
  if (seg.count == 0) return;
  const int64_t offset = seg.offset * static_cast<int64_t>(es);
  char* scratch[2] = {inline_scratch_.data(), inline_scratch_.data() + inline_capacity_};
  const char* acc = inline_payload(rank_at((q + 1) % p)) + offset;
  for (int j = 2; j <= p; ++j) {
    char* into = j == p ? static_cast<char*>(dst) : scratch[j % 2];
    reduce(dtype, op, into, inline_payload(rank_at((q + j) % p)) + offset, acc, seg.count);
    acc = into;
  }
  if (op == Op::Avg) divide(dtype, dst, seg.count, p);
}

void RingCommunicator::allreduce_inline(void* out, int64_t count, DType dtype, Op op) {
  const size_t es = dtype_size(dtype);
  for (int s = 0; s < size(); ++s)
    reduce_inline(s, static_cast<char*>(out) + segment_of(s, size(), count).offset * es, count,
                  dtype, op);
}

void RingCommunicator::reduce_scatter(const void* input, void* work, int64_t count, DType dtype,
                                      Op op, int64_t chunk_bytes, void* own_out) {
  reduce_scatter_host(make_header(Collective::ReduceScatter, dtype, op, count, chunk_bytes),
                      input, work, own_out);
}

void RingCommunicator::reduce_scatter_host(const CallHeader& header, const void* input,
                                           void* work, void* own_out) {
  CallHeader h = header;
  const auto dtype = static_cast<DType>(h.dtype);
  const auto op = static_cast<Op>(h.op);
  const int64_t count = h.count;
  const size_t es = dtype_size(dtype);
  const int64_t bytes = count * static_cast<int64_t>(es);
  if (rides_inline(bytes)) {  // as allreduce: one exchange, no ring
    h.inline_bytes = bytes;
    agree(h, nullptr, input, bytes);
    const Span mine = segment_of(rank(), size(), count);
    reduce_inline(rank(), own_out ? own_out : static_cast<char*>(work) + mine.offset * es, count,
                  dtype, op);
    return;
  }
  bool shm = false;
  const RingSchedule sched = agree_on_ring(h, bytes, es, &shm);
  guarded("reduce_scatter", [&] {
    run_tuned(Collective::ReduceScatter, bytes, [&] {
      run_reduce_scatter(sched, dtype, op, input, work, shm, own_out);
      if (op == Op::Avg && size() > 1) {
        const Span mine = sched.segment(rank());
        divide(dtype, ReduceTarget(sched, es, work, own_out).own(), mine.count, size());
      }
    });
  });
}

std::vector<int64_t> RingCommunicator::allgather_counts(int64_t rows, int64_t row_elems,
                                                        int64_t shape_tag, DType dtype,
                                                        int64_t chunk_bytes,
                                                        int64_t memory, int64_t out_rows,
                                                        const void* input, int64_t held_rows) {
  pending_allgather_inline_ = false;  // until every rank's rows are known to have come
  pending_allgather_results_held_ = false;
  CallHeader h = make_header(Collective::AllGather, dtype, Op::Sum, rows, chunk_bytes, memory);
  h.out_rows = out_rows;
  h.held_rows = out_rows >= 0 ? out_rows : held_rows;
  h.extra = row_elems;
  h.shape_tag = shape_tag;
  // Host rows that fit ride along; if every rank's did, allgather() only copies them out.
  const int64_t bytes = rows * row_elems * static_cast<int64_t>(dtype_size(dtype));
  const bool fits = memory == kHostMemory && input != nullptr && rides_inline(bytes);
  h.inline_bytes = fits ? bytes : -1;
  // Rank 0 knows only its own rows yet: it picks the wire for p times as many bytes.
  pending_allgather_tuned_bytes_ = bytes * size();
  if (memory == kHostMemory && !fits) propose_wire(&h, pending_allgather_tuned_bytes_);
  std::vector<CallHeader> all;
  const int64_t agreed_chunk = agree(h, &all, input, fits ? bytes : 0);
  std::vector<int64_t> rows_per_rank(size());
  pending_allgather_inline_ = size() > 1;
  int64_t total_rows = 0;
  for (int r = 0; r < size(); ++r) {
    rows_per_rank[r] = all[r].count;
    total_rows += all[r].count;
    if (all[r].inline_bytes < 0) pending_allgather_inline_ = false;
  }
  pending_allgather_results_held_ = true;
  for (int r = 0; r < size(); ++r)
    if (all[r].held_rows != total_rows) pending_allgather_results_held_ = false;
  pending_allgather_chunk_bytes_ = agreed_chunk;
  pending_allgather_host_limit_ = headers_[0].host_limit;  // every rank's, agreed
  return rows_per_rank;
}

void RingCommunicator::confirm_everywhere(bool ok, const char* collective,
                                          const std::string& what) {
  check_usable(collective);
  std::vector<int> everyone(size());
  const int mine = ok ? 1 : 0;
  begin_exchange();
  guarded(collective, [&] { transport_->allgather_bytes(&mine, everyone.data(), sizeof(int)); });
  std::vector<int> failed;
  for (int r = 0; r < size(); ++r)
    if (!everyone[r]) failed.push_back(r);
  if (failed.empty()) return;
  throw OutOfMemoryError(std::string("ringreduce.") + collective + ": " +
                         describe_ranks(failed) + " could not allocate " + what +
                         " (raised on rank " + std::to_string(rank()) + "); nothing was sent");
}

void RingCommunicator::allgather_confirm(bool ok, int64_t out_bytes) {
  confirm_everywhere(ok, "allgather", "the " + std::to_string(out_bytes) + "-byte result");
}

void RingCommunicator::allgather(const void* input, void* out,
                                 const std::vector<int64_t>& row_counts, int64_t row_elems,
                                 DType dtype) {
  check_usable("allgather");
  if (static_cast<int>(row_counts.size()) != size())
    throw std::invalid_argument("allgather: need one row count per rank");
  const size_t es = dtype_size(dtype);
  if (pending_allgather_inline_) {  // every rank's rows came with the counts
    allgather_inline(out, row_counts, row_elems, es);
    return;
  }
  std::vector<int64_t> counts(size());
  for (int r = 0; r < size(); ++r) counts[r] = row_counts[r] * row_elems;
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  const int64_t total_bytes = total * static_cast<int64_t>(es);
  // headers_ still holds allgather_counts()'s exchange, rank 0's wire with it.
  const bool shm = take_agreed_wire(total_bytes);
  const RingSchedule sched(rank(), size(), counts,
                           ring_chunk_elems(pending_allgather_chunk_bytes_, es, shm), ring_);
  const Span mine = sched.segment(rank());
  char* dst = static_cast<char*>(out) + mine.offset * es;
  copy_bytes(dst, input, mine.count * es);  // x may be a view into out (gathering in place)
  // Rank 0 chose the wire for its guess of the size; what it learns counts only if the
  // true size is in the same class (run_tuned() checks that it chose at all).
  const bool chosen = WireTuner::size_class_of(total_bytes) ==
                      WireTuner::size_class_of(pending_allgather_tuned_bytes_);
  // Over MPI messages, send our rows from x rather than from the copy just made in out:
  // a receiver that reads them with a single copy (MPI's cross-memory attach) fetches
  // lines another core has just written slowly on some machines (docs/performance.md,
  // the slow phases), and x's were likely written long before. Not where x lies inside
  // out, whose other segments the ring overwrites.
  const bool apart = !ranges_overlap(input, mine.count * es, out, total_bytes);
  auto ring = [&] { run_allgather(sched, es, out, shm, apart ? input : nullptr); };
  guarded("allgather", [&] {
    if (chosen) {
      run_tuned(Collective::AllGather, total_bytes, ring);
    } else {
      ring();
    }
  });
}

void RingCommunicator::allgather_abandon(const std::string& why) {
  if (pending_allgather_inline_) {  // (the others have every row already)
    pending_allgather_inline_ = false;
    return;
  }
  if (size() == 1 || departed_) return;
  broken_ = "an allgather's result could not be made on this rank (" + why +
            "), which left the communicator";
  depart(Departure::Left);
}

bool RingCommunicator::allgather_from_counts(void* out, int64_t out_rows,
                                             const std::vector<int64_t>& row_counts,
                                             int64_t row_elems, DType dtype) {
  if (!pending_allgather_inline_ || static_cast<int>(row_counts.size()) != size()) return false;
  int64_t total_rows = 0;
  for (int64_t rows : row_counts) total_rows += rows;
  if (total_rows != out_rows) return false;
  allgather_inline(out, row_counts, row_elems, dtype_size(dtype));
  return true;
}

void RingCommunicator::allgather_inline(void* out, const std::vector<int64_t>& row_counts,
                                        int64_t row_elems, size_t elem_size) {
  pending_allgather_inline_ = false;
  // From the copies on the boards, not from x, which may be a part of out.
  char* dst = static_cast<char*>(out);
  for (int r = 0; r < size(); ++r) {
    const size_t bytes = static_cast<size_t>(row_counts[r] * row_elems) * elem_size;
    copy_bytes(dst, inline_payload(r), bytes);
    dst += bytes;
  }
}

void RingCommunicator::check_root(int root) const {
  if (root < 0 || root >= size())
    throw std::invalid_argument("broadcast: root " + std::to_string(root) + " is not in [0, " +
                                std::to_string(size()) + ")");
}

void RingCommunicator::broadcast(void* buf, int64_t count, DType dtype, int root,
                                 int64_t chunk_bytes) {
  check_root(root);
  CallHeader h = make_header(Collective::Broadcast, dtype, Op::Sum, count, chunk_bytes);
  h.extra = root;
  broadcast_host(h, buf);
}

void RingCommunicator::broadcast_host(const CallHeader& header, void* buf) {
  CallHeader h = header;
  const auto dtype = static_cast<DType>(h.dtype);
  const int64_t count = h.count;
  const int root = static_cast<int>(h.extra);
  const size_t es = dtype_size(dtype);
  const int64_t bytes = count * static_cast<int64_t>(es);
  if (broadcast_rides_inline(bytes)) {  // root's data rides in its header
    h.inline_bytes = bytes;
    const bool root_here = rank() == root;
    agree(h, nullptr, root_here ? buf : nullptr, root_here ? bytes : 0);
    if (!root_here) copy_bytes(buf, inline_payload(root), bytes);
    return;
  }
  // Only host calls may take shared memory: the ranks of a GPU call may differ in how
  // they move it (staged here, or direct), and meet only on MPI messages.
  const bool host = h.memory == kHostMemory;
  if (host) propose_wire(&h, bytes);
  const int64_t agreed_chunk = agree(h);
  const bool shm = host && take_agreed_wire(bytes);
  auto ring = [&] {
    if (shm) {
      shm_->broadcast(root, buf, bytes,
                      ring_chunk_elems(agreed_chunk, es, true) * static_cast<int64_t>(es));
    } else {
      const int64_t chunk = copy_chunk_elems(chunk_elems(agreed_chunk, es), es);
      ring_broadcast(ring_position(rank()), size(), ring_position(root), *transport_, buf, bytes,
                     chunk * static_cast<int64_t>(es), kWindow);
    }
  };
  guarded("broadcast", [&] { run_tuned(Collective::Broadcast, bytes, ring); });
}

void RingCommunicator::close() {
  if (closed_) return;
  if (!departed_ && broken_.empty() && size() > 1) {
    // Freeing the duplicate communicator is collective, and a rank that will never come
    // could leave us there for good: first every rank says it is closing, within the
    // timeout, and the duplicate is freed only once all have.
    try {
      agree(make_header(Collective::Close, DType::Float32, Op::Sum, 0, kDefaultChunkBytes));
    } catch (const MismatchError&) {
      closed_ = true;
      depart(Departure::Left);  // the others are in a collective this rank never joins
      throw;
    } catch (const TimeoutError&) {
      closed_ = true;
      if (first_departure().rank >= 0) return;  // nothing left to free together with them
      throw;
    }
  }
  closed_ = true;
  if (departed_) return;  // frees nothing that would wait for the others
  // A rank that posted its part of this close, then gave up before this one came (a
  // checkpoint here outlasting its timeout), left its departure notice behind, unread:
  // MPICH will not free a communicator with a message unreceived. Nothing is freed
  // together with it then. (Twice: MPICH's first probe may only drive its progress.)
  if (size() > 1 && (first_departure().rank >= 0 || first_departure().rank >= 0)) {
    transport_->forget_duplicate();  // (its notice may not be all that is on its way)
    return;
  }
  release_device();
  if (shm_) shm_->free();
  transport_->free();
}

}  // namespace ringreduce
