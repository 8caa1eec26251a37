#include "reduce.h"

#include "reduce_ops.h"

namespace ringreduce {

namespace {

using namespace ops;

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

template <typename T>
void divide_loop(void* data_v, int64_t n, int64_t divisor) {
  T* data = static_cast<T*>(data_v);
  for (int64_t i = 0; i < n; ++i) data[i] = divide_element(data[i], divisor);
}

}  // namespace

void reduce(DType dtype, Op op, void* dst, const void* a, const void* b, int64_t n) {
  if (n <= 0) return;
  ReduceFn fn = select_kernel(dtype, op);
  fn(dst, a, b, n);
}

void divide(DType dtype, void* data, int64_t n, int64_t divisor) {
  switch (dtype) {
    case DType::Float16: return divide_loop<Half>(data, n, divisor);
    case DType::BFloat16: return divide_loop<BFloat16>(data, n, divisor);
    case DType::Float32: return divide_loop<float>(data, n, divisor);
    case DType::Float64: return divide_loop<double>(data, n, divisor);
    case DType::Complex64: return divide_loop<float>(data, 2 * n, divisor);  // each part
    case DType::Complex128: return divide_loop<double>(data, 2 * n, divisor);
    default: return;  // integers have no avg; callers check op_supported() first
  }
}

}  // namespace ringreduce
