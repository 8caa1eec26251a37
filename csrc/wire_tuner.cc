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

int WireTuner::fastest(const SizeClass& c) const {
  // Shared memory unless another wire is measured faster (on a tie too), and while
  // shared memory has no time of its own.
  int best = kWireShm;
  if (!c.wire[kWireShm].measured()) return best;
  for (int w = 0; w < wires_; ++w)
    if (c.wire[w].measured() && c.wire[w].median() < c.wire[best].median()) best = w;
  return best;
}

int WireTuner::choose(int64_t bytes) {
  SizeClass& c = size_class(bytes);
  // A size's first calls take the wires in turn, four each: a collective called only a
  // few dozen times (a broadcast of the weights now and then) would otherwise look at
  // the others once or twice in all, and keep the slower wire, which in this machine's
  // slow phases takes 2-3x as long. Of four, the last three count: a wire's first calls
  // pay for cold caches and, over MPI, the library's own set-up (MPICH's first two
  // 1 MiB broadcasts took 400-580 us, against 140 us after), and the median of the
  // three lets the second go by too. (Unless every wire has its times already: tests
  // give them.)
  if (++c.calls == 1) {
    c.learning = false;
    for (int w = 0; w < wires_; ++w) c.learning = c.learning || c.wire[w].count < 3;
  }
  if (c.learning && c.calls <= kTurns * wires_) return static_cast<int>((c.calls - 1) % wires_);
  const int best = fastest(c);
  if (c.calls % kExploreEvery != 0) return best;
  // A look at another wire: the others in turn.
  const int other = static_cast<int>(c.explored++ % (wires_ - 1));
  return other < best ? other : other + 1;
}

void WireTuner::record(int64_t bytes, int wire, double seconds) {
  if (bytes <= 0 || wire < 0 || wire >= wires_) return;
  Estimate& e = size_class(bytes).wire[wire];
  e.ns_per_byte[e.next] = seconds * 1e9 / static_cast<double>(bytes);
  e.next = (e.next + 1) % 3;
  e.count = std::min(e.count + 1, 3);
}

}  // namespace ringreduce
