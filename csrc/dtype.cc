#include "dtype.h"

namespace ringreduce {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::Int8: case DType::UInt8: case DType::Bool: return 1;
    case DType::Float16: case DType::BFloat16: case DType::Int16: case DType::UInt16: return 2;
    case DType::Float32: case DType::Int32: case DType::UInt32: return 4;
    case DType::Float64: case DType::Int64: case DType::UInt64: case DType::Complex64: return 8;
    case DType::Complex128: return 16;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  static const char* const names[kNumDTypes] = {
      "float16", "bfloat16", "float32", "float64", "int8",   "int16",     "int32",
      "int64",   "uint8",    "uint16",  "uint32",  "uint64", "complex64", "complex128",
      "bool"};
  int code = static_cast<int>(dtype);
  return (code >= 0 && code < kNumDTypes) ? names[code] : "<invalid dtype>";
}

const char* op_name(Op op) {
  static const char* const names[kNumOps] = {"sum", "prod", "min", "max", "avg"};
  int code = static_cast<int>(op);
  return (code >= 0 && code < kNumOps) ? names[code] : "<invalid op>";
}

bool is_valid_dtype(int64_t code) { return code >= 0 && code < kNumDTypes; }
bool is_valid_op(int64_t code) { return code >= 0 && code < kNumOps; }

static bool is_complex(DType d) { return d == DType::Complex64 || d == DType::Complex128; }
static bool is_integer(DType d) {
  return d >= DType::Int8 && d <= DType::UInt64;
}

bool op_supported(DType dtype, Op op) {
  if (is_complex(dtype) && (op == Op::Min || op == Op::Max)) return false;
  if ((is_integer(dtype) || dtype == DType::Bool) && op == Op::Avg) return false;
  return true;
}

}  // namespace ringreduce
