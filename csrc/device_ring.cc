// The ring over GPU buffers. The schedule is the same RingSchedule as on the host, with
// the same chunks and tags on the wire, so ranks staging through host memory and ranks
// whose MPI reads device memory can even share a ring. Two ways to move a chunk:
//
// Staged (any MPI). Every chunk has its own place in a pinned host "mirror" of the
// buffer. Reduce-scatter, for each chunk received from the left:
//
//     MPI_Irecv -> mirror   (posted `kWindow` chunks ahead)
//     copy-in stream:  mirror -> device slot                (H2D)
//     compute stream:  out = input OP device slot           (kernel)
//     copy-out stream: out -> mirror, then MPI_Isend right  (D2H), unless last step
//
// Three streams, linked by events, so that chunk i+1's H2D, chunk i's reduction and
// chunk i-1's D2H run at once, while MPI moves other chunks. The host thread never
// blocks on the GPU or on MPI inside a phase: it polls (cudaEventQuery, MPI_Test) and
// posts each send as soon as its bytes are in the mirror, so a slow GPU step cannot stall
// the ring's progress elsewhere. All-gather is the same without the kernel, and a
// received chunk is forwarded straight from the mirror.
//
// Why a mirror and not a few reusable host slots: a place per chunk means no place in
// it is reused within a phase (the next phase starts once this one's copies and
// messages are over), so there is nothing to wait for before receiving into one, and
// the ring keeps the deadlock-freedom argument of the host engine (ring_schedule.cc).
// The price is pinned memory as large as the largest call.
//
// Direct (CUDA-aware MPI): the host engine itself, given device pointers, with a GPU
// kernel as its reducer; each chunk's reduction finishes before MPI forwards it.
#include <algorithm>
#include <deque>
#include <optional>
#include <stdexcept>
#include <string>

#include "errors.h"
#include "reduce.h"
#include "ring_communicator.h"
#include "waiting.h"

namespace ringreduce {

namespace {

// One phase of the ring, staged through `mirror`. Reduce-scatter reads `input`, and
// writes out = input OP received; all-gather sends from and receives into `out`.
void staged_phase(const RingSchedule& sched, Transport& transport, Device& dev, Phase phase,
                  DType dtype, Op op, size_t es, const char* input, char* out, char* mirror,
                  char* dev_slots, int64_t slot_bytes, int slots, int window,
                  double timeout_s) {
  const int steps = sched.steps_per_phase();
  if (steps == 0) return;
  const bool reducing = phase == Phase::ReduceScatter;
  const int tag_base = reducing ? 0 : steps;  // as the host engine: ranks may mix the two
  const std::vector<ChunkRef> recvs = sched.phase_chunks(phase, /*sending=*/false);
  const int64_t num_recvs = static_cast<int64_t>(recvs.size());

  struct PendingSend {
    Span chunk;
    int tag;
    Device::Event ready;  // the chunk's bytes are in the mirror once this completes
  };
  std::deque<PendingSend> sends;  // posted to MPI strictly in this order
  auto bytes_of = [&](Span ch) { return ch.count * static_cast<int64_t>(es); };
  auto at = [&](Span ch) { return ch.offset * static_cast<int64_t>(es); };

  // Step 0 sends our own data: each chunk goes as soon as its copy out has landed.
  // The copies are enqueued a few chunks ahead of the sends, not all at once: a call
  // of thousands of chunks would otherwise fill CUDA's launch queue (blocking this
  // thread) before the first receive is posted.
  const char* first_source = reducing ? input : out;
  const int first_segment = sched.send_segment(phase, 0);
  const int64_t num_first = sched.num_chunks(first_segment);
  int64_t first_enqueued = 0, first_sent = 0;
  auto enqueue_first_sends = [&] {
    for (; first_enqueued < num_first && first_enqueued < first_sent + 2 * window;
         ++first_enqueued) {
      const Span ch = sched.chunk(first_segment, first_enqueued);
      dev.copy(Device::kCopyOut, mirror + at(ch), first_source + at(ch), bytes_of(ch));
      sends.push_back({ch, tag_base, dev.record(Device::kCopyOut)});
    }
  };
  enqueue_first_sends();

  std::vector<Transport::Request> recv_requests(window);
  auto post_recv = [&](int64_t i) {
    if (i >= num_recvs) return;
    const ChunkRef& ref = recvs[i];
    const Span ch = sched.chunk(ref.segment, ref.chunk);
    recv_requests[i % window] =
        transport.recv_left(mirror + at(ch), bytes_of(ch), tag_base + ref.step);
  };
  for (int64_t i = 0; i < window; ++i) post_recv(i);

  // The reduction that last read each device slot: a slot is refilled after it.
  std::vector<Device::Event> slot_free(slots, Device::kNoEvent);
  int64_t next = 0;  // the next chunk to arrive, in arrival order
  StallTimer timer(timeout_s);  // only receiving depends on another rank
  int idle = 0;
  while (next < num_recvs || !sends.empty() || first_enqueued < num_first) {
    while (!sends.empty() && dev.done(sends.front().ready)) {
      const PendingSend& s = sends.front();
      transport.send_right(mirror + at(s.chunk), bytes_of(s.chunk), s.tag);
      if (s.tag == tag_base) ++first_sent;
      sends.pop_front();
      idle = 0;
    }
    enqueue_first_sends();
    if (next >= num_recvs) {  // only copies out left, which the GPU finishes on its own
      back_off(&idle);
      continue;
    }
    if (!transport.test(recv_requests[next % window])) {
      if (timer.expired([&] { transport.check_departures(); }))
        throw neighbour_timeout(timeout_s, sched.left(), true);
      back_off(&idle);
      continue;
    }
    timer.progressed();
    idle = 0;

    const ChunkRef ref = recvs[next];
    const Span ch = sched.chunk(ref.segment, ref.chunk);
    const bool forward = ref.step + 1 < steps;
    if (reducing) {
      char* slot = dev_slots + (next % slots) * slot_bytes;
      dev.wait(Device::kCopyIn, slot_free[next % slots]);
      dev.copy(Device::kCopyIn, slot, mirror + at(ch), bytes_of(ch));
      dev.wait(Device::kCompute, dev.record(Device::kCopyIn));
      dev.reduce(Device::kCompute, dtype, op, out + at(ch), input + at(ch), slot, ch.count);
      const Device::Event reduced = dev.record(Device::kCompute);
      slot_free[next % slots] = reduced;
      if (forward) {
        // The D2H overwrites the received bytes in the mirror, after the H2D read them
        // (the reduction waited for the H2D, and this copy waits for the reduction).
        dev.wait(Device::kCopyOut, reduced);
        dev.copy(Device::kCopyOut, mirror + at(ch), out + at(ch), bytes_of(ch));
        sends.push_back({ch, tag_base + ref.step + 1, dev.record(Device::kCopyOut)});
      }
    } else {
      dev.copy(Device::kCopyIn, out + at(ch), mirror + at(ch), bytes_of(ch));
      // The H2D and MPI only read the mirror here, so both may run at once.
      if (forward) sends.push_back({ch, tag_base + ref.step + 1, Device::kNoEvent});
    }
    post_recv(next + window);
    ++next;
  }
  // The next phase receives into the mirror (MPI writes it, not a stream: the copies
  // reading it must be finished, not just ordered) and reads what this one wrote.
  transport.wait_all();
  dev.join();
  dev.synchronize(Device::kCompute);
}

// Broadcast along the chain root -> root+1 -> ..., staged chunk by chunk through the
// mirror, with the host chain itself (so direct ranks can take part): the root sends
// each chunk once its copy out has landed, the others copy each chunk in as it arrives
// and forward it straight from the mirror.
void staged_broadcast(int rank, int size, int root, Transport& transport, Device& dev, char* buf,
                      char* mirror, int64_t bytes, int64_t chunk_bytes, int window) {
  const int64_t num_chunks = bytes > 0 ? (bytes + chunk_bytes - 1) / chunk_bytes : 0;
  auto length = [&](int64_t c) { return std::min(chunk_bytes, bytes - c * chunk_bytes); };
  std::vector<Device::Event> landed(rank == root ? num_chunks : 0, Device::kNoEvent);
  int64_t copied = 0;
  BroadcastHooks hooks;
  hooks.ready_to_send = [&](int64_t c) {  // root: copies out run a few chunks ahead
    for (; copied < num_chunks && copied <= c + 2 * window; ++copied) {
      dev.copy(Device::kCopyOut, mirror + copied * chunk_bytes, buf + copied * chunk_bytes,
               length(copied));
      landed[copied] = dev.record(Device::kCopyOut);
    }
    return dev.done(landed[c]);
  };
  hooks.arrived = [&](int64_t c) {  // the copy in only reads the mirror, as the forward does
    dev.copy(Device::kCopyIn, buf + c * chunk_bytes, mirror + c * chunk_bytes, length(c));
  };
  ring_broadcast(rank, size, root, transport, mirror, bytes, chunk_bytes, window, hooks);
}

// A GPU slot holds one received chunk, and no chunk is larger than the first segment
// (see recv_slots()); 16-byte multiples keep the kernels' vector loads aligned.
int64_t device_slot_bytes(int64_t chunk_elems, int64_t first_segment_elems, size_t es) {
  const int64_t elems = std::min(chunk_elems, first_segment_elems);
  return std::max<int64_t>(16, (elems * static_cast<int64_t>(es) + 15) / 16 * 16);
}

// Between begin() and end() of a device call: if the call fails in between, the
// caller's thread gets its current GPU back.
class DeviceCallScope {
 public:
  explicit DeviceCallScope(Device& dev) : dev_(dev) {}
  ~DeviceCallScope() {
    if (!ended_) dev_.abandon();
  }
  DeviceCallScope(const DeviceCallScope&) = delete;
  DeviceCallScope& operator=(const DeviceCallScope&) = delete;
  void end(void* user_stream) {
    dev_.end(user_stream);
    ended_ = true;
  }

 private:
  Device& dev_;
  bool ended_ = false;
};

}  // namespace

Device& RingCommunicator::begin_device_call(DeviceCall& call, Collective collective,
                                            int64_t chunk_bytes, int64_t mirror_bytes,
                                            int64_t scratch_bytes) {
  Device* begun = nullptr;
  try {
    Device& dev = device(call.emulate, call.ordinal, collective_name(collective));
    dev.begin(call.ready);
    begun = &dev;
    if (mirror_bytes > 0) host_mirror_->get(mirror_bytes);
    if (scratch_bytes > 0) device_scratch_->get(scratch_bytes);
    call.device = &dev;
    return dev;
  } catch (const std::exception&) {
    if (begun) begun->abandon();
    if (closed_ || !broken_.empty()) throw;
    announce_invalid(collective, chunk_bytes, kDeviceMemory, CallHeader::kFailed);
    throw;
  }
}

int64_t RingCommunicator::device_scratch_bytes(int64_t count, size_t es,
                                               int64_t chunk_bytes) const {
  if (size() == 1) return 0;
  return kDeviceScratchSlots * device_slot_bytes(chunk_elems(chunk_bytes, es),
                                                 segment_of(0, size(), count).count, es);
}

RingSchedule RingCommunicator::device_reduce_scatter_call(DeviceCall& call, Collective collective,
                                                          const void* input, void* out,
                                                          int64_t count, DType dtype, Op op,
                                                          int64_t chunk_bytes, int64_t check) {
  Device& dev = *call.device;
  const size_t es = dtype_size(dtype);
  const CallHeader h =
      make_header(collective, dtype, op, count, chunk_bytes, kDeviceMemory, check);
  const int64_t elems = chunk_elems(agree(h), es);
  grow_device_scratch(collective, es, count);
  RingSchedule sched = RingSchedule::split_evenly(rank(), size(), count, elems, ring_);
  guarded(collective_name(collective), [&] {
    run_device_reduce_scatter(call, sched, dtype, op, input, out);
    const Span mine = sched.segment(rank());
    if (op == Op::Avg && size() > 1)
      dev.divide(Device::kCompute, dtype, static_cast<char*>(out) + mine.offset * es,
                 mine.count, size());
  });
  return sched;
}

void RingCommunicator::grow_device_scratch(Collective collective, size_t es, int64_t count) {
  if (size() == 1) return;
  bool someone_grows = false;
  for (const CallHeader& h : headers_)
    someone_grows |= h.chunk_bytes < headers_[0].chunk_bytes;
  if (!someone_grows) return;  // every rank reserved at least what rank 0's size needs
  const int64_t needed = device_scratch_bytes(count, es, headers_[0].chunk_bytes);
  bool ok = true;
  try {
    device_scratch_->get(needed);
  } catch (const std::exception&) {
    ok = false;
  }
  confirm_everywhere(ok, collective_name(collective),
                     std::to_string(needed) + " bytes of GPU scratch");
}

void RingCommunicator::reserve_staging(const DeviceCall& call, int64_t bytes) {
  Device& dev = device(call.emulate, call.ordinal);  // makes host_mirror_ too
  // Outside a call (no begin()), maybe on a thread whose current GPU is another, with
  // no CUDA context there: cudaHostAlloc (and the cudaFreeHost of a smaller buffer)
  // would make one on that GPU.
  const CurrentDevice ours(dev);
  if (!call.direct && size() > 1) host_mirror_->get(bytes);
}

Device& RingCommunicator::device(bool emulate, int ordinal, const char* collective) {
  check_usable(collective);
  const int wanted = emulate ? -1 : ordinal;
  if (!device_ || device_->ordinal() != wanted) {
    release_device();
    device_ = emulate ? make_host_device() : make_cuda_device(ordinal, rank());
    host_mirror_ = std::make_unique<DeviceBuffer>(device_.get(), DeviceBuffer::kHost);
    device_scratch_ = std::make_unique<DeviceBuffer>(device_.get(), DeviceBuffer::kDevice);
  }
  return *device_;
}

void RingCommunicator::release_device() {
  if (!device_) return;  // (the buffers come with it)
  {
    // close() may run on any thread: free with our GPU current (no context made on
    // GPU 0), and give the thread its own back before ~CudaDevice, which does the same.
    const CurrentDevice ours(*device_);
    host_mirror_.reset();
    device_scratch_.reset();
  }
  device_.reset();
}

void RingCommunicator::run_device_reduce_scatter(const DeviceCall& call,
                                                 const RingSchedule& sched, DType dtype, Op op,
                                                 const void* input, void* out) {
  Device& dev = *call.device;
  const size_t es = dtype_size(dtype);
  count_ring_steps(sched.steps_per_phase());
  if (sched.size() == 1) {
    dev.copy(Device::kCompute, out, input, sched.total_count() * static_cast<int64_t>(es));
    return;
  }
  const int64_t slot_bytes = device_slot_bytes(sched.chunk_elems(), sched.segment(0).count, es);
  char* scratch = device_scratch_->get(slot_bytes * kDeviceScratchSlots);
  if (call.direct) {
    dev.synchronize(Device::kCompute);  // MPI reads the input as soon as it is given it
    ring_reduce_scatter(
        sched, *transport_, es, input, out, RecvSlots{scratch, slot_bytes, kWindow},
        [&](void* dst, const void* a, const void* b, int64_t n) {
          dev.reduce(Device::kCompute, dtype, op, dst, a, b, n);
          dev.synchronize(Device::kCompute);  // forwarded by MPI right after this
        },
        [&](void* dst, const void* src, int64_t bytes) {
          dev.copy(Device::kCompute, dst, src, bytes);
        });
    return;
  }
  char* mirror = host_mirror_->get(sched.total_count() * static_cast<int64_t>(es));
  staged_phase(sched, *transport_, dev, Phase::ReduceScatter, dtype, op, es,
               static_cast<const char*>(input), static_cast<char*>(out), mirror, scratch,
               slot_bytes, kDeviceSlots, kWindow, timeout());
}

void RingCommunicator::run_device_allgather(const DeviceCall& call, const RingSchedule& sched,
                                            size_t es, void* buf) {
  Device& dev = *call.device;
  count_ring_steps(sched.steps_per_phase());
  if (sched.size() == 1) return;
  const RingSchedule copying = copy_schedule(sched, es);  // as the host ring's
  if (call.direct) {
    dev.join();
    dev.synchronize(Device::kCompute);
    ring_allgather(copying, *transport_, es, buf, kWindow);
    return;
  }
  char* mirror = host_mirror_->get(sched.total_count() * static_cast<int64_t>(es));
  staged_phase(copying, *transport_, dev, Phase::AllGather, DType::UInt8, Op::Sum, es, nullptr,
               static_cast<char*>(buf), mirror, nullptr, 0, 0, kWindow, timeout());
}

char* RingCommunicator::stage_on_host(const DeviceCall& call, Collective collective,
                                      int64_t chunk_bytes, const void* input, int64_t bytes,
                                      int64_t staging_bytes) {
  char* staging = nullptr;
  try {
    staging = host_mirror_->get(staging_bytes);
    if (input) {
      call.device->copy(Device::kCopyOut, staging, input, bytes);
      call.device->synchronize(Device::kCopyOut);  // may report an earlier kernel's fault
    }
  } catch (const std::exception&) {
    announce_invalid(collective, chunk_bytes, kDeviceMemory, CallHeader::kFailed);
    throw;
  }
  ++device_calls_on_host_;
  return staging;
}

void RingCommunicator::allreduce_device(DeviceCall call, const void* input, void* out,
                                        int64_t count, DType dtype, Op op,
                                        int64_t chunk_bytes, int64_t check) {
  const size_t es = dtype_size(dtype);
  const int64_t bytes = count * static_cast<int64_t>(es);
  const bool on_host = device_call_on_host(bytes);
  const bool ring = size() > 1 && !on_host;
  const int64_t mirror = on_host ? 2 * bytes : (ring && !call.direct ? bytes : 0);
  const int64_t scratch = ring ? device_scratch_bytes(count, es, chunk_bytes) : 0;
  Device& dev = begin_device_call(call, Collective::AllReduce, chunk_bytes, mirror, scratch);
  DeviceCallScope scope(dev);
  if (on_host) {  // one trip to the host and back, with the bits the device ring gives
    char* staging =
        stage_on_host(call, Collective::AllReduce, chunk_bytes, input, bytes, 2 * bytes);
    allreduce_host(make_header(Collective::AllReduce, dtype, op, count, chunk_bytes,
                               kDeviceMemory, check),
                   staging, staging + bytes);
    dev.copy(Device::kCopyIn, out, staging + bytes, bytes);
  } else {
    const RingSchedule sched = device_reduce_scatter_call(
        call, Collective::AllReduce, input, out, count, dtype, op, chunk_bytes, check);
    guarded("allreduce", [&] {
      dev.join();
      run_device_allgather(call, sched, es, out);
    });
  }
  scope.end(call.user_stream);
}

void RingCommunicator::reduce_scatter_device(DeviceCall call, const void* input, void* work,
                                             int64_t count, DType dtype, Op op,
                                             int64_t chunk_bytes) {
  const size_t es = dtype_size(dtype);
  const int64_t bytes = count * static_cast<int64_t>(es);
  const bool on_host = device_call_on_host(bytes);
  const int64_t mirror = on_host ? 2 * bytes : (size() > 1 && !call.direct ? bytes : 0);
  Device& dev = begin_device_call(call, Collective::ReduceScatter, chunk_bytes, mirror,
                                  on_host ? 0 : device_scratch_bytes(count, es, chunk_bytes));
  DeviceCallScope scope(dev);
  if (on_host) {  // as allreduce_device(); only this rank's segment comes back
    char* staging =
        stage_on_host(call, Collective::ReduceScatter, chunk_bytes, input, bytes, 2 * bytes);
    CallHeader h =
        make_header(Collective::ReduceScatter, dtype, op, count, chunk_bytes, kDeviceMemory);
    reduce_scatter_host(h, staging, staging + bytes, nullptr);
    const Span mine = segment_of(rank(), size(), count);
    const int64_t offset = mine.offset * static_cast<int64_t>(es);
    dev.copy(Device::kCopyIn, static_cast<char*>(work) + offset, staging + bytes + offset,
             mine.count * static_cast<int64_t>(es));
  } else {
    device_reduce_scatter_call(call, Collective::ReduceScatter, input, work, count, dtype, op,
                               chunk_bytes);
  }
  scope.end(call.user_stream);
}

void RingCommunicator::allgather_device(DeviceCall call, const void* input, void* out,
                                        const std::vector<int64_t>& row_counts,
                                        int64_t row_elems, DType dtype, bool out_ready) {
  check_usable("allgather");
  if (static_cast<int>(row_counts.size()) != size())
    throw std::invalid_argument("allgather: need one row count per rank");
  const size_t es = dtype_size(dtype);
  std::vector<int64_t> counts(size());
  int64_t total = 0;
  for (int r = 0; r < size(); ++r) total += counts[r] = row_counts[r] * row_elems;
  const RingSchedule sched(rank(), size(), counts,
                           chunk_elems(pending_allgather_chunk_bytes_, es), ring_);
  // Every rank knows the total, and the limit that the counts' header exchange agreed
  // on, so all take the same path.
  const int64_t total_bytes = total * static_cast<int64_t>(es);
  const bool on_host = device_call_on_host(total_bytes, pending_allgather_host_limit_);
  const Span mine = sched.segment(rank());
  const int64_t my_offset = mine.offset * static_cast<int64_t>(es);
  // The other ranks are past the header exchange: from here until every rank has
  // confirmed, a failure must be reported to them, not just raised here.
  bool ok = out_ready;
  Device* dev = nullptr;
  std::optional<DeviceCallScope> scope;  // from begin() on, whatever throws
  char* staging = nullptr;
  if (ok) {
    try {
      Device& begun = device(call.emulate, call.ordinal);
      begun.begin(call.ready);  // (one that fails gives everything back itself)
      dev = &begun;
      scope.emplace(begun);
      call.device = dev;
      // On the copy-out stream, which the first sends' D2H copies then follow.
      if (on_host) {  // this rank's rows to the host; the host ring; all rows back
        staging = host_mirror_->get(total_bytes);
        dev->copy(Device::kCopyOut, staging + my_offset, input,
                  mine.count * static_cast<int64_t>(es));
        dev->synchronize(Device::kCopyOut);
        ++device_calls_on_host_;
      } else {
        dev->copy(Device::kCopyOut, static_cast<char*>(out) + my_offset, input,
                  mine.count * static_cast<int64_t>(es));
      }
    } catch (const std::exception&) {
      if (dev && !scope) dev->abandon();
      ok = false;
    }
  }
  confirm_everywhere(ok, "allgather",
                     "the " + std::to_string(total_bytes) +
                         "-byte GPU result (or staging for it, or the copy into that)");
  if (on_host) {
    allgather(staging + my_offset, staging, row_counts, row_elems, dtype);
    dev->copy(Device::kCopyIn, out, staging, total_bytes);
  } else {
    guarded("allgather", [&] { run_device_allgather(call, sched, es, out); });
  }
  scope->end(call.user_stream);
}

void RingCommunicator::broadcast_device(DeviceCall call, void* buf, int64_t count,
                                        DType dtype, int root, int64_t chunk_bytes) {
  check_root(root);
  const size_t es = dtype_size(dtype);
  const int64_t bytes = count * static_cast<int64_t>(es);
  const bool on_host = device_call_on_host(bytes);
  const int64_t staged = on_host || !(call.direct || size() == 1) ? bytes : 0;
  Device& dev = begin_device_call(call, Collective::Broadcast, chunk_bytes, staged, 0);
  DeviceCallScope scope(dev);
  CallHeader h =
      make_header(Collective::Broadcast, dtype, Op::Sum, count, chunk_bytes, kDeviceMemory);
  h.extra = root;
  if (on_host) {  // root's bytes to the host, the host broadcast, the others' back
    const bool root_here = rank() == root;
    char* staging = stage_on_host(call, Collective::Broadcast, chunk_bytes,
                                  root_here ? buf : nullptr, bytes, bytes);
    broadcast_host(h, staging);
    if (!root_here) dev.copy(Device::kCopyIn, buf, staging, bytes);
    scope.end(call.user_stream);
    return;
  }
  const int64_t chunk =
      copy_chunk_elems(chunk_elems(agree(h), es), es) * static_cast<int64_t>(es);
  guarded("broadcast", [&] {
    if (size() == 1) return;
    if (call.direct) {
      dev.synchronize(Device::kCompute);
      ring_broadcast(ring_position(rank()), size(), ring_position(root), *transport_, buf,
                     bytes, chunk, kWindow);
      return;
    }
    staged_broadcast(ring_position(rank()), size(), ring_position(root), *transport_, dev,
                     static_cast<char*>(buf),
                     host_mirror_->get(bytes), bytes, chunk, kWindow);
  });
  scope.end(call.user_stream);
}

}  // namespace ringreduce
