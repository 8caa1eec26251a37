// Waiting on another rank: how (back_off) and for how long (StallTimer). Every loop that
// waits on another rank (the header exchange, a ring phase, an MPI request) asks its
// StallTimer on each idle turn, and gives up with TimeoutError once the communicator's
// timeout has passed: a rank that never joins a call must not leave the others waiting
// forever.
#pragma once

#include <sched.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace ringreduce {

class StallTimer {
 public:
  // seconds <= 0: never expires.
  explicit StallTimer(double seconds) : seconds_(seconds) {}

  // An idle turn. Reads the clock only every kTurnsPerCheck turns (the first read
  // starts the stall), so a loop that waits a few hundred cycles never reads it.
  bool expired() {
    if (seconds_ <= 0 || ++turns_ % kTurnsPerCheck != 0) return false;
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
  if (++*idle < 64) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else {
    sched_yield();
  }
}

// "1.5 s", "1800 s": a timeout as messages print it.
inline std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", seconds);
  return text;
}

// The message of a ring wait that timed out: on the left neighbour's next chunk
// (receiving), or on the right neighbour taking ours (sending).
inline std::string neighbour_timeout_text(double seconds, int neighbour, bool receiving) {
  return "waited " + seconds_text(seconds) + " (the timeout) for rank " +
         std::to_string(neighbour) +
         (receiving ? " (the left neighbour) to send a chunk"
                    : " (the right neighbour) to take a chunk");
}

}  // namespace ringreduce
