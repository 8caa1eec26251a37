#include "reduce.h"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace ringreduce {

namespace {

template <typename To, typename From>
inline To bits_as(From from) {
  static_assert(sizeof(To) == sizeof(From), "bits_as needs equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

}  // namespace

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_as<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Zero or subnormal: the value is mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return bits_as<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t float_to_half(float f) {
  // Round to nearest even, as numpy's npy_float_to_half does. The subnormal branch
  // lets the FPU do the rounding: adding 0.5 (2^-1) lines the 10 kept mantissa bits
  // up at the bottom of the float's mantissa.
  uint32_t u = bits_as<uint32_t>(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t out;
  if (u >= (143u << 23)) {  // >= 65536: infinity, or NaN (kept quiet)
    out = (u > 0x7f800000u) ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {  // below 2^-14: a half subnormal or zero
    const float denorm_magic = bits_as<float>(126u << 23);
    const float shifted = bits_as<float>(u) + denorm_magic;
    out = static_cast<uint16_t>(bits_as<uint32_t>(shifted) - (126u << 23));
  } else {
    const uint32_t mantissa_odd = (u >> 13) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mantissa_odd;
    out = static_cast<uint16_t>(u >> 13);  // a carry into the exponent gives infinity
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

float bfloat16_to_float(uint16_t h) { return bits_as<float>(static_cast<uint32_t>(h) << 16); }

uint16_t float_to_bfloat16(float f) {
  // Round to nearest even, with NaN kept quiet and signed, as ml_dtypes does.
  const uint32_t u = bits_as<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16 & 0x8000u) | 0x7fc0u);
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}

namespace {

// Storage types for the two 16-bit floats: distinct types so the templates below
// pick the right widening.
struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };
template <typename R> struct Complex { R re, im; };

// How an element is widened for arithmetic and narrowed back.
template <typename T> struct Arith {
  using Compute = T;
  static Compute load(T v) { return v; }
  static T store(Compute v) { return v; }
};
template <> struct Arith<Half> {
  using Compute = float;
  static float load(Half v) { return half_to_float(v.bits); }
  static Half store(float v) { return Half{float_to_half(v)}; }
};
template <> struct Arith<BFloat16> {
  using Compute = float;
  static float load(BFloat16 v) { return bfloat16_to_float(v.bits); }
  static BFloat16 store(float v) { return BFloat16{float_to_bfloat16(v)}; }
};

// Integer arithmetic wraps modulo 2^bits, like numpy. Unsigned arithmetic at least
// as wide as int avoids both signed overflow and promotion of small types to int.
template <typename T>
using WrapType = std::conditional_t<(sizeof(T) <= 4), uint32_t, uint64_t>;

template <typename T>
struct SumOp {
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<WrapType<T>>(a) + static_cast<WrapType<T>>(b));
    } else {
      using A = Arith<T>;
      return A::store(A::load(a) + A::load(b));
    }
  }
};

template <typename T>
struct ProdOp {
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<WrapType<T>>(a) * static_cast<WrapType<T>>(b));
    } else {
      using A = Arith<T>;
      return A::store(A::load(a) * A::load(b));
    }
  }
};

// np.minimum/np.maximum: a NaN in either operand wins, a's first. Returning the
// chosen operand itself (not a re-rounded value) keeps 16-bit floats exact.
template <typename T>
struct MinOp {
  static T apply(T a, T b) {
    using A = Arith<T>;
    const auto x = A::load(a), y = A::load(b);
    return (x <= y || x != x) ? a : b;
  }
};
template <typename T>
struct MaxOp {
  static T apply(T a, T b) {
    using A = Arith<T>;
    const auto x = A::load(a), y = A::load(b);
    return (x >= y || x != x) ? a : b;
  }
};

template <typename R>
struct SumOp<Complex<R>> {
  static Complex<R> apply(Complex<R> a, Complex<R> b) { return {a.re + b.re, a.im + b.im}; }
};
template <typename R>
struct ProdOp<Complex<R>> {
  static Complex<R> apply(Complex<R> a, Complex<R> b) {
    return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re};
  }
};

// One loop per (type, op): simple enough for the compiler to vectorise. Only b is
// restrict-qualified, because dst and a are the same buffer for in-place calls.
template <typename T, template <typename> class OpT>
void reduce_loop(void* dst_v, const void* a_v, const void* __restrict b_v, int64_t n) {
  T* dst = static_cast<T*>(dst_v);
  const T* a = static_cast<const T*>(a_v);
  const T* __restrict b = static_cast<const T*>(b_v);
  for (int64_t i = 0; i < n; ++i) dst[i] = OpT<T>::apply(a[i], b[i]);
}

using ReduceFn = void (*)(void*, const void*, const void*, int64_t);

template <typename T>
constexpr ReduceFn kernel_for(Op op) {
  switch (op) {
    case Op::Sum: case Op::Avg: return &reduce_loop<T, SumOp>;
    case Op::Prod: return &reduce_loop<T, ProdOp>;
    case Op::Min: return &reduce_loop<T, MinOp>;
    case Op::Max: return &reduce_loop<T, MaxOp>;
  }
  return nullptr;
}

template <typename R>
constexpr ReduceFn complex_kernel_for(Op op) {
  switch (op) {
    case Op::Sum: case Op::Avg: return &reduce_loop<Complex<R>, SumOp>;
    case Op::Prod: return &reduce_loop<Complex<R>, ProdOp>;
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
  }
  return nullptr;
}

template <typename T, typename D>
void divide_loop(void* data_v, int64_t n, D divisor) {
  T* data = static_cast<T*>(data_v);
  for (int64_t i = 0; i < n; ++i) data[i] = data[i] / divisor;
}

// 16-bit floats divide like numpy: the divisor is first rounded to the array's
// type (numpy's weak-scalar rule), then both are widened and the quotient rounded.
template <typename T>
void divide_16bit(void* data_v, int64_t n, int64_t divisor) {
  using A = Arith<T>;
  T* data = static_cast<T*>(data_v);
  const float d = A::load(A::store(static_cast<float>(divisor)));
  for (int64_t i = 0; i < n; ++i) data[i] = A::store(A::load(data[i]) / d);
}

}  // namespace

void reduce(DType dtype, Op op, void* dst, const void* a, const void* b, int64_t n) {
  if (n <= 0) return;
  ReduceFn fn = select_kernel(dtype, op);
  fn(dst, a, b, n);
}

void divide(DType dtype, void* data, int64_t n, int64_t divisor) {
  switch (dtype) {
    case DType::Float16: return divide_16bit<Half>(data, n, divisor);
    case DType::BFloat16: return divide_16bit<BFloat16>(data, n, divisor);
    case DType::Float32: return divide_loop<float>(data, n, static_cast<float>(divisor));
    case DType::Float64: return divide_loop<double>(data, n, static_cast<double>(divisor));
    case DType::Complex64: return divide_loop<float>(data, 2 * n, static_cast<float>(divisor));
    case DType::Complex128: return divide_loop<double>(data, 2 * n, static_cast<double>(divisor));
    default: return;  // integers have no avg; callers check op_supported() first
  }
}

}  // namespace ringreduce
