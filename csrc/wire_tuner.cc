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

bool WireTuner::taking_turns(const SizeClass& c) const {
  return c.learning && c.calls <= kTurns * wires_;
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
  if (taking_turns(c)) return static_cast<int>((c.calls - 1) % wires_);
  if (c.again >= 0) {  // a second look, to see whether it is faster now
    const int wire = c.again;
    c.again = -1;
    return wire;
  }
  const int best = fastest(c);
  if (c.calls % kExploreEvery != 0) return best;
  // A look at another wire: the others in turn, each on its own share of its turns.
  const int index = static_cast<int>(c.explored++ % (wires_ - 1));
  const int other = index < best ? index : index + 1;
  if (c.turns[other]++ % (int64_t{1} << c.back_off[other]) != 0) return best;
  return other;
}

int WireTuner::back_off(int64_t bytes, int wire) const {
  if (wire < 0 || wire >= wires_) return 0;
  return classes_[size_class_of(bytes)].back_off[wire];
}

void WireTuner::record(int64_t bytes, int wire, double seconds) {
  if (bytes <= 0 || wire < 0 || wire >= wires_) return;
  SizeClass& c = size_class(bytes);
  Estimate& e = c.wire[wire];
  const double ns_per_byte = seconds * 1e9 / static_cast<double>(bytes);
  e.ns_per_byte[e.next] = ns_per_byte;
  e.next = (e.next + 1) % 3;
  e.count = std::min(e.count + 1, 3);
  // By this call's time, not the median: one within reach is worth another look soon,
  // one faster than the fastest at once (unless its median has made it the fastest).
  const int best = fastest(c);
  const bool reference = wire != best && c.wire[best].measured();
  const double best_ns_per_byte = reference ? c.wire[best].median() : 0;
  if (!reference || ns_per_byte <= kFarSlower * best_ns_per_byte)
    c.back_off[wire] = 0;
  else
    c.back_off[wire] = std::min(c.back_off[wire] + 1, kMaxBackOff);
  // (Not while the size takes the wires in turn: its next calls are set.)
  c.again = reference && !taking_turns(c) && ns_per_byte < best_ns_per_byte ? wire : -1;
}

}  // namespace ringreduce
