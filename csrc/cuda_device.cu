// Device (device.h) on a real GPU: three non-blocking streams, a pool of events
// reused call after call, pinned host memory from cudaHostAlloc.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda.h"
#include "device.h"
#include "errors.h"

namespace ringreduce {

namespace {

// Whether this thread has a CUDA context current. The runtime cannot say: cudaGetDevice
// answers 0 on a thread that never used CUDA, and setting GPU 0 "back" there would make
// a context on GPU 0 (CUDA 12), taking its memory in every rank of a node whose ranks
// each use their own GPU. The driver can (cuCtxGetCurrent), and the runtime has loaded
// it by the time we ask; where it cannot be asked, assume a context, as before.
bool thread_has_context() noexcept {
  using GetCurrent = int (*)(void**);  // CUresult cuCtxGetCurrent(CUcontext*)
  static std::atomic<GetCurrent> found{nullptr};  // (kept once found: the driver stays)
  GetCurrent get_current = found.load();
  if (get_current == nullptr) {
    if (void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD)) {
      get_current = reinterpret_cast<GetCurrent>(dlsym(driver, "cuCtxGetCurrent"));
      if (get_current == nullptr || found.exchange(get_current) != nullptr)
        dlclose(driver);  // (one reference is all we keep)
    }
  }
  void* context = nullptr;
  return get_current == nullptr || get_current(&context) != 0 || context != nullptr;
}

// The GPU current on this thread, to give back after a call that sets `ours`; -1 where
// the thread had no CUDA context (it keeps ours after: see thread_has_context()).
int device_to_give_back(int ours) noexcept {
  int current = ours;
  if (cudaGetDevice(&current) != cudaSuccess) current = ours;
  (void)cudaGetLastError();
  return current != ours && !thread_has_context() ? -1 : current;
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, int rank) : ordinal_(ordinal), rank_(rank) {
    begin(nullptr);
    try {
      for (cudaStream_t& s : streams_)
        check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    } catch (...) {
      // No destructor runs after a constructor throws: the streams made so far are ours.
      for (cudaStream_t s : streams_)
        if (s) cudaStreamDestroy(s);
      give_back_device();
      throw;
    }
    give_back_device();
  }
  ~CudaDevice() override {
    // No throwing here; at interpreter exit the driver may already be shutting down.
    // close() may run on any thread, with any GPU current.
    const int previous = make_current();
    for (cudaStream_t s : streams_) cudaStreamSynchronize(s);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaStream_t s : streams_) cudaStreamDestroy(s);
    restore_current(previous);
  }

  const char* name() const override { return "CUDA"; }
  int ordinal() const override { return ordinal_; }

  void begin(void* ready) override {
    // cudaSetDevice is per thread, and calls may come from the async worker thread;
    // end() gives the caller its current device back (see give_back_device()).
    callers_device_ = device_to_give_back(ordinal_);
    if (callers_device_ != ordinal_) check(cudaSetDevice(ordinal_), "cudaSetDevice");
    used_events_ = 0;
    try {
      if (ready)
        for (cudaStream_t s : streams_)
          check(cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(ready), 0),
                "cudaStreamWaitEvent");
    } catch (...) {  // (no end() or abandon() follows a begin() that failed)
      give_back_device();
      throw;
    }
  }

  void end(void* user_stream) override {
    const Event all = record_all();
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(user_stream), events_[all], 0),
          "cudaStreamWaitEvent(caller's stream)");
    check(cudaEventSynchronize(events_[all]), "cudaEventSynchronize");
    if (callers_device_ >= 0 && callers_device_ != ordinal_)
      check(cudaSetDevice(callers_device_), "cudaSetDevice");
  }

  void abandon() override {
    // Our streams never wait on MPI, so this ends; errors are the failed call's own.
    for (cudaStream_t s : streams_) cudaStreamSynchronize(s);
    give_back_device();
  }

  int make_current() noexcept override {
    const int previous = device_to_give_back(ordinal_);
    if (previous != ordinal_) cudaSetDevice(ordinal_);
    (void)cudaGetLastError();
    return previous;
  }
  void restore_current(int previous) noexcept override {
    if (previous >= 0 && previous != ordinal_) cudaSetDevice(previous);
    (void)cudaGetLastError();
  }

  void* alloc_host(int64_t bytes) override {
    void* p = nullptr;
    check_alloc(cudaHostAlloc(&p, bytes > 0 ? bytes : 1, cudaHostAllocPortable), "cudaHostAlloc",
                bytes, "pinned host memory");
    return p;
  }
  // (Errors in freeing, as at exit while CUDA unloads, are not kept as this thread's
  // last error, which a later kernel launch would report as its own.)
  void free_host(void* p) override {
    cudaFreeHost(p);
    (void)cudaGetLastError();
  }
  void* alloc_device(int64_t bytes) override {
    void* p = nullptr;
    check_alloc(cudaMalloc(&p, bytes > 0 ? bytes : 1), "cudaMalloc", bytes, "GPU memory");
    return p;
  }
  void free_device(void* p) override {
    cudaFree(p);
    (void)cudaGetLastError();
  }

  void copy(Stream stream, void* dst, const void* src, int64_t bytes) override {
    if (bytes <= 0 || dst == src) return;
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, streams_[stream]),
          "cudaMemcpyAsync");
  }
  void reduce(Stream stream, DType dtype, Op op, void* dst, const void* a, const void* b,
              int64_t n) override {
    guard([&] { cuda::reduce(dtype, op, dst, a, b, n, streams_[stream]); });
  }
  void divide(Stream stream, DType dtype, void* data, int64_t n, int64_t divisor) override {
    guard([&] { cuda::divide(dtype, data, n, divisor, streams_[stream]); });
  }

  Event record(Stream stream) override {
    const Event e = next_event();
    check(cudaEventRecord(events_[e], streams_[stream]), "cudaEventRecord");
    return e;
  }
  bool done(Event event) override {
    if (event == kNoEvent) return true;
    const cudaError_t rc = cudaEventQuery(events_[event]);
    if (rc == cudaErrorNotReady) {
      // "Not ready" is also left behind as the thread's last error, which the next
      // kernel launch's cudaGetLastError() would report as a failure: clear it.
      (void)cudaGetLastError();
      return false;
    }
    check(rc, "cudaEventQuery");
    return true;
  }
  void wait(Stream stream, Event event) override {
    if (event == kNoEvent) return;
    check(cudaStreamWaitEvent(streams_[stream], events_[event], 0), "cudaStreamWaitEvent");
  }
  void synchronize(Stream stream) override {
    check(cudaStreamSynchronize(streams_[stream]), "cudaStreamSynchronize");
  }

 private:
  // The caller's current GPU back, where begin() changed it; its errors are not the
  // call's. Only where it changed: setting a GPU makes its CUDA context (CUDA 12),
  // and the worker thread's "current GPU" before our first call is GPU 0, whichever
  // GPU the rank uses (the Python side makes the array's GPU current there first).
  void give_back_device() {
    if (callers_device_ >= 0 && callers_device_ != ordinal_) cudaSetDevice(callers_device_);
    (void)cudaGetLastError();
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("ringreduce: " + what + " on rank " + std::to_string(rank_) +
                             " (GPU " + std::to_string(ordinal_) + ")");
  }
  void check(cudaError_t rc, const char* call) const {
    if (rc == cudaSuccess) return;
    // A non-sticky error stays behind as the thread's last error, which the next
    // kernel launch would report as its own failure.
    (void)cudaGetLastError();
    fail(std::string(call) + " failed: " + cudaGetErrorString(rc));
  }
  void check_alloc(cudaError_t rc, const char* call, int64_t bytes, const char* what) const {
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw OutOfMemoryError("ringreduce: " + std::string(call) + " could not get " +
                             std::to_string(bytes) + " bytes of " + what + " on rank " +
                             std::to_string(rank_) + " (GPU " + std::to_string(ordinal_) + ")");
    }
    check(rc, call);
  }
  template <typename F>
  void guard(F&& launch) const {
    try {
      launch();
    } catch (const std::invalid_argument&) {
      throw;
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }
  Event next_event() {
    if (used_events_ == static_cast<int64_t>(events_.size())) {
      cudaEvent_t e;
      check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      events_.push_back(e);
    }
    return used_events_++;
  }
  // One event that completes after everything enqueued on every stream so far.
  Event record_all() {
    join();
    return record(kCompute);
  }

  int ordinal_;
  int rank_;
  int callers_device_ = 0;
  cudaStream_t streams_[kStreams] = {};
  std::vector<cudaEvent_t> events_;  // reused: index < used_events_ is in use this call
  int64_t used_events_ = 0;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int ordinal, int rank) {
  return std::make_unique<CudaDevice>(ordinal, rank);
}

}  // namespace ringreduce
