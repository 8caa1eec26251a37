// What the device ring needs from a GPU, and nothing more: pinned host and device
// memory, three streams, events, asynchronous copies and the reduction kernels.
//
// CudaDevice (cuda_device.cu) is the real one. HostDevice (device.cc) runs the same
// calls on the CPU, where "device" pointers are host pointers, each stream a queue
// that runs only as late as the events allow: it lets the device ring's bookkeeping (which chunk goes through which staging buffer, in which
// order, on which stream) run under real MPI on machines without a GPU. It proves
// nothing about CUDA itself; the GPU tests do that where a GPU is.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dtype.h"

namespace ringreduce {

class Device {
 public:
  // Three streams so that a chunk's host-to-device copy, another chunk's reduction
  // and a third chunk's device-to-host copy run at the same time: two copy engines
  // and the SMs.
  enum Stream : int { kCopyIn = 0, kCompute = 1, kCopyOut = 2 };
  static constexpr int kStreams = 3;
  using Event = int64_t;               // valid until the next begin()
  static constexpr Event kNoEvent = -1;  // "already done"

  virtual ~Device() = default;
  virtual const char* name() const = 0;
  // The GPU this device drives (cudaSetDevice), or -1 for HostDevice.
  virtual int ordinal() const = 0;

  // Starts a call: makes this thread use our GPU, and orders all our streams after
  // `ready`, an event the caller recorded on its own stream (null: nothing to wait for).
  virtual void begin(void* ready) = 0;
  // Ends a call: the caller's stream (null: the legacy default stream) waits for all
  // our work, and so does this thread, so results are ready whichever way they are read.
  virtual void end(void* user_stream) = 0;
  // A call that failed between begin() and end(): wait for the work it enqueued (which
  // may write into the caller's buffers, and those are freed once the call raises),
  // then give the caller its current GPU back. Never throws.
  virtual void abandon() = 0;
  // Outside a call (freeing at close, or on a change of GPU): makes our GPU this
  // thread's current one and returns the one that was, for restore_current() (-1: none
  // to give back, the thread had no context). Freeing with no GPU current would first
  // make a context on GPU 0. Never throw.
  virtual int make_current() noexcept = 0;
  virtual void restore_current(int previous) noexcept = 0;

  virtual void* alloc_host(int64_t bytes) = 0;    // pinned
  virtual void free_host(void* p) = 0;
  virtual void* alloc_device(int64_t bytes) = 0;
  virtual void free_device(void* p) = 0;

  // Enqueued on `stream`; pointers may be host (pinned) or device ones.
  virtual void copy(Stream stream, void* dst, const void* src, int64_t bytes) = 0;
  virtual void reduce(Stream stream, DType dtype, Op op, void* dst, const void* a, const void* b,
                      int64_t n) = 0;
  virtual void divide(Stream stream, DType dtype, void* data, int64_t n, int64_t divisor) = 0;

  virtual Event record(Stream stream) = 0;
  virtual bool done(Event event) = 0;                 // never blocks
  virtual void wait(Stream stream, Event event) = 0;  // the stream waits, not the host
  virtual void synchronize(Stream stream) = 0;        // the host waits
  // Every stream waits for everything enqueued so far on all of them (between phases).
  void join() {
    const Event in = record(kCopyIn), compute = record(kCompute), out = record(kCopyOut);
    for (Stream s : {kCopyIn, kCompute, kCopyOut}) {
      wait(s, in);
      wait(s, compute);
      wait(s, out);
    }
  }
};

// `device`'s GPU current on this thread for a scope (Device::make_current).
class CurrentDevice {
 public:
  explicit CurrentDevice(Device& device) : device_(device), previous_(device.make_current()) {}
  ~CurrentDevice() { device_.restore_current(previous_); }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  Device& device_;
  int previous_;
};

// See the top of this file.
std::unique_ptr<Device> make_host_device();
// HostDevice's allocations larger than this fail (OutOfMemoryError), for tests.
extern int64_t host_device_memory_limit;
// When n > 0: HostDevice's n-th copy from now fails (std::runtime_error), as a copy
// after a faulted kernel does on a GPU; for tests.
extern int64_t host_device_copy_fault;
// When n > 0: HostDevice's n-th copy or kernel from now first sleeps
// host_device_stall_s seconds, as a GPU stuck behind a long kernel would, and then
// every host_device_stall_every-th after it (0: only that one), as a slow GPU; for tests.
extern int64_t host_device_stall;
extern double host_device_stall_s;
extern int64_t host_device_stall_every;
// CUDA on GPU `ordinal`; its errors name `rank`. Throws std::runtime_error when the
// build has no CUDA.
std::unique_ptr<Device> make_cuda_device(int ordinal, int rank);

// A pinned host buffer or a device buffer that grows on demand and is kept: the hot
// path never allocates after the first call of a size.
class DeviceBuffer {
 public:
  enum Kind { kHost, kDevice };
  DeviceBuffer(Device* device, Kind kind) : device_(device), kind_(kind) {}
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  char* get(int64_t bytes) {
    if (bytes > bytes_) {
      release();
      ptr_ = kind_ == kHost ? device_->alloc_host(bytes) : device_->alloc_device(bytes);
      bytes_ = bytes;
    }
    return static_cast<char*>(ptr_);
  }
  void release() {
    if (ptr_) kind_ == kHost ? device_->free_host(ptr_) : device_->free_device(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

 private:
  Device* device_;
  Kind kind_;
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

// Whether MPI takes device pointers: RINGREDUCE_CUDA_AWARE=1 or 0 decides if set,
// else the MPI library's own answer (MPIX_Query_cuda_support, where it has one).
bool mpi_is_cuda_aware();
// One line saying why mpi_is_cuda_aware() is what it is.
std::string mpi_cuda_aware_reason();

}  // namespace ringreduce
