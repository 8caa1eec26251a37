// Which wire a ring call should take between ranks of one machine: the shared-memory
// slots (ShmChannel), written with ordinary or with streaming stores, or MPI messages.
// Usually shared memory wins (1 MiB reduce_scatter on the development machine: 49 us
// against 83 us), but on a shared machine there are phases, a minute or more long, in
// which the data moving through the slots slows down 3-5x while MPI messages barely do
// (the same call: 263 us against 88 us); and at some sizes MPI messages are simply
// faster (4 MiB allreduce: 380 us against 516 us). Those phases come from where the
// ranks' cores sit: a line another core has just written is slow to fetch from another
// die, and there slots written with streaming stores (copy_streaming() in copy.h), which
// the reader fetches from memory instead, win back most of the loss (1 MiB allgather,
// 2 ranks, medians: 112 us against 392 us), while costing up to 1.55x where the cores
// share a cache. Measuring beats guessing: the tuner keeps, per size class, each wire's last
// three times per byte, sends each call the way whose median is lowest, and now and
// then sends one another way to keep that wire's times fresh. A size's first calls take
// the wires in turn, to have all their times early. The median of three lets one odd
// call go by (this machine has many) and follows a real change in two. A wire that
// look after look is far slower than the fastest is looked at ever less often (down to
// one look in 16 of its turns; a size's first calls count, so a wire far slower in all
// four of its first calls starts there): every look at a wire 3x slower costs two calls' time,
// which at a look every 64 calls was 3% of all (64 KiB allgathers under Open MPI, in
// a slow phase), for news that rarely comes. A look within reach of the fastest makes
// it a wire to look at on each of its turns again, and one that finds it faster than
// the fastest looks again at the next call, so that a wire's times follow the end of
// a phase in two calls.
//
// Pure bookkeeping, no MPI and no clock: the caller times its calls. Only rank 0's
// tuner decides; its choice travels in the call header, so all ranks take one wire.
#pragma once

#include <array>
#include <cstdint>

namespace ringreduce {

// The wires, as the call header carries rank 0's choice.
constexpr int kWireShm = 0, kWireMpi = 1, kWireShmStreaming = 2;

class WireTuner {
 public:
  static constexpr int kExploreEvery = 32;  // every 32nd call of a size tries another wire
  static constexpr int kTurns = 4;  // a size's first calls take each wire this often, in turn
  // A look that finds a wire more than kFarSlower times the fastest's median halves how
  // often it is looked at, down to once in 2^kMaxBackOff of its turns.
  static constexpr double kFarSlower = 1.5;
  static constexpr int kMaxBackOff = 4;

  // streaming: whether the streaming wire is one to try (where copy_streaming() streams).
  explicit WireTuner(bool streaming = true) : wires_(streaming ? 3 : 2) {}

  int wires() const { return wires_; }
  // The wire for the next call of `bytes` (kWireShm, ...). Counts the call.
  int choose(int64_t bytes);
  // How long a call of `bytes` took on the wire it took.
  void record(int64_t bytes, int wire, double seconds);
  // A wire's back-off for calls of `bytes`: it is looked at once in 2^back_off turns.
  int back_off(int64_t bytes, int wire) const;
  // k for calls of [2^k, 2^(k+1)) bytes: calls in one class share their times.
  static int size_class_of(int64_t bytes);

 private:
  struct Estimate {  // a wire's last three times, in ns per byte
    std::array<double, 3> ns_per_byte{};
    int count = 0;  // how many are in (at most 3)
    int next = 0;   // where the next one goes
    bool measured() const { return count > 0; }
    double median() const;
  };
  struct SizeClass {  // calls of [2^k, 2^(k+1)) bytes
    std::array<Estimate, 3> wire;  // by wire code
    int64_t calls = 0;
    int64_t explored = 0;  // turns to look at wires other than the fastest, so far
    std::array<int64_t, 3> turns{};   // by wire: its turns to be looked at, so far
    std::array<int, 3> back_off{};    // by wire: looked at once in 2^back_off turns
    int again = -1;  // a wire the last look found faster than the fastest: the next call's
    bool learning = false;  // its first calls take the wires in turn (set on the first)
  };
  SizeClass& size_class(int64_t bytes);
  int fastest(const SizeClass& c) const;
  // Whether the size's first calls are still taking the wires in turn (see choose()).
  bool taking_turns(const SizeClass& c) const;
  int wires_;
  std::array<SizeClass, 64> classes_{};
};

}  // namespace ringreduce
