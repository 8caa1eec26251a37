// Which wire a ring call should take between ranks of one machine: the shared-memory
// slots (ShmChannel) or MPI messages. Usually shared memory wins (1 MiB reduce_scatter
// on the development machine: 49 us against 83 us), but on a shared machine there are
// phases, a minute or more long, in which the data moving through the slots slows down
// 3-5x while MPI messages barely do (the same call: 263 us against 88 us); and at
// some sizes MPI messages are simply faster (4 MiB allreduce: 380 us against 516 us).
// Measuring beats guessing: the tuner keeps, per size class, each wire's last three
// times per byte, sends each call the way whose median is lower, and now and then
// sends one the other way to keep that wire's times fresh. A size's first eight calls
// alternate, to have both wires' times early. The median of three lets
// one odd call go by (this machine has many) and follows a real change in two.
//
// Pure bookkeeping, no MPI and no clock: the caller times its calls. Only rank 0's
// tuner decides; its choice travels in the call header, so all ranks take one wire.
#pragma once

#include <array>
#include <cstdint>

namespace ringreduce {

class WireTuner {
 public:
  static constexpr int kExploreEvery = 32;  // every 32nd call of a size tries the other wire
  static constexpr int kLearnCalls = 8;  // a size's first calls alternate, shm first (see prefer_shm())

  // The wire for the next call of `bytes`: true for shared memory. Counts the call.
  bool prefer_shm(int64_t bytes);
  // How long a call of `bytes` took on the wire it took.
  void record(int64_t bytes, bool shm, double seconds);
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
    Estimate shm, mpi;
    int64_t calls = 0;
    bool learning = false;  // its first kLearnCalls calls alternate (set on the first)
  };
  SizeClass& size_class(int64_t bytes);
  std::array<SizeClass, 64> classes_{};
};

}  // namespace ringreduce
