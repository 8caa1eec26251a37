#include "wire_tuner.h"

namespace ringreduce {

WireTuner::SizeClass& WireTuner::size_class(int64_t bytes) {
  int k = 0;
  while (k < 63 && (int64_t{2} << k) <= bytes) ++k;
  return classes_[k];
}

bool WireTuner::prefer_shm(int64_t bytes) {
  SizeClass& c = size_class(bytes);
  // Shared memory until MPI has been measured faster.
  const bool shm_faster = !c.mpi.measured || !c.shm.measured ||
                          c.shm.ns_per_byte <= c.mpi.ns_per_byte;
  ++c.calls;
  if (c.calls % kExploreEvery == 0) return !shm_faster;
  return shm_faster;
}

void WireTuner::record(int64_t bytes, bool shm, double seconds) {
  if (bytes <= 0) return;
  SizeClass& c = size_class(bytes);
  Estimate& e = shm ? c.shm : c.mpi;
  const double sample = seconds * 1e9 / static_cast<double>(bytes);
  e.ns_per_byte = e.measured ? (1 - kWeight) * e.ns_per_byte + kWeight * sample : sample;
  e.measured = true;
}

}  // namespace ringreduce
