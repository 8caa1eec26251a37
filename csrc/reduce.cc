#include "reduce.h"

#include "reduce_ops.h"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RINGREDUCE_HAVE_F16C 1
#define RINGREDUCE_HAVE_X86_DISPATCH 1
#else
#define RINGREDUCE_HAVE_F16C 0
#define RINGREDUCE_HAVE_X86_DISPATCH 0
#endif
// GCC 11 has both the AVX512-BF16 intrinsics and their run-time check; clang's check came
// later, so clang builds keep the AVX2 loop for bfloat16.
#if RINGREDUCE_HAVE_X86_DISPATCH && !defined(__clang__) && __GNUC__ >= 11
#define RINGREDUCE_HAVE_AVX512_BF16 1
#else
#define RINGREDUCE_HAVE_AVX512_BF16 0
#endif

namespace ringreduce {

namespace {

using namespace ops;

// One loop per (type, op): simple enough for the compiler to vectorise. Only b is
// restrict-qualified, because dst and a are the same buffer for in-place calls.
template <typename T, template <typename> class OpT>
__attribute__((always_inline)) inline void reduce_elements(T* dst, const T* a,
                                                           const T* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = OpT<T>::apply(a[i], b[i]);
}

// numpy's arrays may start at any byte (np.frombuffer at an odd offset, a field of a
// packed record), and reading or writing through a T* that is not aligned for T is
// undefined behaviour (UBSan: "store to misaligned address ... for type 'float'"), which
// allows the compiler to vectorise with moves that fault there. Such arrays take this
// loop, whose elements go in and out through memcpy (the same bits). Not every call:
// the compiler vectorises it less well (complex numbers not at all).
template <typename T>
__attribute__((always_inline)) inline T load_element(const char* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

template <typename T>
__attribute__((always_inline)) inline void store_element(char* p, const T& value) {
  std::memcpy(p, &value, sizeof(T));
}

template <typename T, template <typename> class OpT>
__attribute__((always_inline)) inline void reduce_unaligned(void* dst, const void* a,
                                                            const void* __restrict b,
                                                            int64_t n) {
  char* d = static_cast<char*>(dst);
  const char* x = static_cast<const char*>(a);
  const char* y = static_cast<const char*>(b);
  for (int64_t i = 0; i < n; ++i) {
    const size_t at = static_cast<size_t>(i) * sizeof(T);
    store_element(d + at, OpT<T>::apply(load_element<T>(x + at), load_element<T>(y + at)));
  }
}

template <typename T>
bool aligned_for(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(T) == 0;
}

template <typename T, template <typename> class OpT>
__attribute__((always_inline)) inline void reduce_any(void* dst, const void* a,
                                                      const void* __restrict b, int64_t n) {
  if (aligned_for<T>(dst) && aligned_for<T>(a) && aligned_for<T>(b))
    reduce_elements<T, OpT>(static_cast<T*>(dst), static_cast<const T*>(a),
                            static_cast<const T*>(b), n);
  else
    reduce_unaligned<T, OpT>(dst, a, b, n);
}

template <typename T, template <typename> class OpT>
void reduce_loop(void* dst, const void* a, const void* __restrict b, int64_t n) {
  reduce_any<T, OpT>(dst, a, b, n);
}

#if RINGREDUCE_HAVE_X86_DISPATCH
// The same loop compiled for AVX2, chosen at run time where the CPU has it (the build
// targets plain x86-64: SSE2). Measured here, medians of 15 alternating runs: bfloat16
// sums take half the time at every size (64 KiB: 12.5 us against 24.4 us), where the
// widening and rounding is the work; float32 and float64 of 4 KiB about half; from
// 16 KiB on, which is what the ring reduces, they wait on the cache either way (0.9x-1.3x).
// The same IEEE operations on each element, so the same bits (no FMA: the build has
// -ffp-contract=off); tests/test_kernels.py holds both builds to numpy's.
template <typename T, template <typename> class OpT>
__attribute__((target("avx2"))) void reduce_loop_avx2(void* dst, const void* a,
                                                      const void* __restrict b, int64_t n) {
  reduce_any<T, OpT>(dst, a, b, n);
}

bool has_avx2() {
  static const bool supported = [] {
    __builtin_cpu_init();  // (harmless if libgcc has already read the CPU's features)
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return supported;
}
#endif

// Whether reduce() may take the loops chosen for this CPU (AVX2, F16C); see
// use_cpu_kernels().
std::atomic<bool> cpu_kernels{true};

using ReduceFn = void (*)(void*, const void*, const void*, int64_t);

template <typename T, template <typename> class OpT>
ReduceFn loop_for() {
#if RINGREDUCE_HAVE_X86_DISPATCH
  if (cpu_kernels.load(std::memory_order_relaxed) && has_avx2())
    return &reduce_loop_avx2<T, OpT>;
#endif
  return &reduce_loop<T, OpT>;
}

template <typename T>
ReduceFn kernel_for(Op op) {
  switch (op) {
    case Op::Sum: case Op::Avg: return loop_for<T, SumOp>();
    case Op::Prod: return loop_for<T, ProdOp>();
    case Op::Min: return loop_for<T, MinOp>();
    case Op::Max: return loop_for<T, MaxOp>();
  }
  return nullptr;
}

template <typename R>
ReduceFn complex_kernel_for(Op op) {
  switch (op) {
    case Op::Sum: case Op::Avg: return loop_for<Complex<R>, SumOp>();
    case Op::Prod: return loop_for<Complex<R>, ProdOp>();
    default: return nullptr;  // no order on complex numbers
  }
}

ReduceFn select_kernel(DType dtype, Op op) {
  switch (dtype) {
    case DType::Float16: return kernel_for<Half>(op);
    case DType::BFloat16: return kernel_for<BFloat16>(op);
    case DType::Float32: return kernel_for<float>(op);
    case DType::Float64: return kernel_for<double>(op);
    case DType::Int8: return kernel_for<int8_t>(op);
    case DType::Int16: return kernel_for<int16_t>(op);
    case DType::Int32: return kernel_for<int32_t>(op);
    case DType::Int64: return kernel_for<int64_t>(op);
    case DType::UInt8: return kernel_for<uint8_t>(op);
    case DType::UInt16: return kernel_for<uint16_t>(op);
    case DType::UInt32: return kernel_for<uint32_t>(op);
    case DType::UInt64: return kernel_for<uint64_t>(op);
    case DType::Complex64: return complex_kernel_for<float>(op);
    case DType::Complex128: return complex_kernel_for<double>(op);
    case DType::Bool: return kernel_for<Bool>(op);
  }
  return nullptr;
}

template <typename T>
__attribute__((always_inline)) inline void divide_elements(void* data_v, int64_t n,
                                                           int64_t divisor) {
  char* data = static_cast<char*>(data_v);  // (at any address: see reduce_unaligned())
  for (int64_t i = 0; i < n; ++i) {
    char* at = data + static_cast<size_t>(i) * sizeof(T);
    store_element(at, divide_element(load_element<T>(at), divisor));
  }
}

template <typename T>
void divide_loop(void* data, int64_t n, int64_t divisor) {
  divide_elements<T>(data, n, divisor);
}

#if RINGREDUCE_HAVE_X86_DISPATCH
// As for the sums: with AVX2 the compiler widens and rounds 8 bfloat16 at a time, which
// the baseline build does one by one (an average's division cost more than the sums
// of a whole bfloat16 allreduce).
template <typename T>
__attribute__((target("avx2"))) void divide_loop_avx2(void* data, int64_t n, int64_t divisor) {
  divide_elements<T>(data, n, divisor);
}
#endif

template <typename T>
void divide_any(void* data, int64_t n, int64_t divisor) {
#if RINGREDUCE_HAVE_X86_DISPATCH
  if (cpu_kernels.load(std::memory_order_relaxed) && has_avx2())
    return divide_loop_avx2<T>(data, n, divisor);
#endif
  divide_loop<T>(data, n, divisor);
}

#if RINGREDUCE_HAVE_F16C
// float16 with the F16C instructions, chosen at run time: 8 halves widened to float32
// at once. Sums and products are rounded back to nearest even in hardware, which gives
// the same bits as float_to_half (NaN payloads aside): 30x the scalar speed. Min and max
// compare the widened values (exactly) as MinOp and MaxOp do, and keep the chosen
// operand's own bits (a NaN in a first), where the scalar loop's widening made them 30x
// slower than the sums.
bool has_f16c() {
  static const bool supported = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return supported;
}

__attribute__((target("avx,f16c"))) void reduce_half_f16c(Op op, void* dst, const void* a,
                                                           const void* __restrict b,
                                                           int64_t n) {
  char* d = static_cast<char*>(dst);  // (at any address: see reduce_unaligned())
  const char* x8 = static_cast<const char*>(a);
  const char* __restrict y8 = static_cast<const char*>(b);
  const bool picks = op == Op::Min || op == Op::Max;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i xh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x8 + 2 * i));
    const __m128i yh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(y8 + 2 * i));
    const __m256 x = _mm256_cvtph_ps(xh), y = _mm256_cvtph_ps(yh);
    __m128i z;
    if (picks) {
      const __m256 ordered =
          op == Op::Max ? _mm256_cmp_ps(x, y, _CMP_GE_OQ) : _mm256_cmp_ps(x, y, _CMP_LE_OQ);
      const __m256 take_x = _mm256_or_ps(ordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      // The 8 lanes' all-ones or zeros, narrowed to 16 bits (saturating keeps each so).
      const __m256i wide = _mm256_castps_si256(take_x);
      const __m128i take = _mm_packs_epi32(_mm256_castsi256_si128(wide),
                                           _mm256_extractf128_si256(wide, 1));
      z = _mm_blendv_epi8(yh, xh, take);
    } else {
      z = _mm256_cvtps_ph(op == Op::Prod ? _mm256_mul_ps(x, y) : _mm256_add_ps(x, y),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * i), z);
  }
  using H = Half;
  for (; i < n; ++i) {
    const H x = load_element<H>(x8 + 2 * i), y = load_element<H>(y8 + 2 * i);
    const H z = op == Op::Prod  ? ProdOp<H>::apply(x, y)
                : op == Op::Min ? MinOp<H>::apply(x, y)
                : op == Op::Max ? MaxOp<H>::apply(x, y)
                                : SumOp<H>::apply(x, y);  // (and Avg's sums)
    store_element(d + 2 * i, z);
  }
}

// An average's division, as divide_element<Half> does it (the divisor rounded to a half,
// the quotient computed in float32 and rounded once), 8 halves at a time: the scalar
// loop's conversions cost 6x a whole float16 allreduce's sum.
__attribute__((target("avx,f16c"))) void divide_half_f16c(void* data, int64_t n,
                                                           int64_t divisor) {
  char* d = static_cast<char*>(data);  // (at any address: see reduce_unaligned())
  const __m256 by = _mm256_set1_ps(widened_divisor<Half>(divisor));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 2 * i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * i),
                     _mm256_cvtps_ph(_mm256_div_ps(x, by),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  divide_elements<Half>(d + 2 * i, n - i, divisor);
}
#endif

#if RINGREDUCE_HAVE_AVX512_BF16
// bfloat16 sums, products and an average's division where the CPU rounds float32 to
// bfloat16 itself (AVX512-BF16: Intel since Cooper Lake, AMD since Zen 4), 8 at a time,
// in 256-bit registers (no 512-bit ones: they slow some Intel cores' clocks down). The
// compiler's AVX2 loop rounds with integer arithmetic, 1.8x slower here (a sum of 64 Ki
// elements: 16.2 us against 9.0 us; F16C's float16 loop: 5.2 us). The instruction
// always rounds to nearest even, as float_to_bfloat16 does, but flushes a subnormal
// result to zero and keeps a NaN's payload, where float_to_bfloat16 (as ml_dtypes) keeps
// subnormals and makes every NaN one quiet NaN: 8 results with either go through the
// scalar code instead (rare in gradients), so every result has the scalar loop's bits.
bool has_avx512_bf16() {
  static const bool supported =
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return supported;
}

// The scalar loops, for the elements [from, to): out of line, so as not to crowd the
// vector loops' registers.
__attribute__((noinline, cold)) void reduce_bfloat16_scalar(bool product, char* d,
                                                            const char* x, const char* y,
                                                            int64_t from, int64_t to) {
  const size_t at = 2 * static_cast<size_t>(from);
  if (product)
    reduce_unaligned<BFloat16, ProdOp>(d + at, x + at, y + at, to - from);
  else
    reduce_unaligned<BFloat16, SumOp>(d + at, x + at, y + at, to - from);
}

__attribute__((noinline, cold)) void divide_bfloat16_scalar(char* d, int64_t from, int64_t to,
                                                            int64_t divisor) {
  divide_elements<BFloat16>(d + 2 * static_cast<size_t>(from), to - from, divisor);
}

__attribute__((target("avx2,avx512f,avx512vl,avx512bf16"))) __attribute__((always_inline))
inline __m256 widened_bfloat16(const char* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Whether any of the 8 floats is subnormal or NaN (which the instruction rounds
// otherwise than float_to_bfloat16).
__attribute__((target("avx2,avx512f,avx512vl,avx512bf16"))) __attribute__((always_inline))
inline bool unroundable(__m256 v) {
  const __m256i magnitude =
      _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
  const __mmask8 subnormal = _mm256_cmplt_epu32_mask(
      _mm256_sub_epi32(magnitude, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fffff));
  const __mmask8 nan = _mm256_cmpgt_epu32_mask(magnitude, _mm256_set1_epi32(0x7f800000));
  return (subnormal | nan) != 0;
}

__attribute__((target("avx2,avx512f,avx512vl,avx512bf16"))) __attribute__((always_inline))
inline void store_bfloat16(char* p, __m256 v) {
  const __m128bh rounded = _mm256_cvtneps_pbh(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), reinterpret_cast<const __m128i&>(rounded));
}

template <bool kProduct>
__attribute__((target("avx2,avx512f,avx512vl,avx512bf16"))) void reduce_bfloat16_avx512(
    void* dst, const void* a, const void* __restrict b, int64_t n) {
  char* d = static_cast<char*>(dst);  // (at any address: see reduce_unaligned())
  const char* x8 = static_cast<const char*>(a);
  const char* __restrict y8 = static_cast<const char*>(b);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = widened_bfloat16(x8 + 2 * i), y = widened_bfloat16(y8 + 2 * i);
    const __m256 z = kProduct ? _mm256_mul_ps(x, y) : _mm256_add_ps(x, y);
    if (__builtin_expect(unroundable(z), 0))
      reduce_bfloat16_scalar(kProduct, d, x8, y8, i, i + 8);
    else
      store_bfloat16(d + 2 * i, z);
  }
  reduce_bfloat16_scalar(kProduct, d, x8, y8, i, n);
}

__attribute__((target("avx2,avx512f,avx512vl,avx512bf16"))) void divide_bfloat16_avx512(
    void* data, int64_t n, int64_t divisor) {
  char* d = static_cast<char*>(data);  // (at any address: see reduce_unaligned())
  const __m256 by = _mm256_set1_ps(widened_divisor<BFloat16>(divisor));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 q = _mm256_div_ps(widened_bfloat16(d + 2 * i), by);
    if (__builtin_expect(unroundable(q), 0))
      divide_bfloat16_scalar(d, i, i + 8, divisor);
    else
      store_bfloat16(d + 2 * i, q);
  }
  divide_bfloat16_scalar(d, i, n, divisor);
}
#endif

// Reductions follow IEEE 754 on subnormals whatever the calling thread's MXCSR says. A
// thread may have flush-to-zero and denormals-are-zero on (set by any library built with
// -ffast-math when it is loaded, or by torch.set_flush_denormal): its rank would round
// subnormals otherwise than the others, and a call that rides in the header exchange,
// whose segments every rank reduces itself, would end with other bits on each rank.
// (Reading MXCSR costs about a nanosecond; it is written only where those bits are on.)
constexpr unsigned kFlushBits = 0x8040;  // FTZ (bit 15), DAZ (bit 6)

}  // namespace

#if RINGREDUCE_HAVE_X86_DISPATCH
IeeeSubnormals::IeeeSubnormals() : saved_(_mm_getcsr()) {
  if (saved_ & kFlushBits) _mm_setcsr(saved_ & ~kFlushBits);
}

IeeeSubnormals::~IeeeSubnormals() {
  if (saved_ & kFlushBits) _mm_setcsr(saved_);
}
#else
IeeeSubnormals::IeeeSubnormals() : saved_(0) {}
IeeeSubnormals::~IeeeSubnormals() {}
#endif

bool set_flush_subnormals(bool on) {
#if RINGREDUCE_HAVE_X86_DISPATCH
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(on ? csr | kFlushBits : csr & ~kFlushBits);
  return (csr & kFlushBits) == kFlushBits;
#else
  (void)on;
  return false;
#endif
}

void reduce(DType dtype, Op op, void* dst, const void* a, const void* b, int64_t n) {
  if (n <= 0) return;
  [[maybe_unused]] IeeeSubnormals ieee;
#if RINGREDUCE_HAVE_AVX512_BF16
  if (dtype == DType::BFloat16 && (op == Op::Sum || op == Op::Avg || op == Op::Prod) &&
      cpu_kernels.load(std::memory_order_relaxed) && has_avx512_bf16())
    return op == Op::Prod ? reduce_bfloat16_avx512<true>(dst, a, b, n)
                          : reduce_bfloat16_avx512<false>(dst, a, b, n);
#endif
#if RINGREDUCE_HAVE_F16C
  if (dtype == DType::Float16 && cpu_kernels.load(std::memory_order_relaxed) && has_f16c())
    return reduce_half_f16c(op, dst, a, b, n);  // (every op is defined for float16)
#endif
  ReduceFn fn = select_kernel(dtype, op);
  if (fn == nullptr)
    throw std::invalid_argument(std::string("reduce: op '") + op_name(op) +
                                "' is not defined for dtype " + dtype_name(dtype));
  fn(dst, a, b, n);
}

bool use_cpu_kernels(bool on) {
  cpu_kernels = on;
#if RINGREDUCE_HAVE_X86_DISPATCH
  return on && (has_avx2() || has_f16c());
#else
  return false;
#endif
}

void divide(DType dtype, void* data, int64_t n, int64_t divisor) {
  [[maybe_unused]] IeeeSubnormals ieee;
#if RINGREDUCE_HAVE_F16C
  if (dtype == DType::Float16 && cpu_kernels.load(std::memory_order_relaxed) && has_f16c())
    return divide_half_f16c(data, n, divisor);
#endif
#if RINGREDUCE_HAVE_AVX512_BF16
  if (dtype == DType::BFloat16 && cpu_kernels.load(std::memory_order_relaxed) &&
      has_avx512_bf16())
    return divide_bfloat16_avx512(data, n, divisor);
#endif
  switch (dtype) {
    case DType::Float16: return divide_any<Half>(data, n, divisor);
    case DType::BFloat16: return divide_any<BFloat16>(data, n, divisor);
    case DType::Float32: return divide_any<float>(data, n, divisor);
    case DType::Float64: return divide_any<double>(data, n, divisor);
    case DType::Complex64: return divide_any<float>(data, 2 * n, divisor);  // each part
    case DType::Complex128: return divide_any<double>(data, 2 * n, divisor);
    default:
      throw std::invalid_argument(
          std::string("divide: integers and bools have no average (dtype ") + dtype_name(dtype) +
          ")");
  }
}

}  // namespace ringreduce
