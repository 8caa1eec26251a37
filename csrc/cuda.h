// The CUDA side of the core: what the build has, what the machine has, and the
// element-wise kernels for device buffers. Plain C++ interface (streams as void*), so
// the rest of the core compiles without CUDA; cuda_stub.cc stands in when the build
// has no CUDA (RINGREDUCE_WITH_CUDA undefined).
#pragma once

#include <cstdint>
#include <string>

#include "dtype.h"

namespace ringreduce {
namespace cuda {

// Whether this extension was compiled with CUDA kernels.
bool built();
// Usable GPUs: 0 without a driver, a device, or a CUDA build. Never throws.
int device_count();
// One line saying why device_count() is what it is (CUDA's own error string).
std::string status();

// dst = a OP b on the device, enqueued on `stream` (a cudaStream_t). Same rules as
// ringreduce::reduce. Throws std::runtime_error with CUDA's error string on failure.
void reduce(DType dtype, Op op, void* dst, const void* a, const void* b, int64_t n,
            void* stream);
// data /= divisor on the device, enqueued on `stream`.
void divide(DType dtype, void* data, int64_t n, int64_t divisor, void* stream);
// Waits for everything enqueued on `stream`.
void synchronize(void* stream);

}  // namespace cuda
}  // namespace ringreduce
