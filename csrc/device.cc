#include "device.h"

#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "errors.h"
#include "reduce.h"

// Open MPI declares its CUDA query in an extension header.
#if defined(OPEN_MPI) && OPEN_MPI && defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#endif

namespace ringreduce {

int64_t host_device_memory_limit = INT64_MAX;
int64_t host_device_copy_fault = 0;
int64_t host_device_stall = 0;
double host_device_stall_s = 0;
int64_t host_device_stall_every = 0;

namespace {

// Streams as queues that run lazily: an operation runs only when something needs it
// done (an event queried or waited for, a stream synchronised, the call's end), and a
// query runs at most one more operation of that stream. So anything the device ring
// reads without first waiting for the right event is still stale here, and the tests
// see it; and "not ready yet" answers drive the ring's polling loop as a busy GPU would.
// Every other call the copy-in stream instead runs as soon as it can, as a GPU's copy
// engine racing ahead of its kernels would: then a buffer refilled too early shows.
void stall_if_asked() {
  if (host_device_stall > 0 && --host_device_stall == 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(host_device_stall_s));
    host_device_stall = host_device_stall_every;
  }
}

class HostDevice final : public Device {
 public:
  const char* name() const override { return "host emulation"; }
  int ordinal() const override { return -1; }
  void begin(void*) override {
    finish_all();
    events_.clear();
    eager_copy_in_ = !eager_copy_in_;
  }
  void end(void*) override { finish_all(); }
  void abandon() override {
    try {
      finish_all();
    } catch (const std::exception&) {  // the failed call's own trouble, already raised
      for (int s = 0; s < kStreams; ++s) {
        queues_[s].clear();
        executed_[s] = enqueued_[s];
      }
    }
  }
  int make_current() noexcept override { return -1; }
  void restore_current(int) noexcept override {}
  void* alloc_host(int64_t bytes) override { return allocate(bytes); }
  void free_host(void* p) override { std::free(p); }
  void* alloc_device(int64_t bytes) override {
    char* p = allocate(bytes);
    own_.push_back({p, bytes});
    return p;
  }
  void free_device(void* p) override {
    for (size_t i = 0; i < own_.size(); ++i) {
      if (own_[i].first == p) {
        own_.erase(own_.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
    std::free(p);
  }
  void copy(Stream s, void* dst, const void* src, int64_t bytes) override {
    if (host_device_copy_fault > 0 && --host_device_copy_fault == 0)
      throw std::runtime_error("ringreduce: the emulated GPU failed a copy, as asked");
    stall_if_asked();
    enqueue(s, [=] {
      if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
    });
  }
  void reduce(Stream s, DType dtype, Op op, void* dst, const void* a, const void* b,
              int64_t n) override {
    for (const void* p : {static_cast<const void*>(dst), a, b}) {
      fault_if_misaligned(dtype, p);
      refuse_if_own_slot_unaligned(p);
    }
    stall_if_asked();
    enqueue(s, [=] { ringreduce::reduce(dtype, op, dst, a, b, n); });
  }
  void divide(Stream s, DType dtype, void* data, int64_t n, int64_t divisor) override {
    fault_if_misaligned(dtype, data);
    enqueue(s, [=] { ringreduce::divide(dtype, data, n, divisor); });
  }
  Event record(Stream s) override {
    events_.push_back({s, enqueued_[s]});
    return static_cast<Event>(events_.size() - 1);
  }
  bool done(Event e) override {
    if (e == kNoEvent) return true;
    const Mark m = events_[e];
    if (executed_[m.stream] < m.position) run_one(m.stream);
    return executed_[m.stream] >= m.position;
  }
  void wait(Stream s, Event e) override {
    if (e == kNoEvent) return;
    const Mark m = events_[e];
    enqueue(s, [this, m] { run_until(m.stream, m.position); });
  }
  void synchronize(Stream s) override { run_until(s, enqueued_[s]); }

 private:
  struct Mark {
    int stream;
    int64_t position;  // operations enqueued on the stream when the event was recorded
  };
  // A GPU's kernels fault on an element at an address that is not a multiple of its
  // alignment (and the fault ends CUDA in the process), where the host's loops read any.
  static void fault_if_misaligned(DType dtype, const void* p) {
    const bool complex = dtype == DType::Complex64 || dtype == DType::Complex128;
    const size_t alignment = dtype_size(dtype) / (complex ? 2 : 1);  // (Complex<R>'s: R's)
    if (reinterpret_cast<uintptr_t>(p) % alignment != 0)
      throw std::runtime_error("ringreduce: the emulated GPU's kernel met a misaligned "
                               "address, as a GPU's would (cudaErrorMisalignedAddress)");
  }
  // The GPU kernels take their 16-byte vector loads only where every address is a
  // multiple of 16, so the device ring lays out its own memory (its slots) that way
  // (device_slot_bytes()). A GPU would only be slower if it did not; here the tests see it.
  void refuse_if_own_slot_unaligned(const void* p) const {
    const char* c = static_cast<const char*>(p);
    for (const auto& [base, bytes] : own_) {
      if (c >= base && c < base + bytes && (c - base) % 16 != 0)
        throw std::logic_error("ringreduce: the emulated GPU's kernel was given an address " +
                               std::to_string(c - base) + " bytes into the device ring's own "
                               "memory, not a multiple of 16: a GPU's would lose its vector "
                               "loads");
    }
  }
  // As cudaMalloc and cudaMallocHost, at a multiple of 256 bytes.
  static char* allocate(int64_t bytes) {
    if (bytes > host_device_memory_limit)
      throw OutOfMemoryError("ringreduce: the emulated GPU has no " + std::to_string(bytes) +
                             " bytes to give (limit " +
                             std::to_string(host_device_memory_limit) + ")");
    const size_t size = (static_cast<size_t>(bytes > 0 ? bytes : 1) + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, size);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<char*>(p);
  }
  void enqueue(int s, std::function<void()> op) {
    queues_[s].push_back(std::move(op));
    ++enqueued_[s];
    if (s == kCopyIn && eager_copy_in_) run_until(s, enqueued_[s]);
  }
  void run_one(int s) {
    std::function<void()> op = std::move(queues_[s].front());
    queues_[s].pop_front();
    ++executed_[s];
    op();
  }
  void run_until(int s, int64_t position) {
    while (executed_[s] < position) run_one(s);
  }
  void finish_all() {
    while (!queues_[0].empty() || !queues_[1].empty() || !queues_[2].empty())
      for (int s = 0; s < kStreams; ++s) run_until(s, enqueued_[s]);
  }

  std::deque<std::function<void()>> queues_[kStreams];
  int64_t enqueued_[kStreams] = {0, 0, 0};
  int64_t executed_[kStreams] = {0, 0, 0};
  std::vector<Mark> events_;
  bool eager_copy_in_ = true;
  std::vector<std::pair<char*, int64_t>> own_;  // alloc_device()'s blocks
};

int env_flag(const char* name) {  // -1 unset, else 0 or 1
  const char* value = std::getenv(name);
  if (!value || !*value) return -1;
  return std::strcmp(value, "0") != 0;
}

// The MPI library's own answer: 1 yes, 0 no, -1 it cannot say.
int library_cuda_support() {
#if defined(MPICH_NUMVERSION) && MPICH_NUMVERSION >= 40100000
  return MPIX_Query_cuda_support() ? 1 : 0;
#elif defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() ? 1 : 0;
#elif defined(OPEN_MPI) && OPEN_MPI
  return 0;  // built without the CUDA extension
#else
  return -1;
#endif
}

// Why library_cuda_support() is 0, in words.
const char* library_says_no() {
#if defined(MPICH_NUMVERSION) && MPICH_NUMVERSION >= 40100000
  return "MPIX_Query_cuda_support() says no";
#elif defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return "MPIX_Query_cuda_support() says no";
#else
  return "this Open MPI's headers have no CUDA support (MPIX_CUDA_AWARE_SUPPORT)";
#endif
}

}  // namespace

std::unique_ptr<Device> make_host_device() { return std::make_unique<HostDevice>(); }

bool mpi_is_cuda_aware() {
  const int forced = env_flag("RINGREDUCE_CUDA_AWARE");
  if (forced >= 0) return forced == 1;
  return library_cuda_support() == 1;
}

std::string mpi_cuda_aware_reason() {
  const int forced = env_flag("RINGREDUCE_CUDA_AWARE");
  if (forced >= 0)
    return std::string("RINGREDUCE_CUDA_AWARE=") + std::getenv("RINGREDUCE_CUDA_AWARE");
  switch (library_cuda_support()) {
    case 1: return "MPIX_Query_cuda_support() says yes";
    case 0: return library_says_no();
    default: return "this MPI has no MPIX_Query_cuda_support(); set RINGREDUCE_CUDA_AWARE=1 "
                    "if it takes device pointers";
  }
}

}  // namespace ringreduce
