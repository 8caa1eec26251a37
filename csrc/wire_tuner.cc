#include "wire_tuner.h"

#include <algorithm>

namespace ringreduce {

int WireTuner::size_class_of(int64_t bytes) {
  int k = 0;
  while (k < 62 && (int64_t{2} << k) <= bytes) ++k;
  return k;
}

WireTuner::SizeClass& WireTuner::size_class(int64_t bytes) { return classes_[size_class_of(bytes)]; }

double WireTuner::Estimate::median() const {
  if (count < 3) return count == 1 ? ns_per_byte[0] : (ns_per_byte[0] + ns_per_byte[1]) / 2;
  const double a = ns_per_byte[0], b = ns_per_byte[1], c = ns_per_byte[2];
  return std::max(std::min(a, b), std::min(std::max(a, b), c));
}

bool WireTuner::prefer_shm(int64_t bytes) {
  SizeClass& c = size_class(bytes);
  ++c.calls;
  // A size's second call tries MPI: a collective called only a few times (a broadcast
  // of the initial weights) would otherwise never look past shared memory, which in
  // the machine's slow phases takes 2-3x as long.
  if (c.calls == kFirstLook && !c.mpi.measured()) return false;
  // Shared memory until MPI has been measured faster.
  const bool shm_faster = !c.mpi.measured() || !c.shm.measured() ||
                          c.shm.median() <= c.mpi.median();
  if (c.calls % kExploreEvery == 0) return !shm_faster;
  return shm_faster;
}

void WireTuner::record(int64_t bytes, bool shm, double seconds) {
  if (bytes <= 0) return;
  SizeClass& c = size_class(bytes);
  Estimate& e = shm ? c.shm : c.mpi;
  e.ns_per_byte[e.next] = seconds * 1e9 / static_cast<double>(bytes);
  e.next = (e.next + 1) % 3;
  e.count = std::min(e.count + 1, 3);
}

}  // namespace ringreduce
