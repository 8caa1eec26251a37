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
  bool shm = choose(c);
  Estimate& e = shm ? c.shm : c.mpi;
  // A wire's first call of a size is not timed: it pays for cold caches and, over MPI,
  // for the library's own set-up (MPICH's first 1 MiB broadcasts took 400-580 us,
  // against 140 us after).
  if (e.used++ == 0) e.skip_next = true;
  return shm;
}

bool WireTuner::choose(const SizeClass& c) {
  // A size's first calls take the wires in turn, until each has its three times: a
  // collective called only a few dozen times (a broadcast of the weights now and then)
  // would otherwise look at MPI once or twice in all, and keep the slower wire, which
  // in this machine's slow phases takes 2-3x as long.
  if (c.calls <= kLearnCalls) {
    const bool shm_turn = c.calls % 2 == 1;
    if ((shm_turn ? c.shm : c.mpi).count < 3) return shm_turn;
  }
  const bool shm_faster = !c.mpi.measured() || !c.shm.measured() ||
                          c.shm.median() <= c.mpi.median();
  if (c.calls % kExploreEvery == 0) return !shm_faster;
  return shm_faster;
}

void WireTuner::record(int64_t bytes, bool shm, double seconds) {
  if (bytes <= 0) return;
  SizeClass& c = size_class(bytes);
  Estimate& e = shm ? c.shm : c.mpi;
  if (e.skip_next) {
    e.skip_next = false;
    return;
  }
  e.ns_per_byte[e.next] = seconds * 1e9 / static_cast<double>(bytes);
  e.next = (e.next + 1) % 3;
  e.count = std::min(e.count + 1, 3);
}

}  // namespace ringreduce
