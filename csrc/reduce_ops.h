// The element-wise arithmetic of every reduction, shared by the CPU loops (reduce.cc)
// and the CUDA kernels (cuda_reduce.cu), so that both round exactly alike and exactly
// like numpy (see reduce.h for the rules).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __CUDACC__
#define RR_HD __host__ __device__
#else
#define RR_HD
#endif

namespace ringreduce {
namespace ops {

RR_HD inline uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

RR_HD inline float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

RR_HD inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Zero or subnormal: the value is mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

RR_HD inline uint16_t float_to_half(float f) {
  // Round to nearest even, as numpy's npy_float_to_half does. The subnormal branch
  // lets the FPU do the rounding: adding 0.5 (2^-1) lines the 10 kept mantissa bits
  // up at the bottom of the float's mantissa.
  uint32_t u = float_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t out;
  if (u >= (143u << 23)) {  // >= 65536: infinity, or NaN
    out = 0x7c00u;
    if (u > 0x7f800000u) {  // NaN: keep the payload's top bits, as numpy does, and stay a
      const uint32_t payload = (u & 0x7fffffu) >> 13;  // NaN if they are all zero
      out = static_cast<uint16_t>(0x7c00u | (payload ? payload : 1u));
    }
  } else if (u < (113u << 23)) {  // below 2^-14: a half subnormal or zero
    const float shifted = bits_float(u) + bits_float(126u << 23);
    out = static_cast<uint16_t>(float_bits(shifted) - (126u << 23));
  } else {
    const uint32_t mantissa_odd = (u >> 13) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mantissa_odd;
    out = static_cast<uint16_t>(u >> 13);  // a carry into the exponent gives infinity
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

RR_HD inline float bfloat16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

RR_HD inline uint16_t float_to_bfloat16(float f) {
  // Round to nearest even, with NaN kept quiet and signed, as ml_dtypes does.
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16 & 0x8000u) | 0x7fc0u);
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}

// Storage types for the two 16-bit floats: distinct types so the templates below pick
// the right widening.
struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };
template <typename R> struct Complex { R re, im; };
// numpy's bool: a byte, nonzero for True. Its ufuncs add as logical or and multiply as
// logical and (False < True for min and max), and write 0 or 1 whatever byte came in.
struct Bool { uint8_t v; };

// How an element is widened for arithmetic and narrowed back.
template <typename T> struct Arith {
  using Compute = T;
  RR_HD static Compute load(T v) { return v; }
  RR_HD static T store(Compute v) { return v; }
};
template <> struct Arith<Half> {
  using Compute = float;
  RR_HD static float load(Half v) { return half_to_float(v.bits); }
  RR_HD static Half store(float v) { return Half{float_to_half(v)}; }
};
template <> struct Arith<BFloat16> {
  using Compute = float;
  RR_HD static float load(BFloat16 v) { return bfloat16_to_float(v.bits); }
  RR_HD static BFloat16 store(float v) { return BFloat16{float_to_bfloat16(v)}; }
};

// Integer arithmetic wraps modulo 2^bits, like numpy. Unsigned arithmetic at least
// as wide as int avoids both signed overflow and promotion of small types to int.
template <typename T>
using WrapType = std::conditional_t<(sizeof(T) <= 4), uint32_t, uint64_t>;

template <typename T>
struct SumOp {
  RR_HD static T apply(T a, T b) {
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
  RR_HD static T apply(T a, T b) {
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
  RR_HD static T apply(T a, T b) {
    using A = Arith<T>;
    const auto x = A::load(a), y = A::load(b);
    return (x <= y || x != x) ? a : b;
  }
};
template <typename T>
struct MaxOp {
  RR_HD static T apply(T a, T b) {
    using A = Arith<T>;
    const auto x = A::load(a), y = A::load(b);
    return (x >= y || x != x) ? a : b;
  }
};

template <typename R>
struct SumOp<Complex<R>> {
  RR_HD static Complex<R> apply(Complex<R> a, Complex<R> b) { return {a.re + b.re, a.im + b.im}; }
};
template <typename R>
struct ProdOp<Complex<R>> {
  RR_HD static Complex<R> apply(Complex<R> a, Complex<R> b) {
    return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re};
  }
};

template <>
struct SumOp<Bool> {
  RR_HD static Bool apply(Bool a, Bool b) { return Bool{static_cast<uint8_t>((a.v | b.v) != 0)}; }
};
template <>
struct MaxOp<Bool> : SumOp<Bool> {};
template <>
struct ProdOp<Bool> {
  RR_HD static Bool apply(Bool a, Bool b) {
    return Bool{static_cast<uint8_t>((a.v != 0) & (b.v != 0))};
  }
};
template <>
struct MinOp<Bool> : ProdOp<Bool> {};

// What a 16-bit float T is divided by, numpy's way: the divisor rounded to T first
// (numpy's weak-scalar rule), then widened.
template <typename T>
RR_HD inline float widened_divisor(int64_t divisor) {
  using A = Arith<T>;
  return A::load(A::store(static_cast<float>(divisor)));
}

// value / divisor, numpy's way: 16-bit floats divide by widened_divisor() and round
// the quotient once.
template <typename T>
RR_HD inline T divide_element(T value, int64_t divisor) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    using A = Arith<T>;
    return A::store(A::load(value) / widened_divisor<T>(divisor));
  } else {
    return value / static_cast<T>(divisor);
  }
}

}  // namespace ops
}  // namespace ringreduce
