// The intra-node wire: when every rank of the communicator is on one machine, chunks
// travel through shared memory instead of MPI messages (a memory file per rank, which
// every rank maps; see create()). Each rank owns a ring of `slots` chunk-sized slots
// that only it writes and only its right neighbour reads, so the neighbour reduces
// straight from our memory, while the chunk is still in cache, with no copy in between
// and no MPI call per chunk.
//
// Two counters per rank, each written by one process only, make it a lock-free
// single-producer single-consumer queue between neighbours:
//   published: chunks this rank has written into its slots (read by the right);
//   consumed:  chunks this rank has finished reading from its left neighbour's slots
//              (read by the left, to know which slot it may overwrite).
// Both only grow, across calls, so neither side ever resets anything.
//
// The same memory also carries every call's header exchange (see exchange()): each rank
// posts its header, and any small payload, on a board of its own that every rank reads,
// which costs a few cache-line transfers instead of an MPI_Iallgather.
#pragma once

#include <mpi.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "copy.h"
#include "dtype.h"
#include "ring_schedule.h"
#include "waiting.h"

namespace ringreduce {

class MpiTransport;

// Tests: the next shared-memory broadcast in this process sleeps this long between its
// header exchange and its ring, as a rank stuck there would.
void set_shm_broadcast_pause(double seconds);
// Tests: every chunk this process sends over shared memory from now on waits this long
// first (0: none), as on a slow but moving ring: a call that takes several timeouts in
// all, with chunks coming throughout, must not time out.
void set_shm_send_pause(double seconds);

// Whether process `pid` has ended: gone (reaped), or a zombie that its parent has not
// reaped (a launcher that lets the job run on, as MPICH's mpiexec -disable-auto-cleanup
// does, may not reap it until the job ends).
bool process_ended(pid_t pid);

class ShmChannel {
 public:
  // Collective over the transport's communicator, timed as its making is (TimeoutError
  // after its timeout; no blocking collective). Returns nullptr (on every rank alike)
  // unless all ranks are on one machine and each could map every rank's memory.
  // board_bytes: the most exchange() will post per rank. The transport's StopRequest is
  // checked by this wire's waits too (see check_departures()): the transport must
  // outlive the channel.
  // why_not: set, when it returns nullptr, to why (the same on every rank).
  // machines: set to the machine each rank is on (host name and boot id), as the ranks
  // told each other; the same on every rank (see ring_order_by_machine).
  // ring_in_rank_order: set where any rank has RINGREDUCE_RING=ranks (on every rank alike).
  static std::unique_ptr<ShmChannel> create(MpiTransport& transport, int64_t slot_bytes,
                                            int slots, int64_t board_bytes,
                                            std::string* why_not,
                                            std::vector<std::string>* machines,
                                            bool* ring_in_rank_order);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }  // ever

  // The pipelined phases of ring_schedule.h over shared memory. Same schedule, same
  // reduction order, so the same bits as the MPI path.
  void reduce_scatter(const RingSchedule& sched, DType dtype, Op op, const void* input,
                      void* out, void* own_out = nullptr);
  void allgather(const RingSchedule& sched, size_t elem_size, void* buf);
  // buf's `bytes` from root to every rank, down the ring in chunks of chunk_bytes (at
  // most a slot; the same on every rank).
  void broadcast(int root, void* buf, int64_t bytes, int64_t chunk_bytes);
  // Whether the calls from now on write their slots with streaming stores
  // (copy_streaming() in copy.h: which is faster depends on where the cores sit, so the
  // WireTuner decides); every rank alike, or the times only mislead.
  void set_streaming(bool on) {
    streaming_.store(on && kStreamingStores, std::memory_order_relaxed);
  }
  bool streaming() const { return streaming_.load(std::memory_order_relaxed); }
  void free();  // unmaps every rank's memory (not collective; the destructor does it too)
  // Waits on another rank throw TimeoutError after this many seconds without progress
  // (<= 0: never).
  void set_timeout(double seconds) { timeout_s_.store(seconds, std::memory_order_relaxed); }
  // The communicator's header exchange this rank is in, or whose ring it runs (counted
  // over both wires): departures are judged against it (DepartureNote::holds_up).
  void set_exchange(int64_t n) { exchange_ = n; }
  // This rank stops using the channel for good (`note`: why, how many exchanges it saw
  // through, whom it followed): tells every rank's waits, through a word of its own in
  // its memory. The others keep reading it through their own mappings.
  void leave(const DepartureNote& note);
  // A note as the word leave() writes into its memory (0: still in), and back.
  static uint64_t departure_word(const DepartureNote& note);
  static DepartureNote note_of_word(int rank, uint64_t word);
  // Throws TimeoutError if another rank's process has ended without a departure note
  // (killed: SIGKILL, the out-of-memory killer), which would otherwise leave every
  // rank waiting on it for the whole timeout (30 minutes by default), where mpiexec
  // does not end the job for it (Slurm's srun, by default, or mpiexec
  // -disable-auto-cleanup). Asks the system at most every kAliveCheckEvery: from the
  // waits' look_around(), and the MPI wire's (MpiTransport::also_check()).
  void check_alive() const;
  // Throws TimeoutError if a rank that holds up the current exchange has left, and
  // StoppedError once the StopRequest given to create() says so.
  void check_departures() const;
  // What the waits' look_around() also runs, at most every kNoticeCheckEvery: the MPI
  // wire's look for departure notices (MpiTransport::check_notices()). A rank stopped
  // while making the Communicator tells the others over MPI messages only (it has no
  // channel), and one that made its Communicator before that notice came would
  // otherwise wait for it on shared memory for the whole timeout. Runs on the thread of
  // the call that waits, which may call MPI. Clear it (nullptr) before the check's
  // objects go.
  void also_check(std::function<void()> check) { also_check_ = std::move(check); }
  // Of the other ranks' departures so far that hold up `exchange` (kAnyExchange: all),
  // the one that tells best where things went wrong (DepartureNote::prefer); rank -1 if
  // none.
  DepartureNote first_departure(int64_t exchange = kAnyExchange) const;
  // Rank r's, or rank -1 while it is in (and once free() has run).
  DepartureNote departure(int r) const;

  // An all-gather through the boards: fill next_board() (at most board_bytes), then
  // exchange() posts it and returns when every rank has posted theirs. Every rank must
  // call it as often as the others, like the collective it replaces. posted(r) is rank
  // r's board of the latest exchange; it stays valid until this rank's next exchange().
  char* next_board() const { return board(rank_, (exchanges_ + 1) % 2); }
  // Throws TimeoutError naming the ranks that have not posted after the timeout, and
  // on every rank once one has left (leave()).
  void exchange();
  const char* posted(int r) const { return board(r, exchanges_ % 2); }

 private:
  ShmChannel() = default;
  // What a wait does now and then (StallTimer::expired): drives MPI, then checks for
  // departures (also those told over MPI messages: also_check()). Open MPI finishes a
  // large send only once the receiving process calls into MPI again (the rendezvous'
  // last acknowledgement can sit in its queue): a rank that waits here, on shared
  // memory alone, after an MPI-wire call would leave the neighbour that sent to it
  // waiting in that call forever.
  void look_around() const;

  // Two boards per rank, used by alternate exchanges: before a rank may overwrite the
  // board of exchange n, every rank must have read it, which they all have once each
  // has posted exchange n+1, and we waited for that before starting n+2.
  char* board(int r, uint64_t parity) const { return boards_[r] + parity * board_stride_; }
  char* my_slot(uint64_t seq) const { return my_slots_ + (seq % slots_) * slot_bytes_; }
  const char* left_slot(uint64_t seq) const { return left_slots_ + (seq % slots_) * slot_bytes_; }
  void copy_to_slot(char* slot, const void* data, int64_t bytes) const {
    if (streaming_.load(std::memory_order_relaxed))
      copy_streaming(slot, data, static_cast<size_t>(bytes));
    else
      copy_bytes(slot, data, static_cast<size_t>(bytes));
  }
  bool can_send() const;      // the right neighbour has freed the slot of our next chunk
  bool can_receive() const;   // the left neighbour has published our next chunk
  void sent();                // publish the chunk just written into my_slot(sent_)
  void received();            // release left_slot(received_)
  template <typename Ready, typename Send, typename Receive>
  void pump(int64_t sends, int64_t recvs, int left, int right, Ready ready, Send send,
            Receive receive, bool until_taken = false);
  template <typename OnReceive, typename SendSource>
  void run_phase(const RingSchedule& sched, size_t elem_size, Phase phase,
                 OnReceive on_receive, SendSource send_source);

  std::vector<char*> parts_;  // every rank's memory, as mapped here
  size_t part_bytes_ = 0;     // the size of each
  MPI_Comm comm_ = MPI_COMM_NULL;  // the communicator's own duplicate, to drive MPI on
  int64_t slot_bytes_ = 0;
  int slots_ = 0;
  char* my_slots_ = nullptr;
  const char* left_slots_ = nullptr;
  uint64_t* my_published_ = nullptr;
  uint64_t* my_consumed_ = nullptr;
  const uint64_t* left_published_ = nullptr;
  const uint64_t* right_consumed_ = nullptr;
  std::vector<char*> boards_;                 // each rank's two boards
  std::vector<const uint64_t*> exchanged_;    // each rank's count of posted exchanges
  uint64_t* my_exchanged_ = nullptr;
  std::vector<const uint64_t*> departures_;   // each rank's departure word
  std::vector<pid_t> pids_;                   // each rank's process (check_alive())
  static constexpr std::chrono::milliseconds kAliveCheckEvery{200};
  mutable std::chrono::steady_clock::time_point next_alive_check_{};
  std::function<void()> also_check_;  // (see also_check())
  // An MPI_Iprobe each: cheap, but not every 256 idle turns of a short wait.
  static constexpr std::chrono::milliseconds kNoticeCheckEvery{200};
  mutable std::chrono::steady_clock::time_point next_notice_check_{};
  const StopRequest* stop_ = nullptr;
  uint64_t* my_departure_ = nullptr;
  int64_t exchange_ = 0;  // see set_exchange()
  int64_t board_stride_ = 0;
  int rank_ = 0;
  uint64_t exchanges_ = 0;
  // Atomic, as MpiTransport's: Python's thread sets or reads them while a call runs.
  std::atomic<double> timeout_s_{0};
  uint64_t sent_ = 0;      // chunks we have published (our copy of *my_published_)
  uint64_t received_ = 0;  // chunks we have consumed (our copy of *my_consumed_)
  std::atomic<int64_t> bytes_sent_{0};  // (one writer)
  std::atomic<bool> streaming_{false};  // see set_streaming()
};

}  // namespace ringreduce
