// Stands in for cuda_reduce.cu in builds without CUDA.
#ifndef RINGREDUCE_WITH_CUDA

#include <stdexcept>

#include "cuda.h"
#include "device.h"

namespace ringreduce {
namespace cuda {

namespace {
[[noreturn]] void not_built() {
  throw std::runtime_error("ringreduce was built without CUDA (nvcc was not found, or "
                           "RINGREDUCE_CUDA=0); rebuild with RINGREDUCE_CUDA=1");
}
}  // namespace

bool built() { return false; }
int device_count() { return 0; }
std::string status() { return "built without CUDA"; }
void reduce(DType, Op, void*, const void*, const void*, int64_t, void*) { not_built(); }
void divide(DType, void*, int64_t, int64_t, void*) { not_built(); }
void synchronize(void*) { not_built(); }

}  // namespace cuda

std::unique_ptr<Device> make_cuda_device(int, int) { cuda::not_built(); }

}  // namespace ringreduce

#endif  // RINGREDUCE_WITH_CUDA
