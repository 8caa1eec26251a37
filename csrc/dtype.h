// Element types and reduction operations the core understands.
//
// The numeric codes are part of the wire header that ranks exchange before every
// collective (CallHeader in ring_communicator.h), so they never change meaning: add new
// entries at the end only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ringreduce {

enum class DType : int32_t {
  Float16 = 0,
  BFloat16 = 1,
  Float32 = 2,
  Float64 = 3,
  Int8 = 4,
  Int16 = 5,
  Int32 = 6,
  Int64 = 7,
  UInt8 = 8,
  UInt16 = 9,
  UInt32 = 10,
  UInt64 = 11,
  Complex64 = 12,
  Complex128 = 13,
  Bool = 14,  // one byte, 0 or 1: sum and max are logical or, prod and min logical and
};
constexpr int kNumDTypes = 15;

enum class Op : int32_t {
  Sum = 0,
  Prod = 1,
  Min = 2,
  Max = 3,
  Avg = 4,  // a sum in the ring, divided by the number of ranks once at the end
};
constexpr int kNumOps = 5;

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
const char* op_name(Op op);
bool is_valid_dtype(int64_t code);
bool is_valid_op(int64_t code);

// Complex numbers have no order (no min/max); integers and bools have no exact average.
bool op_supported(DType dtype, Op op);

}  // namespace ringreduce
