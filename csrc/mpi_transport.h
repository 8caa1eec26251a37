// The MPI wire under the ring: non-blocking point-to-point messages to the right
// neighbour and from the left one, on a private duplicate of the user's communicator
// so that our messages can never match the user's receives or theirs ours.
#pragma once

#include <mpi.h>

#include <atomic>
#include <functional>
#include <set>
#include <vector>

#include "transport.h"
#include "waiting.h"

namespace ringreduce {

// Throws MpiError naming the call, the rank and MPI's error string unless rc is
// MPI_SUCCESS.
void check_mpi(int rc, const char* call, int rank);

// Completes what is left of Communicator creations that gave up, where a late rank has
// since come (their pending MPI_Comm_idup holds a reference to the communicator it
// duplicates, which MPICH reports at MPI_Finalize). Runs before each creation, and at
// exit before MPI is finalised.
void finish_abandoned_duplicates();

// How many duplicates this process holds unfreed until MPI_Finalize (left, given up
// while being made, dropped unclosed below MPI_THREAD_MULTIPLE, or dropped after
// another rank left): the count the out-of-communicators hint names.
int64_t unfreed_duplicate_count();

// From now on, a Communicator being made in this process on any thread but this one
// stops at its next wait, and one begun later at once, with StoppedError. At exit: a
// daemon thread making one (waiting for ranks that never come) would otherwise be
// inside MPI when MPI goes away. The exiting thread may still make one (an atexit
// handler's). why: what their error gives as the reason (the first given stays).
void stop_creations_on_other_threads(const std::string& why);

// The ranks `ranks` of `comm` in MPI_COMM_WORLD, where mpiexec's labels count
// (MPI_UNDEFINED: not in it, as after a spawn).
std::vector<int> world_ranks(MPI_Comm comm, const std::vector<int>& ranks);

// What a rank that learns of another's process ending (Departure::Ended) can do.
inline constexpr const char* kEndedAdvice =
    "No Communicator with that rank can be made any more (MPI_Finalize keeps its process "
    "until every rank ends): let this rank end too, or go on without it on a communicator "
    "made before that leaves it out";

// Tests: the next Communicator made in this process pauses `seconds` before step
// `step` of its making after the duplicate (1: the agreement that every rank goes on;
// 2, 3: the shared-memory wire's two exchanges), as a rank held up there would; 0: none.
void set_creation_pause(int step, double seconds);
// Tests: the next departure notices this process sends over MPI messages (leave(): to
// every rank at once) wait this long first, as notices slow on their way would; 0: none.
void set_departure_notice_pause(double seconds);

class MpiTransport final : public Transport {
 public:
  // Collective over user_comm: duplicates it (MPI_Comm_idup), then waits until every
  // rank has its duplicate and knows whether any refused (MPI_Iallreduce). A rank with
  // a bad argument passes `refusal` (why; "" for none) and joins only to say so: every
  // rank then frees its duplicate and throws std::invalid_argument, naming the lowest
  // rank that refused and why, rather than leaving the others to wait out their timeout
  // for a rank that raised before it came. Each step throws TimeoutError after
  // timeout_s without completing (<= 0: never): a rank that skipped making its
  // Communicator ends the job with a message instead of a hang. The duplicate
  // that gave up stays pending on user_comm (MPI cannot cancel a collective), where a
  // rank that comes late completes it; one that never comes leaves user_comm unsafe
  // for further collectives, as it already is when ranks skip a collective. MPI must
  // already be initialised: mpi4py owns MPI_Init and MPI_Finalize, never us. Making it,
  // and every call after, also stops (StoppedError) once `interrupts` moves (see
  // StopRequest; null: never).
  MpiTransport(MPI_Comm user_comm, double timeout_s,
               const std::atomic<uint64_t>* interrupts = nullptr,
               const std::string& refusal = "");
  ~MpiTransport() override;
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Request send_right(const void* buf, int64_t bytes, int tag) override;
  Request recv_left(void* buf, int64_t bytes, int tag) override;
  void wait(Request request) override;
  bool test(Request request) override;
  void wait_all() override;

  // The ring's neighbours (ranks): rank - 1 and rank + 1 until told otherwise (see
  // ring_order_by_machine).
  void set_neighbours(int left, int right) {
    left_ = left;
    right_ = right;
  }

  // How long wait(), wait_all() and allgather_bytes() wait without progress before
  // throwing TimeoutError (<= 0: forever). They poll (MPI_Test) either way.
  void set_timeout(double seconds) { timeout_s_.store(seconds, std::memory_order_relaxed); }
  double timeout() const { return timeout_s_.load(std::memory_order_relaxed); }
  // The communicator's header exchange this rank is in, or whose ring it runs:
  // departures are judged against it (DepartureNote::holds_up). A call starts here, so
  // interrupts before it do not stop it (StopRequest::arm()).
  void set_exchange(int64_t n) {
    exchange_number_ = n;
    stop_.arm();
  }
  // This rank stops using the communicator for good (`note`: why, how many exchanges
  // it saw through, whom it followed): sends every other rank a notice on a tag of its
  // own, cancels the receives still pending and frees the sends (whose buffers the
  // caller must keep: MPI still reads them if the neighbour comes); keeps the pending
  // header exchange's buffers for ever (MPI forbids freeing a collective's request);
  // forgets the communicator, as freeing it would wait for the ranks still in a call.
  void leave(const DepartureNote& note);
  // Notes that the process of `rank` (of this communicator) is ending on an uncaught
  // exception: from now on, making a Communicator over any communicator it is in
  // raises TimeoutError at once, where it would wait out its timeout for that rank.
  void note_ended(int rank) const;
  // Throws TimeoutError if a rank that holds up the current exchange has sent its
  // notice. Waits check now and then; a ring call checks once at its end, as the
  // pending sends of a rank that left mid-call can complete a late rank's receives
  // with data the caller may have changed since.
  // Also throws StoppedError once stop_soon() was called (from any thread), or the
  // interrupt count moved during the call (see StopRequest).
  void check_departures() override;
  // check_departures() without the stop request.
  void check_notices();
  // What check_departures() also runs: the shared-memory wire's look for killed ranks'
  // processes (ShmChannel::check_alive()), for calls whose chunks travel over MPI
  // between ranks of one machine.
  void also_check(std::function<void()> check) { also_check_ = std::move(check); }
  // Throws StoppedError if stop_creations_on_other_threads() applies to this thread.
  void check_creation_stopped() const;
  void stop_soon(const std::string& why = "") { stop_.set(why); }
  // The Communicator on this transport is made: from now on stop_creations_on_other_threads()
  // leaves it alone.
  void created() {
    creating_ = false;
    stop_.set_context("");  // (a call's errors get theirs from the call)
  }
  // The shared-memory wire checks the same request (one per communicator).
  const StopRequest& stop_request() const { return stop_; }
  // check_departures() if messages were sent or received since the last check (so
  // calls that did not use this wire pay nothing).
  void check_departures_after_use() {
    if (used_) {
      used_ = false;
      check_departures();
    }
  }
  // A departure learnt otherwise than from a notice (one every rank saw in a header
  // exchange), judged as a notice would be. Like a notice, it also means that leave()
  // sends that rank no notice, and that the destructor does not free the duplicate
  // (see ~MpiTransport).
  void note_departure(const DepartureNote& note) { departures_.push_back(note); }
  // A rank known, from the shared-memory wire, to have stopped using the communicator:
  // leave() sends it no notice (see there). Changes nothing else.
  void note_stopped(int rank) { stopped_.insert(rank); }
  // Of the notices received so far that hold up `exchange` (kAnyExchange: all), the one
  // that tells best where things went wrong (DepartureNote::prefer); rank -1 if none.
  DepartureNote first_departure(int64_t exchange = kAnyExchange);

  MPI_Comm comm() const { return comm_; }
  // By send_right, ever.
  int64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }
  // Every rank's `bytes` bytes, in rank order, on every rank.
  void allgather_bytes(const void* mine, void* all, int bytes);
  // The same in two halves, for a caller that waits on several at once: start, then
  // test until true (all filled in). test throws TimeoutError if a rank that holds up
  // the exchange has left (it does not look at the stop request).
  void start_allgather_bytes(const void* mine, int bytes);
  bool test_allgather_bytes(void* all);
  // An exchange started and not yet over (until leave(), which keeps it pending).
  bool exchange_pending() const { return exchange_ != MPI_REQUEST_NULL; }
  // The same while the Communicator is being made (the shared-memory wire's set-up),
  // timed like the duplicate: TimeoutError saying that not every rank made its
  // Communicator. After a timeout (or a stop) the exchange stays pending, where a late
  // rank completes it, and the duplicate is left to MPI_Finalize. Nothing made after
  // the duplicate is made with a blocking collective, so no rank can wait without a
  // timeout for one that gave up.
  void creation_allgather(const void* mine, void* all, int bytes);
  // Frees the duplicate communicator now (collective); later use throws.
  void free();
  // Lets go of the duplicate unfreed, for MPI_Finalize to free (counted for the hint
  // when MPI runs out of communicators): where a rank has left, messages of its may
  // still be on their way here, which a later communicator given its context id would
  // receive.
  void forget_duplicate();

 private:
  void check(int rc, const char* call) const { check_mpi(rc, call, rank_); }
  // Ring tags stay below tag_ub_, which departure notices use.
  int wrap_tag(int tag) const { return tag % tag_ub_; }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int left_ = -1;  // set with rank_ and size_
  int right_ = -1;
  int tag_ub_ = 32767;  // the least MPI guarantees; replaced by the real bound
  // Why making a Communicator gave up, then `left`: what that leaves behind.
  std::string creation_timeout_text(const char* left) const;
  // "ringreduce.Communicator (rank r of p): ", which errors of the making begin with.
  std::string creation_context() const;
  // Polls request until it completes (true), or until the timeout passes (false).
  bool wait_patiently(MPI_Request* request, const char* call);

  std::vector<MPI_Request> requests_;  // Request = index; reset by wait_all()
  std::vector<bool> is_send_;          // ... and whether each is a send (for messages)
  MPI_Request exchange_ = MPI_REQUEST_NULL;  // allgather_bytes()'s, with a timeout...
  std::vector<char> exchange_send_, exchange_recv_;  // ... and its buffers
  // Atomic: Python's thread sets the timeout and reads the count while the worker
  // thread's call runs (relaxed: nothing else is ordered by them).
  std::atomic<int64_t> bytes_sent_{0};  // (one writer: a plain add, not a locked one)
  std::atomic<double> timeout_s_{0};
  StopRequest stop_;
  bool creating_ = true;
  bool used_ = false;  // messages posted since the last check_departures_after_use()
  std::function<void()> also_check_;  // (see also_check())
  int64_t exchange_number_ = 0;          // see set_exchange()
  std::vector<DepartureNote> departures_;  // every notice received
  std::set<int> stopped_;                  // see note_stopped()
  int creation_steps_ = 0;                 // begun after the duplicate (tests' pause)
  void begin_creation_step();
  // The last step of the making: see the constructor.
  void agree_to_create(const std::string& refusal);
  // Waits for a step of the making (timed, see wait_patiently). Gives up with
  // TimeoutError after the timeout, or passes a stop on; either way the step stays
  // pending, where a late rank completes it: let_go() lets go of the buffers MPI may
  // still write, for good, and the duplicate is left to MPI_Finalize.
  template <typename LetGo>
  void wait_in_creation(MPI_Request* request, const char* call, LetGo let_go);
  void receive_notices();
};

}  // namespace ringreduce
