// CUDA kernels for every dtype x op, with the element arithmetic of reduce_ops.h (the
// same code the CPU loops run, so a GPU reduction rounds exactly like a CPU one).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda.h"
#include "reduce_ops.h"

namespace ringreduce {
namespace cuda {

namespace {

void check(cudaError_t rc, const char* what) {
  if (rc == cudaSuccess) return;
  (void)cudaGetLastError();  // a non-sticky error must not become the next launch's
  throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(rc));
}

constexpr int kThreads = 256;

// Elements a thread loads together (16 bytes) where the pointers are aligned.
template <typename T>
constexpr int vector_width() { return sizeof(T) >= 16 ? 1 : 16 / static_cast<int>(sizeof(T)); }

// Each thread handles kVector elements loaded together when the three pointers are
// 16-byte aligned (buffers from cudaMalloc and the GPU slots are; a chunk inside a
// buffer is where its segment's offset in bytes is a multiple of 16, which depends on
// the count), one by one otherwise; a grid-stride loop covers any n.
template <typename T, template <typename> class OpT>
__global__ void reduce_kernel(T* dst, const T* a, const T* __restrict__ b, int64_t n,
                              bool aligned) {
  constexpr int kVector = vector_width<T>();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (aligned) {
    struct alignas(16) Pack { T v[kVector]; };
    const int64_t packs = n / kVector;
    for (int64_t p = i; p < packs; p += stride) {
      const Pack x = reinterpret_cast<const Pack*>(a)[p];
      const Pack y = reinterpret_cast<const Pack*>(b)[p];
      Pack z;
#pragma unroll
      for (int k = 0; k < kVector; ++k) z.v[k] = OpT<T>::apply(x.v[k], y.v[k]);
      reinterpret_cast<Pack*>(dst)[p] = z;
    }
    for (int64_t j = packs * kVector + i; j < n; j += stride) dst[j] = OpT<T>::apply(a[j], b[j]);
  } else {
    for (; i < n; i += stride) dst[i] = OpT<T>::apply(a[i], b[i]);
  }
}

template <typename T>
__global__ void divide_kernel(T* data, int64_t n, int64_t divisor) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    data[i] = ops::divide_element(data[i], divisor);
}

int blocks_for(int64_t n) {
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  return static_cast<int>(wanted < 65535 ? (wanted > 0 ? wanted : 1) : 65535);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, template <typename> class OpT>
void launch(void* dst, const void* a, const void* b, int64_t n, cudaStream_t stream) {
  const bool aligned = aligned16(dst) && aligned16(a) && aligned16(b);
  // (A thread per pack of vector_width() where aligned: no more threads than that.)
  const int64_t per_thread = aligned ? vector_width<T>() : 1;
  reduce_kernel<T, OpT><<<blocks_for((n + per_thread - 1) / per_thread), kThreads, 0, stream>>>(
      static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n, aligned);
  check(cudaGetLastError(), "reduce kernel launch");
}

template <typename T>
void launch_op(Op op, void* dst, const void* a, const void* b, int64_t n, cudaStream_t s) {
  switch (op) {
    case Op::Sum: case Op::Avg: return launch<T, ops::SumOp>(dst, a, b, n, s);
    case Op::Prod: return launch<T, ops::ProdOp>(dst, a, b, n, s);
    case Op::Min: return launch<T, ops::MinOp>(dst, a, b, n, s);
    case Op::Max: return launch<T, ops::MaxOp>(dst, a, b, n, s);
  }
  throw std::invalid_argument("reduce kernel: unknown op " + std::to_string(static_cast<int>(op)));
}

template <typename R>
void launch_complex(Op op, void* dst, const void* a, const void* b, int64_t n, cudaStream_t s) {
  if (op == Op::Sum || op == Op::Avg) return launch<ops::Complex<R>, ops::SumOp>(dst, a, b, n, s);
  if (op == Op::Prod) return launch<ops::Complex<R>, ops::ProdOp>(dst, a, b, n, s);
  throw std::invalid_argument("min/max are not defined for complex numbers");
}

template <typename T>
void launch_divide(void* data, int64_t n, int64_t divisor, cudaStream_t s) {
  divide_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(data), n, divisor);
  check(cudaGetLastError(), "divide kernel launch");
}

}  // namespace

bool built() { return true; }

int device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

std::string status() {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    // The static runtime needs a driver at least as new as its own major version (CUDA
    // 13's: r580): both versions say whether an older driver is the trouble.
    int runtime = 0, driver = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);  // (0: no driver installed)
    const auto version = [](int v) {
      return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
    };
    return std::string("no usable GPU: ") + cudaGetErrorString(rc) + " (built with CUDA " +
           version(runtime) + "; driver: " + (driver ? "CUDA " + version(driver) : "none") +
           ")";
  }
  return std::to_string(count) + " GPU(s)";
}

void reduce(DType dtype, Op op, void* dst, const void* a, const void* b, int64_t n,
            void* stream) {
  if (n <= 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::Float16: return launch_op<ops::Half>(op, dst, a, b, n, s);
    case DType::BFloat16: return launch_op<ops::BFloat16>(op, dst, a, b, n, s);
    case DType::Float32: return launch_op<float>(op, dst, a, b, n, s);
    case DType::Float64: return launch_op<double>(op, dst, a, b, n, s);
    case DType::Int8: return launch_op<int8_t>(op, dst, a, b, n, s);
    case DType::Int16: return launch_op<int16_t>(op, dst, a, b, n, s);
    case DType::Int32: return launch_op<int32_t>(op, dst, a, b, n, s);
    case DType::Int64: return launch_op<int64_t>(op, dst, a, b, n, s);
    case DType::UInt8: return launch_op<uint8_t>(op, dst, a, b, n, s);
    case DType::UInt16: return launch_op<uint16_t>(op, dst, a, b, n, s);
    case DType::UInt32: return launch_op<uint32_t>(op, dst, a, b, n, s);
    case DType::UInt64: return launch_op<uint64_t>(op, dst, a, b, n, s);
    case DType::Complex64: return launch_complex<float>(op, dst, a, b, n, s);
    case DType::Complex128: return launch_complex<double>(op, dst, a, b, n, s);
    case DType::Bool: return launch_op<ops::Bool>(op, dst, a, b, n, s);
  }
  throw std::invalid_argument("reduce kernel: unknown dtype " +
                              std::to_string(static_cast<int>(dtype)));
}

void divide(DType dtype, void* data, int64_t n, int64_t divisor, void* stream) {
  if (n <= 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::Float16: return launch_divide<ops::Half>(data, n, divisor, s);
    case DType::BFloat16: return launch_divide<ops::BFloat16>(data, n, divisor, s);
    case DType::Float32: return launch_divide<float>(data, n, divisor, s);
    case DType::Float64: return launch_divide<double>(data, n, divisor, s);
    case DType::Complex64: return launch_divide<float>(data, 2 * n, divisor, s);
    case DType::Complex128: return launch_divide<double>(data, 2 * n, divisor, s);
    default: throw std::invalid_argument("avg is not defined for integers and bools");
  }
}

void synchronize(void* stream) {
  check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

}  // namespace cuda
}  // namespace ringreduce
