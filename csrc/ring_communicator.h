// The collectives users call: allreduce, reduce_scatter, allgather, broadcast over a
// ring of MPI ranks. Owns the MPI transport and the scratch buffers, which live as
// long as the communicator so that no call allocates on the hot path.
//
// Before moving any data, every call exchanges a small header (what collective,
// dtype, op, count, ...) with all ranks: in one MPI_Iallgather, or through shared memory
// when all ranks share a node. A small allreduce rides along in that same exchange and
// is finished locally: one exchange, no ring. Ranks whose calls don't fit together all
// throw MismatchError after that exchange and nothing else is sent, so a mistake on
// one rank can neither hang the job nor leave stray messages behind; a rank that
// never comes makes the others throw TimeoutError (set_timeout()), as does one that gave
// up on the call before they came, whose header they meet there. Not
// thread-safe: one call at a time per communicator (the Python layer serialises).
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "device.h"
#include "dtype.h"
#include "errors.h"
#include "mpi_transport.h"
#include "ring_schedule.h"
#include "shm_channel.h"
#include "wire_tuner.h"

namespace ringreduce {

// Close is not a collective users call, but close() agrees on it as on one.
enum class Collective : int64_t {
  AllReduce = 1,
  ReduceScatter = 2,
  AllGather = 3,
  Broadcast = 4,
  Close = 5
};
const char* collective_name(Collective c);

// Exchanged before every call; all fields are int64 so the layout is the same on
// every rank.
struct CallHeader {
  int64_t magic = kMagic;
  int64_t collective = 0;
  int64_t dtype = 0;
  int64_t op = 0;
  int64_t count = 0;        // elements; rows for allgather
  int64_t extra = 0;        // root for broadcast; elements per row for allgather;
                            // kClosedAtExit for a close at exit
  int64_t shape_tag = 0;    // allgather's row shape: bits 60-62 its dimensions (at most
                            // 3), each 20 bits from bit 0 up; or 7 there and a hash below
  int64_t chunk_bytes = 0;  // the pipeline chunk size asked for; rank 0's wins
  int64_t invalid = 0;      // this rank will raise its own error: kRejected, or kFailed
  static constexpr int64_t kRejected = 1;  // its arguments
  static constexpr int64_t kFailed = 2;    // preparing it: memory, a thread, a GPU copy
  int64_t inline_bytes = 0; // payload bytes that follow the header in the same message
  int64_t memory = 0;       // where the buffers are: kHostMemory or kDeviceMemory
  int64_t out_rows = -1;    // allgather: rows of the caller's out=, or -1 for none
  int64_t held_rows = -1;   // allgather: rows of a result this rank holds already (out=,
                            // or one allocated for a guess at the size), or -1 for none
  int64_t wire = -1;        // rank 0's: kWireShm, kWireMpi or kWireShmStreaming for this
                            // call's ring (see WireTuner), or -1: none chosen
  int64_t host_limit = 0;   // GPU buffers: the sender's device_host_reduce_bytes (which
                            // decides the path of every GPU call), so it must agree
  int64_t check = 0;        // allreduce: the caller's own value that every rank must
                            // have passed (allreduce_gradients: a hash of the
                            // gradients' layout), or 0; its top byte names the kind
                            // of caller (see CheckedCallsMismatch). Pads to 16 bytes
  static constexpr int64_t kMagic = 0x52494e4752454437;  // "RINGRED7"
  static constexpr int64_t kClosedAtExit = 1;
};

static_assert(sizeof(CallHeader) % 16 == 0, "inline payloads follow headers 16-byte aligned");

constexpr int64_t kHostMemory = 0, kDeviceMemory = 1;

CallHeader make_header(Collective collective, DType dtype, Op op, int64_t count,
                       int64_t chunk_bytes, int64_t memory = kHostMemory, int64_t check = 0);

// How one call on GPU buffers runs (device_ring.cc). ready: an event recorded on the
// caller's stream after the work that produces the inputs (null: none); user_stream:
// the stream that must see the results. direct: hand device pointers to MPI (a
// CUDA-aware MPI) instead of staging chunks through pinned host memory.
struct DeviceCall {
  int ordinal;        // the GPU
  bool emulate;       // a HostDevice instead (tests on machines without a GPU)
  void* ready;
  void* user_stream;
  bool direct;
  Device* device = nullptr;  // set when the call begins
};

// An uncaught exception is ending this process (at exit, before any Communicator is
// left): from now on every departure says Departure::Ended.
void note_process_ending();

class RingCommunicator {
 public:
  static constexpr int64_t kDefaultChunkBytes = 256 * 1024;
  static constexpr int kWindow = 4;  // receives posted ahead per link (MPI)
  static constexpr int64_t kShmSlotBytes = 64 * 1024;  // shared-memory chunk: fits in L2
  static constexpr int kShmSlots = 8;                   // chunks in flight per link (shm)
  static constexpr int64_t kShmMaxBytes = 8 << 20;     // larger calls go through MPI
  static constexpr int64_t kInlineMaxBytes = 256;      // payload a header may carry (MPI)
  // ... through shared memory. On 2 ranks the inline call wins over the ring up to
  // somewhere below 32 KiB (16 KiB: 4.9 us; 32 KiB: 7.8 us inline, 7.5 us as a ring;
  // 64 KiB: 13.6 vs 12.4), hence 16 KiB.
  static constexpr int64_t kShmInlineMaxBytes = 16 * 1024;
  // A broadcast's payload is only the root's, which every other rank copies once: it
  // rides in the root's board up to this many bytes (the boards are made that large).
  static constexpr int64_t kShmBroadcastInlineBytes = 48 * 1024;
  // Phases that only copy (all-gather, broadcast) send chunks this many times larger
  // over MPI messages: with no arithmetic to keep in cache, fewer, larger messages win
  // (16 MiB all-gather on 2 ranks: 1.7-2.0 ms at 256 KiB chunks, 1.3-1.5 ms at 16 MiB).
  static constexpr int64_t kCopyChunkFactor = 64;
  // The chunk of a copy-only phase, in elements, for a call whose agreed chunk is
  // `chunk_elems`: every copy-only path uses this, so host, staged and direct ranks put
  // the same messages on the wire.
  static int64_t copy_chunk_elems(int64_t chunk_elems, size_t elem_size);
  // The all-gather schedule of a call whose reduce-scatter used `sched`.
  static RingSchedule copy_schedule(const RingSchedule& sched, size_t elem_size);
  static constexpr int64_t kInlineBudgetBytes = 4096;  // ... summed over the other ranks
  static constexpr int64_t kShmInlineBudgetBytes = 64 * 1024;
  // A GPU allreduce, reduce_scatter or broadcast up to this many bytes per rank (an
  // allgather: of result) is copied to pinned host memory once, done there by the host
  // ring, and copied back: two copies instead of a GPU operation per ring step and chunk. Measured on an H200 shared by 2 and 4 ranks
  // (docs/performance.md#gpu): every such operation costs tens to hundreds of us there,
  // more than the host ring takes for these sizes.
  static constexpr int64_t kDeviceHostReduceBytes = 1 << 20;
  // Payload bytes an allreduce may carry in its header: every rank reads every other
  // rank's and reduces all p, so the limit shrinks as 1/(p-1) beyond a few ranks.
  static int64_t inline_capacity_for(int ranks, bool shm);

  // Collective over user_comm; gives up after timeout_s (> 0) if a rank never comes
  // (see MpiTransport), and calls wait that long for other ranks (set_timeout()).
  // Making it and every call stop, with StoppedError, when `interrupts` moves while
  // they wait (the binding's count of SIGINTs, so that Ctrl-C ends a wait for a rank
  // that will not come; null: never). `refusal`: see MpiTransport.
  RingCommunicator(MPI_Comm user_comm, double timeout_s,
                   const std::atomic<uint64_t>* interrupts = nullptr,
                   const std::string& refusal = "");
  ~RingCommunicator();

  int rank() const { return transport_->rank(); }
  // "shared memory" when every rank is on one node (and RINGREDUCE_SHM is not 0): calls
  // up to kShmMaxBytes may then use it, as rank 0's WireTuner chooses; else "MPI".
  const char* transport_name() const { return shm_ ? "shared memory" : "MPI"; }
  // Why the transport is MPI ("" when it is shared memory).
  const std::string& transport_reason() const { return why_not_shared_memory_; }
  int size() const { return transport_->size(); }
  // The ranks in the order the ring goes round (see ring_order_by_machine): rank order
  // unless the ranks are on several machines and not placed machine by machine.
  std::vector<int> ring_order() const;

  // out = OP over ranks of input; out may equal input. count elements on every rank.
  // `check`: any value, the same on every rank, or every rank throws MismatchError
  // before data moves (a caller's cheap test that the ranks made the same call).
  void allreduce(const void* input, void* out, int64_t count, DType dtype, Op op,
                 int64_t chunk_bytes, int64_t check = 0);
  // GPU calls of up to this many bytes per rank (allgather: in all) go through the host
  // (see kDeviceHostReduceBytes). Every rank must set the same, while no call is in
  // flight: the header carries it, and GPU calls raise MismatchError on every rank while
  // ranks differ. 0 runs the device ring for every call with data (the tests of the
  // device ring set it).
  int64_t device_host_reduce_bytes() const { return device_host_reduce_bytes_; }
  void set_device_host_reduce_bytes(int64_t bytes);
  // work (count elements) gets this rank's segment reduced in place, at the offset
  // segment_of(rank, count) gives; the rest of work is scratch. With own_out, the
  // segment goes there instead (the caller's result array: no copy out of work).
  void reduce_scatter(const void* input, void* work, int64_t count, DType dtype, Op op,
                      int64_t chunk_bytes, void* own_out = nullptr);
  // First half of allgather: agree on the call and learn every rank's row count.
  // out_rows: the rows of the caller's out= (-1: none), checked against every rank's
  // rows here, so a wrong out= raises MismatchError on every rank before data moves.
  // input: this rank's rows (host memory); when every rank's fit in the header
  // exchange, they travel with it and allgather() has only to copy them out.
  // held_rows: the rows of a result the caller holds already, out= or a guess at the
  // size (-1: none; out_rows if out= is given), which no one checks.
  std::vector<int64_t> allgather_counts(int64_t rows, int64_t row_elems, int64_t shape_tag,
                                        DType dtype, int64_t chunk_bytes,
                                        int64_t memory = kHostMemory, int64_t out_rows = -1,
                                        const void* input = nullptr, int64_t held_rows = -1);
  // Between the halves, where allocating the output may fail (a big or GPU one): every
  // rank says whether it has its output, and if any has not, all throw
  // OutOfMemoryError naming them, instead of the others waiting in the ring for it.
  void allgather_confirm(bool ok, int64_t out_bytes);
  // Whether every rank held a result of the right size before the allgather whose
  // counts were just exchanged (out=, or a guess that was right): then none allocates
  // one now, and a big one needs no confirming.
  bool allgather_results_held() const { return pending_allgather_results_held_; }
  // Every rank says whether it got `what`; if any did not, all throw OutOfMemoryError
  // naming them (collective).
  void confirm_everywhere(bool ok, const char* collective, const std::string& what);
  // Second half: out holds sum(row_counts) rows; this rank's rows go in its place.
  void allgather(const void* input, void* out, const std::vector<int64_t>& row_counts,
                 int64_t row_elems, DType dtype);
  // Between the halves, where this rank has no output to go on with (making it raised)
  // and no allgather_confirm() told the others: if they need this rank in the ring (the
  // rows did not all come with the counts), it leaves the communicator (Departure::
  // Left), as after an error mid-ring, so that they raise at once instead of after
  // their timeout; its own later calls raise, naming `why`.
  void allgather_abandon(const std::string& why);
  // The second half of a small call, if it can be done now: when every rank's rows came
  // with the counts and out holds exactly out_rows == sum(row_counts) rows, copies them
  // into out and returns true (allgather() is then not called). Lets a caller that
  // guessed the result's size before the exchange finish in one step.
  bool allgather_from_counts(void* out, int64_t out_rows, const std::vector<int64_t>& row_counts,
                             int64_t row_elems, DType dtype);
  // In place: every rank's buf ends up equal to root's.
  void broadcast(void* buf, int64_t count, DType dtype, int root, int64_t chunk_bytes);

  // The same collectives on GPU buffers (device_ring.cc). Inputs and outputs are
  // device pointers; the results are ready on call.user_stream when these return.
  void allreduce_device(DeviceCall call, const void* input, void* out, int64_t count,
                        DType dtype, Op op, int64_t chunk_bytes, int64_t check = 0);
  void reduce_scatter_device(DeviceCall call, const void* input, void* work, int64_t count,
                             DType dtype, Op op, int64_t chunk_bytes);
  // After allgather_counts(..., kDeviceMemory), then allocating out and
  // reserve_staging(): out_ready says whether that worked. Every rank confirms that all
  // are ready before the ring (else all throw OutOfMemoryError).
  void allgather_device(DeviceCall call, const void* input, void* out,
                        const std::vector<int64_t>& row_counts, int64_t row_elems, DType dtype,
                        bool out_ready);
  void broadcast_device(DeviceCall call, void* buf, int64_t count, DType dtype, int root,
                        int64_t chunk_bytes);
  // Makes the Device and the pinned staging buffer of `bytes` ready, so that the call
  // after it cannot fail for want of them. Throws OutOfMemoryError if they don't fit.
  void reserve_staging(const DeviceCall& call, int64_t bytes);
  // "none" until a device call; then "CUDA" or "host emulation".
  const char* device_name() const { return device_ ? device_->name() : "none"; }
  // The Device for GPU `ordinal` (a HostDevice when emulate), made on first use and kept;
  // where the communicator is unusable, check_usable(collective)'s error.
  Device& device(bool emulate, int ordinal, const char* collective = nullptr);

  // What the ring has moved so far (not the header exchange, nor small calls done
  // inside it): payload bytes this rank sent, as counted by the wires, and ring steps.
  int64_t ring_bytes_sent() const {
    return transport_->bytes_sent() + (shm_ ? shm_->bytes_sent() : 0);
  }
  int64_t ring_steps() const { return ring_steps_.load(std::memory_order_relaxed); }
  int64_t exchanges() const { return exchanges_; }  // header exchanges begun (tests)
  // GPU calls whose data went to the host (see kDeviceHostReduceBytes), counted when it
  // got there: also those that then raised.
  int64_t device_calls_on_host() const { return device_calls_on_host_; }
  // The part of ring_bytes_sent() that went through the shared-memory slots.
  int64_t shm_bytes_sent() const { return shm_ ? shm_->bytes_sent() : 0; }
  // Whether the latest call through the shared-memory slots wrote them with streaming
  // stores (rank 0's tuner's choice, or RINGREDUCE_SHM=stream).
  bool shm_streaming() const { return shm_ && shm_->streaming(); }
  // What this rank's tuner learns from a ring call of `bytes` that took `seconds` on one
  // wire (run_tuned() calls it on rank 0; tests call it to steer the choice).
  void record_wire_time(Collective collective, int64_t bytes, int wire, double seconds) {
    tuner(collective).record(bytes, wire, seconds);
  }
  // The largest allreduce, in bytes, done inside the header exchange (0 on one rank).
  int64_t inline_capacity() const { return inline_capacity_; }
  int64_t broadcast_inline_capacity() const { return broadcast_inline_capacity_; }
  // Whether a call moving `bytes` per rank is done inside the header exchange, no ring.
  bool rides_inline(int64_t bytes) const { return size() > 1 && bytes <= inline_capacity_; }
  // ... for a broadcast, whose only payload is the root's.
  bool broadcast_rides_inline(int64_t bytes) const {
    return size() > 1 && bytes <= broadcast_inline_capacity_;
  }

  // Takes part in the header exchange of a call this rank has rejected (or failed to
  // prepare: `why` CallHeader::kFailed), so that the other ranks raise MismatchError
  // instead of waiting for us forever.
  void announce_invalid(Collective collective, int64_t chunk_bytes,
                        int64_t memory = kHostMemory, int64_t why = CallHeader::kRejected);

  // Frees the duplicate communicator (collective) and unmaps the shared memory. Every
  // rank first says it is closing, within the timeout: if a rank has left (see
  // Departure), this frees nothing and returns; if one called a collective instead,
  // all raise MismatchError; if one does not come, TimeoutError. Later calls raise.
  void close();
  bool closed() const { return closed_; }
  // This rank has left the communicator (a timeout, an error in a call, leave()): the
  // buffers of the call it left in may still be read or written by MPI, for good.
  bool departed() const { return departed_; }
  // Throws what every call throws after this communicator was closed, gave up or broke;
  // its message begins with where(collective), where the caller names it.
  void check_usable(const char* collective = nullptr) const;
  // Stops using the communicator on this rank only, and tells the others (Departure::
  // Left), so that their waits on this rank raise at once and their close() frees
  // nothing that would wait for it. For a rank that will not close() with the others
  // (an exception on its way out). over_mpi false: the ranks on shared memory only
  // (from a thread that MPI's thread level does not let call MPI).
  void leave(bool over_mpi = true);
  // After leave(over_mpi = false), from a thread that may call MPI (at exit): tells the
  // ranks over MPI messages too, which otherwise wait for this one for good in a close
  // at exit. Nothing if there is nothing left to tell.
  void tell_departure();
  // Frees the receive slots of the ring (a chunk window): for a dropped communicator,
  // kept only for its close at exit. Nothing may be in flight.
  void release_scratch() {
    scratch_.reset();
    scratch_bytes_ = 0;
  }
  // When dropped (the destructor), every call of this rank finished and the
  // communicator not closed: stops using it, and tells the ranks on shared memory
  // (Departure::Unclosed), so that one waiting for this rank in a call it never made
  // raises at once. Over MPI messages it tells no one: a notice never received would be
  // left unmatched at MPI_Finalize, which MPI forbids (the Python layer keeps a dropped
  // one for begin_close_at_exit()).
  void leave_unclosed();
  // At a normal exit, every call of this rank finished and the communicator not
  // closed (or, under MPI_THREAD_MULTIPLE, as soon as the Python layer drops it
  // unclosed): on shared memory, leave_unclosed(). Over MPI messages, a header exchange
  // marked "closed at exit" instead: it pairs with the others' close at exit or
  // close() (then the duplicate is freed), or with the call a rank that made more calls
  // waits in, which then raises TimeoutError naming this rank as gone, with no message
  // left over (every rank saw the header). In two halves, so that a rank can wait on
  // all its communicators at once (a rank that made one more call on the second waits
  // for this one there, not in the first): begin_close_at_exit() is true if an exchange
  // is now pending, and then finish_close_at_exit() true once it is over: every other
  // rank closed, called, or left. Without the timeout: a rank still at work (rank 0
  // writing the results, say) comes when done, or leaves after an error and says so, or
  // ends without MPI_Finalize, which ends the job; giving up on it would only tell it
  // that this rank gave up.
  bool begin_close_at_exit();
  bool finish_close_at_exit();
  // Thread-safe: asks the call this rank runs on another thread to stop at its next
  // look around (every few hundred idle turns of a wait), with StoppedError; the rank
  // then leaves, as after any error in a call. A call that never waits may finish.
  // why: the reason its error gives (see StopRequest::set()).
  void stop_soon(const std::string& why = "");
  // How long a call waits for another rank (to join it, or to move the next chunk)
  // before throwing TimeoutError; <= 0: forever. After a timeout every later call
  // throws it again, and this rank has left (see Departure).
  double timeout() const { return transport_->timeout(); }
  void set_timeout(double seconds);

  // The segment np.array_split would give `rank` of `count` elements.
  static Span segment_of(int rank, int size, int64_t count);

 private:
  // Exchanges headers, each followed by `payload_bytes` of payload (at most
  // inline_capacity_; a broadcast root's, broadcast_inline_capacity_); throws
  // MismatchError on every rank if they don't fit (TimeoutError where a rank gave up on
  // this exchange before this one came: departure_behind_mismatch()). Returns rank 0's
  // chunk size, which every rank then uses (0 where `mine` is invalid: the caller raises
  // its own error).
  int64_t agree(const CallHeader& mine, std::vector<CallHeader>* all = nullptr,
                const void* payload = nullptr, int64_t payload_bytes = 0);
  const char* inline_payload(int r) const {
    return (shm_ ? shm_->posted(r) : exchange_.data() + r * slot_bytes()) + sizeof(CallHeader);
  }
  int64_t slot_bytes() const { return static_cast<int64_t>(sizeof(CallHeader)) + inline_capacity_; }
  // Segment s of an allreduce of `count` elements from the payloads agree() gathered,
  // into dst; allreduce_inline() does every segment into out.
  void reduce_inline(int s, void* dst, int64_t count, DType dtype, Op op);
  void allreduce_inline(void* out, int64_t count, DType dtype, Op op);
  // allgather's rows, which came with the counts, into out in rank order.
  void allgather_inline(void* out, const std::vector<int64_t>& row_counts, int64_t row_elems,
                        size_t elem_size);
  RecvSlots recv_slots(const RingSchedule& sched, size_t elem_size);
  // Runs a phase that moves data. An error there may leave messages in flight (and, on
  // a GPU, copies), after which the communicator cannot be trusted again: the error's
  // text goes into broken_, and every later call raises it. A timeout gives up.
  template <typename F>
  void guarded(const char* collective, F&& body) {
    try {
      body();
      // A rank that left mid-call can have completed our receives from its pending
      // sends, with data its caller may have changed since: say so, not return it.
      transport_->check_departures_after_use();
    } catch (const MismatchError&) {
      throw;  // raised before anything moved
    } catch (const TimeoutError& e) {
      give_up(collective, e);
    } catch (const std::exception& e) {
      // Unusable here from now on, while the others may wait on this rank in the ring:
      // tell them, so they raise at once instead of after their timeout (which also
      // leaves what MPI still holds of this call to MPI_Finalize).
      broken_ = e.what();
      broken_by_mpi_ = dynamic_cast<const MpiError*>(&e) != nullptr;
      if (size() > 1) depart(Departure::Left);
      // The wait that stopped knows no call: the call and the rank go in front, as in
      // every other error of a call (later calls quote the reason alone).
      if (dynamic_cast<const StoppedError*>(&e) != nullptr)
        throw StoppedError(where(collective) + e.what());
      throw;
    }
  }
  // "ringreduce.allreduce (rank r of p): ", which a call's errors begin with.
  std::string where(const char* collective) const;
  // After a TimeoutError in `collective`: this communicator is done for. Leaves it
  // (depart()) and rethrows with the call and the rank in the message.
  [[noreturn]] void give_up(const char* collective, const TimeoutError& e);
  // In a header exchange: ranks whose header says they closed at exit (begin_close_at_exit())
  // while this rank makes a call are gone for good. Notes them as departed, as if they
  // had said so (so that TimeoutError names them; every rank saw the same headers, so
  // none is told), and throws that TimeoutError. Nothing if this rank closes too.
  void check_closed_at_exit(const CallHeader& mine);
  // Tells the other ranks this one has left, and leaves what MPI still holds to
  // MPI_Finalize; from then on nothing this rank sent from or received into is freed.
  // waited_for: GaveUp's absent rank, where known (TimeoutError::waited_for).
  void depart(Departure why, int waited_for = -1, bool over_mpi = true);
  // Before each header exchange, on either wire: counts it, and tells the wires.
  void begin_exchange();
  // Of the departures seen so far that hold up `exchange` (kAnyExchange: all), the one
  // that tells best where things went wrong (DepartureNote::prefer); rank -1 if none.
  DepartureNote first_departure(int64_t exchange = kAnyExchange);
  // After a header exchange whose headers disagree: a rank that gave up (or left) while
  // it waited in this exchange, whose header, posted before it did, was what this rank
  // found there; rank -1 if none. Looks again for a moment (kMismatchNoticeGrace) while
  // none is known: its notice may be on its way.
  DepartureNote departure_behind_mismatch();
  void check_root(int root) const;  // std::invalid_argument unless a rank
  int64_t chunk_elems(int64_t chunk_bytes, size_t elem_size) const;

  // The ring's two phases over whichever wire this communicator has.
  // shm: whether this call goes through shared memory (use_shm of its total bytes,
  // the same on every rank).
  void run_reduce_scatter(const RingSchedule& sched, DType dtype, Op op, const void* input,
                          void* out, bool shm, void* own_out = nullptr);
  // own_input: this rank's segment, where MPI messages send it from (nullptr: from buf).
  void run_allgather(const RingSchedule& sched, size_t elem_size, void* buf, bool shm,
                     const void* own_input = nullptr);
  bool use_shm(int64_t total_bytes) const;
  // Rank 0 proposes, in its header, which wire a ring call of `bytes` that may use shared
  // memory should take (what its tuner for `collective` chooses); after the exchange,
  // take_agreed_wire() says what every rank does: shared memory unless rank 0 said MPI,
  // and then sets the channel's stores (streaming or not) to rank 0's word.
  void propose_wire(CallHeader* h, int64_t bytes);
  bool take_agreed_wire(int64_t bytes);
  // An allreduce's or reduce_scatter's header exchange, then its schedule: split evenly,
  // in chunks of rank 0's size, over the wire agreed (*shm).
  RingSchedule agree_on_ring(CallHeader h, int64_t bytes, size_t elem_size, bool* shm);
  // Runs a ring call, timed on rank 0 for its tuner when it could have used another wire.
  template <typename Run>
  void run_tuned(Collective collective, int64_t bytes, Run run);
  WireTuner& tuner(Collective collective) { return tuners_[static_cast<int>(collective) % 4]; }
  int64_t ring_chunk_elems(int64_t agreed_chunk_bytes, size_t elem_size, bool shm) const;

  // Device side (device_ring.cc).
  static constexpr int kDeviceSlots = 4;  // received chunks being reduced on the GPU
  static constexpr int kDeviceScratchSlots =  // GPU scratch: staged slots, or direct's window
      kDeviceSlots > kWindow ? kDeviceSlots : kWindow;
  void run_device_reduce_scatter(const DeviceCall& call, const RingSchedule& sched, DType dtype,
                                 Op op, const void* input, void* out);
  void run_device_allgather(const DeviceCall& call, const RingSchedule& sched, size_t elem_size,
                            void* buf);
  // Everything a device call needs before its header exchange: the Device, ordering
  // after the caller's stream, the staging buffers. If any of it fails, this rank
  // still takes part in the exchange, so the others raise instead of waiting for it.
  Device& begin_device_call(DeviceCall& call, Collective collective, int64_t chunk_bytes,
                            int64_t mirror_bytes, int64_t scratch_bytes);
  // After a reduce-scatter's header exchange: GPU scratch was reserved with this
  // rank's chunk size, the ring uses rank 0's. If any rank's was smaller, all grow
  // theirs and confirm they could.
  void grow_device_scratch(Collective collective, size_t elem_size, int64_t count);
  // GPU scratch for the reduce-scatter of `count` elements in chunks of chunk_bytes.
  int64_t device_scratch_bytes(int64_t count, size_t elem_size, int64_t chunk_bytes) const;
  // A device call's header exchange, then its reduce-scatter (and the average of this
  // rank's segment), as allreduce and reduce_scatter share them; returns the schedule.
  RingSchedule device_reduce_scatter_call(DeviceCall& call, Collective collective,
                                          const void* input, void* out, int64_t count,
                                          DType dtype, Op op, int64_t chunk_bytes,
                                          int64_t check = 0);
  // The host collectives, after their header is made (a GPU call that goes through the
  // host makes a device-memory header).
  void allreduce_host(const CallHeader& h, const void* input, void* out);
  void reduce_scatter_host(const CallHeader& h, const void* input, void* work, void* own_out);
  void broadcast_host(const CallHeader& h, void* buf);
  // Whether a GPU call of this many bytes per rank goes through the host (the same on
  // every rank that has the same limit). The smallest of these ride in the header
  // exchange there, as host calls do.
  bool device_call_on_host(int64_t bytes) const {
    return device_call_on_host(bytes, device_host_reduce_bytes_);
  }
  bool device_call_on_host(int64_t bytes, int64_t limit) const {
    return size() > 1 && bytes <= limit;
  }
  // The first half of every GPU call through the host: the device's bytes into pinned
  // staging (reserved by begin_device_call()), told to the other ranks if it fails.
  char* stage_on_host(const DeviceCall& call, Collective collective, int64_t chunk_bytes,
                      const void* input, int64_t bytes, int64_t staging_bytes);
  void release_device();

  std::unique_ptr<MpiTransport> transport_;
  std::string why_not_shared_memory_;
  std::vector<int> ring_;  // ring_order_by_machine's: empty for rank order
  std::vector<int> ring_positions_;  // [rank]: where it is on ring_ (empty with it)
  int ring_position(int rank) const { return ring_.empty() ? rank : ring_positions_[rank]; }
  int rank_at(int position) const { return ring_.empty() ? position : ring_[position]; }
  // On a communicator other than MPI_COMM_WORLD (or a copy of it), what its ranks are
  // there, added to error messages; "" on the world.
  static std::string world_ranks_note(MPI_Comm comm);
  std::string world_ranks_note_;
  const long maker_pid_ = static_cast<long>(getpid());  // see the destructor
  std::unique_ptr<Device> device_;            // null until the first device call
  std::unique_ptr<DeviceBuffer> host_mirror_;   // pinned: staged chunks, one place per chunk
  std::unique_ptr<DeviceBuffer> device_scratch_;  // received chunks (and direct-mode slots)
  std::unique_ptr<ShmChannel> shm_;  // null unless all ranks share a node
  bool tune_wire_ = true;  // false: RINGREDUCE_SHM=1 or stream, shared memory whenever it can
  int fixed_wire_ = kWireShm;  // the wire then (kWireShmStreaming for RINGREDUCE_SHM=stream)
  std::array<WireTuner, 4> tuners_;  // per collective; only rank 0's decide
  std::unique_ptr<char[]> scratch_;  // MPI receive slots, grown on demand, kept
  int64_t scratch_bytes_ = 0;
  std::vector<CallHeader> headers_;
  int64_t inline_capacity_ = 0;  // payload bytes a header message can carry
  int64_t broadcast_inline_capacity_ = 0;  // ... the root's, of a broadcast
  int64_t device_host_reduce_bytes_ = kDeviceHostReduceBytes;
  // Without shared memory, agree() gathers size() slots of slot_bytes() into exchange_
  // from outgoing_ (with it, the boards of shm_ take their place).
  std::vector<char> exchange_;
  std::vector<char> outgoing_;
  std::vector<char> inline_scratch_;  // two accumulators for allreduce_inline()
  bool closed_ = false;
  std::string broken_;  // set when an error in a call (MPI's or another) left it unusable
  bool broken_by_mpi_ = false;  // (an MpiError did)
  bool gave_up_ = false;  // ... after a timeout (see give_up())
  bool departed_ = false;  // this rank has left (depart())
  std::unique_ptr<DepartureNote> untold_;  // depart()'s note, not yet sent over MPI
  int64_t exchanges_ = 0;  // header exchanges begun (begin_exchange())
  int64_t pending_allgather_chunk_bytes_ = kDefaultChunkBytes;  // from allgather_counts()
  int64_t pending_allgather_host_limit_ = 0;  // GPU allgather: the agreed host limit
  bool pending_allgather_inline_ = false;  // ... and whether the rows came with the counts
  int64_t pending_allgather_tuned_bytes_ = 0;  // ... and the size rank 0 chose its wire for
  bool pending_allgather_results_held_ = false;  // ... and whether every rank held its result
  // Atomic: Python's thread reads it while the worker's call adds (relaxed, one writer).
  std::atomic<int64_t> ring_steps_{0};
  void count_ring_steps(int64_t steps) {
    ring_steps_.store(ring_steps_.load(std::memory_order_relaxed) + steps,
                      std::memory_order_relaxed);
  }
  int64_t device_calls_on_host_ = 0;
};

}  // namespace ringreduce
