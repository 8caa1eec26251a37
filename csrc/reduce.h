// Element-wise reduction kernels, one per dtype x op.
//
// Every kernel computes dst[i] = a[i] OP b[i] with numpy's semantics, so that the
// C++ ring and the numpy reference (ringreduce/reference.py) agree bit for bit:
//   - integers wrap on overflow (computed in unsigned arithmetic: no C++ UB);
//   - float16 and bfloat16 are widened to float32, combined, and rounded once
//     (round to nearest even), exactly what numpy and ml_dtypes do per operation;
//   - min/max propagate NaN like np.minimum/np.maximum (a NaN in a wins first);
//   - complex products are (ar*br - ai*bi, ar*bi + ai*br), with no FMA contraction.
// dst may alias a (in-place reduction); b never aliases either.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace ringreduce {

// dst = a OP b over n elements. Op::Avg reduces as Op::Sum (see divide()).
void reduce(DType dtype, Op op, void* dst, const void* a, const void* b, int64_t n);

// Whether reduce() may run the loops chosen at run time for this CPU (AVX2; float16
// with F16C), as it does by default, or only those for the baseline the build targets.
// Tests switch, to hold both to numpy's bits. Returns whether any CPU-specific loop is
// in use now.
bool use_cpu_kernels(bool on);

// data /= divisor, element-wise; complex numbers divide each component. Used once per
// element of a fully reduced result, to turn a sum into an average: by the ring on this
// rank's own segment before the all-gather, by a call done in the header exchange on
// each segment it reduces.
void divide(DType dtype, void* data, int64_t n, int64_t divisor);

// Turns flush-to-zero and denormals-are-zero on or off for this thread (x86-64's MXCSR),
// as a library built with -ffast-math does when loaded; reduce() and divide() ignore
// them. Returns whether both were on. For tests; elsewhere it does nothing and says
// false.
bool set_flush_subnormals(bool on);

// While one lives, this thread computes with subnormals as IEEE 754 says, whatever its
// flush-to-zero and denormals-are-zero were (put back at the end): for what must give
// the same bits on every rank (reduce(), divide(), lowrank.h's).
class IeeeSubnormals {
 public:
  IeeeSubnormals();
  ~IeeeSubnormals();
  IeeeSubnormals(const IeeeSubnormals&) = delete;
  IeeeSubnormals& operator=(const IeeeSubnormals&) = delete;

 private:
  unsigned saved_;
};

}  // namespace ringreduce
