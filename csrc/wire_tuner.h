// Which wire a ring call should take between ranks of one machine: the shared-memory
// slots (ShmChannel) or MPI messages. Usually shared memory wins (1 MiB reduce_scatter
// on the development machine: 56 us against 94 us), but on a shared machine there are
// phases, a minute or more long, in which the data moving through the slots slows down
// 3-5x while MPI messages barely do (the same call: 272 us against 110 us). Measuring
// beats guessing: the tuner keeps, per size class, a running estimate of each wire's
// time per byte, sends each call the faster way, and now and then sends one the other
// way to keep that wire's estimate fresh.
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
  static constexpr double kWeight = 0.5;    // of a new time in the running estimate

  // The wire for the next call of `bytes`: true for shared memory. Counts the call.
  bool prefer_shm(int64_t bytes);
  // How long a call of `bytes` took on the wire it took.
  void record(int64_t bytes, bool shm, double seconds);

 private:
  struct Estimate {
    double ns_per_byte = 0;
    bool measured = false;
  };
  struct SizeClass {  // calls of [2^k, 2^(k+1)) bytes
    Estimate shm, mpi;
    int64_t calls = 0;
  };
  SizeClass& size_class(int64_t bytes);
  std::array<SizeClass, 64> classes_{};
};

}  // namespace ringreduce
