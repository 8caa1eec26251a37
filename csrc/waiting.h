// Waiting on another rank: how (back_off) and for how long (StallTimer). Every loop that
// waits on another rank (the header exchange, a ring phase, an MPI request) asks its
// StallTimer on each idle turn, and gives up with TimeoutError once the communicator's
// timeout has passed: a rank that never joins a call must not leave the others waiting
// forever. Now and then (the turns its StallTimer reads the clock) it also looks for a
// rank that has told the others it left the communicator (see Departure), and raises at
// once if one has.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <mutex>
#include <string>
#include <utility>

#include "errors.h"

namespace ringreduce {

class StallTimer {
 public:
  // seconds <= 0: never expires.
  explicit StallTimer(double seconds) : seconds_(seconds) {}

  // An idle turn. Every kTurnsPerCheck turns, with or without a timeout, it calls
  // look_around() (which throws if a rank the wait depends on has left: the better
  // reason, before any timeout) and reads the clock (the first read starts the stall),
  // so a loop that waits a few hundred cycles does neither. True once the timeout has
  // passed without progress.
  template <typename LookAround>
  bool expired(LookAround&& look_around) {
    if (++turns_ % kTurnsPerCheck != 0) return false;
    look_around();
    if (seconds_ <= 0) return false;
    const auto now = std::chrono::steady_clock::now();
    if (!started_) {
      started_ = true;
      since_ = now;
      return false;
    }
    return std::chrono::duration<double>(now - since_).count() > seconds_;
  }
  void progressed() {
    started_ = false;
    turns_ = 0;
  }

 private:
  static constexpr int64_t kTurnsPerCheck = 256;
  double seconds_;
  int64_t turns_ = 0;
  bool started_ = false;
  std::chrono::steady_clock::time_point since_;
};

// Waiting on another rank: spin briefly (it is usually a few hundred cycles away), then
// give the core away, which matters when there are more ranks than cores.
inline void back_off(int* idle) {
  // Counts up to 64 and stays there: a wait of 2^31 turns (minutes) must not wrap it
  // back to spinning.
  if (*idle < 64) {
    ++*idle;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else {
    sched_yield();
  }
}

// Why a rank stopped using a communicator for good, as it tells the others (with a
// DepartureNote): every rank that then waits on it raises TimeoutError instead of
// waiting out its timeout, and close() on those ranks frees nothing that would wait for it.
enum class Departure : int {
  GaveUp = 1,    // a timeout there
  Left = 2,      // an error in a call (Ctrl-C's too), an exception left its `with`
                 // block, or close() met a collective
  Followed = 3,  // it learnt that another rank had left (its note names that one)
  Unclosed = 4,  // its process ended, or dropped the communicator, without closing it,
                 // every call of its own finished (told on shared memory; over MPI
                 // messages in a header exchange, at exit or as it is dropped)
  Ended = 5,     // an uncaught exception is ending its process: it makes no more calls,
                 // nor any Communicator
  Vanished = 6,  // it found the process of the rank it names (cause) ended without a
                 // word: killed (SIGKILL, the out-of-memory killer), or os._exit()
};

// What a rank that left tells the others: why, and how many of the communicator's
// header exchanges it saw through (the work after the last one included). A rank in
// exchange n, or in the ring after it, has lost that rank only if it saw through fewer
// than n: a rank that finished a call and then left holds up no one finishing that call.
// A rank that followed another also passes on where things went wrong (cause), since
// its notice may reach a third rank before the first one's does.
struct DepartureNote {
  int rank = -1;  // -1: none
  Departure why = Departure::GaveUp;
  int64_t completed = 0;
  // Followed: the rank that left first (-1: not known), and why. GaveUp: the rank it
  // waited for (-1: not known), so that a rank that waited for the same one and learns
  // of this first still names it.
  int cause = -1;
  Departure cause_why = Departure::GaveUp;
  // Learnt from a header exchange (a close at exit), which every rank in it saw: a rank
  // that follows it need tell no one.
  bool seen_by_all = false;

  bool holds_up(int64_t exchange) const { return rank >= 0 && completed < exchange; }
  // The departure that started it all, as far as this note knows: itself unless it
  // followed a known rank.
  DepartureNote origin() const {
    if (why != Departure::Followed || cause < 0) return *this;
    DepartureNote first;
    first.rank = cause;
    first.why = cause_why;
    first.completed = completed;
    return first;
  }
  // Between two notes that hold up `exchange`, the one to report: the first that did
  // not merely follow another, or else one that knows whom it followed.
  void prefer(const DepartureNote& other, int64_t exchange) {
    if (!other.holds_up(exchange)) return;
    if (!holds_up(exchange) || rank_of_preference() > other.rank_of_preference()) *this = other;
  }
  // A note that a process is ending wins over any other: it is final and tells the
  // most (one of the same rank's that came first, Unclosed over MPI say, is replaced).
  int rank_of_preference() const {  // lower is better
    if (origin().why == Departure::Ended) return -1;
    return why != Departure::Followed ? 0 : cause >= 0 ? 1 : 2;
  }
  std::string text() const {
    const DepartureNote first = origin();
    std::string said = "rank " + std::to_string(first.rank);
    // (Left while the ranks were making it: only a stop there, which is Ctrl-C; Left's
    // other causes are a call's.)
    if (first.completed < 0 && first.why == Departure::Left)
      said += " has left this communicator while the ranks were making it (Ctrl-C there)";
    else
      said += what(first.why, first.cause) +
              (first.completed < 0 ? " while the ranks were making it" : "");
    if (first.rank != rank)
      said += "; rank " + std::to_string(rank) + " left after it and said so";
    return said;
  }
  // What a wait throws on learning of it (the others' wait would end in a timeout
  // anyway), with whether another rank's own timeout began it.
  TimeoutError timeout() const {
    return TimeoutError(text(), -1, false,
                        origin().why == Departure::GaveUp ? TimeoutError::Kind::kAnotherGaveUp
                                                          : TimeoutError::Kind::kInCall);
  }
  // waited_for: GaveUp's cause (Vanished's: the rank whose process ended).
  static std::string what(Departure why, int waited_for) {
    if (why == Departure::Vanished)
      return " has left this communicator: it found the process of " +
             (waited_for >= 0 ? "rank " + std::to_string(waited_for) : std::string("a rank")) +
             " ended without a word (killed by a signal or the out-of-memory killer, or "
             "ended without its exit handlers, as os._exit() does)";
    if (why == Departure::GaveUp)
      return " has given up on this communicator (a timeout there" +
             (waited_for >= 0 ? ", waiting for rank " + std::to_string(waited_for) : "") + ")";
    return why == Departure::Left ? " has left this communicator (an error there, Ctrl-C, an "
                                      "exception that left its `with` block, or close() "
                                      "where this rank called a collective)"
           : why == Departure::Unclosed
               // (Its exit after a timeout on another Communicator looks the same here:
               // the message must not suggest that it simply ended.)
               ? " has stopped using this communicator without closing it (its process "
                 "ended, or dropped the Communicator), after fewer calls on it than this "
                 "rank made (where it met an error or a timeout first, on another "
                 "Communicator say, its own message says why)"
           : why == Departure::Ended
               ? " has ended (an uncaught exception there ends its process)"
               : " has left this communicator, after another rank did";
  }
};

// An exchange every departure note holds up: prefer() over all notes, at any point.
constexpr int64_t kAnyExchange = std::numeric_limits<int64_t>::max();

// Stops the call this rank runs (see StoppedError): each wire has one, which its waits
// check when they look around. Two causes: set() from another thread, and an interrupt
// (a counter the process bumps on each, in Python on SIGINT) that came during the call.
// The waits know no call: a call's error gets the call and the rank in front where the
// call catches it (RingCommunicator::guarded); while a Communicator is being made, the
// context given here is put in front instead.
class StopRequest {
 public:
  // why: what the message gives as the reason ("MPI.Finalize() on this rank"; empty:
  // the ones the Python layer has). The first reason given stays.
  void set(const std::string& why = "") {
    {
      std::lock_guard<std::mutex> lock(why_mutex_);
      if (!requested_.load(std::memory_order_relaxed)) why_ = why;
    }
    requested_.store(true, std::memory_order_release);
  }
  void watch(const std::atomic<uint64_t>* interrupts) { interrupts_ = interrupts; }
  // "ringreduce.Communicator (rank 0 of 2): " while it is being made; "" once made. Only
  // on the thread that makes it (the one that checks).
  void set_context(std::string context) { context_ = std::move(context); }
  // At the start of each call, on the thread that runs it: interrupts before it (which
  // the caller has seen, or will) do not stop it.
  void arm() {
    if (interrupts_ != nullptr) armed_at_ = interrupts_->load(std::memory_order_relaxed);
  }
  void check() const {
    if (requested_.load(std::memory_order_acquire)) {
      std::string why;
      {
        std::lock_guard<std::mutex> lock(why_mutex_);
        why = why_;
      }
      throw StoppedError(context_ + "stopped on this rank, which is leaving the communicator " +
                         (why.empty() ? "(in Python: an exception left the Communicator's "
                                        "`with` block, or the process is ending, while this "
                                        "call was in flight)"
                                      : "(" + why + ")"));
    }
    if (interrupts_ != nullptr && interrupts_->load(std::memory_order_relaxed) != armed_at_)
      throw StoppedError(context_ + "interrupted (SIGINT) on this rank, which is leaving the "
                         "communicator");
  }

 private:
  std::atomic<bool> requested_{false};
  mutable std::mutex why_mutex_;
  std::string why_;
  std::string context_;
  const std::atomic<uint64_t>* interrupts_ = nullptr;
  uint64_t armed_at_ = 0;
};

// "1.5 s", "1800 s": a timeout as messages print it.
inline std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", seconds);
  return text;
}

// A ring wait that timed out: on the left neighbour's next chunk (receiving), or on the
// right neighbour taking ours (sending).
inline TimeoutError neighbour_timeout(double seconds, int neighbour, bool receiving) {
  return TimeoutError("waited " + seconds_text(seconds) + " (the timeout) for rank " +
                          std::to_string(neighbour) +
                          (receiving ? " (the left neighbour) to send a chunk"
                                     : " (the right neighbour) to take a chunk"),
                      neighbour);
}

}  // namespace ringreduce
