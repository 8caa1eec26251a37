#include "ring_schedule.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "copy.h"
#include "reduce.h"
#include "waiting.h"

namespace ringreduce {

std::vector<int> ring_order_by_machine(const std::vector<std::string>& machines) {
  const int size = static_cast<int>(machines.size());
  // Each rank keyed by its machine's lowest rank; a stable sort keeps rank order within.
  std::unordered_map<std::string, int> lowest;
  std::vector<int> key(size), ring(size);
  for (int r = 0; r < size; ++r) key[r] = lowest.emplace(machines[r], r).first->second;
  for (int r = 0; r < size; ++r) ring[r] = r;
  std::stable_sort(ring.begin(), ring.end(), [&](int a, int b) { return key[a] < key[b]; });
  for (int q = 0; q < size; ++q)
    if (ring[q] != q) return ring;
  return {};
}

RingSchedule::RingSchedule(int rank, int size, std::vector<int64_t> segment_counts,
                           int64_t chunk_elems, std::vector<int> ring)
    : rank_(rank), size_(size), position_(rank), ring_(std::move(ring)), chunk_elems_(chunk_elems) {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("RingSchedule: rank " + std::to_string(rank) +
                                " is not in [0, size=" + std::to_string(size) + ")");
  if (!ring_.empty()) {
    std::vector<bool> seen(size, false);
    bool valid = static_cast<int>(ring_.size()) == size;
    for (int q = 0; valid && q < size; ++q) {
      valid = ring_[q] >= 0 && ring_[q] < size && !seen[ring_[q]];
      if (valid) seen[ring_[q]] = true;
      if (valid && ring_[q] == rank) position_ = q;
    }
    if (!valid)
      throw std::invalid_argument("RingSchedule: the ring must hold each of the " +
                                  std::to_string(size) + " ranks once");
  }
  if (static_cast<int>(segment_counts.size()) != size)
    throw std::invalid_argument("RingSchedule: need one segment count per rank");
  if (chunk_elems < 1) throw std::invalid_argument("RingSchedule: chunk_elems must be >= 1");
  offsets_.resize(size + 1);
  offsets_[0] = 0;
  for (int s = 0; s < size; ++s) {
    if (segment_counts[s] < 0) throw std::invalid_argument("RingSchedule: negative segment");
    offsets_[s + 1] = offsets_[s] + segment_counts[s];
  }
}

RingSchedule RingSchedule::split_evenly(int rank, int size, int64_t count, int64_t chunk_elems,
                                        std::vector<int> ring) {
  // np.array_split: the first count % size segments get one element more.
  std::vector<int64_t> counts(size, count / size);
  for (int s = 0; s < count % size; ++s) counts[s] += 1;
  return RingSchedule(rank, size, std::move(counts), chunk_elems, std::move(ring));
}

RingSchedule RingSchedule::with_chunk_elems(int64_t chunk_elems) const {
  if (chunk_elems < 1) throw std::invalid_argument("RingSchedule: chunk_elems must be >= 1");
  RingSchedule copy = *this;
  copy.chunk_elems_ = chunk_elems;
  return copy;
}

int64_t RingSchedule::num_chunks(int s) const {
  return (segment(s).count + chunk_elems_ - 1) / chunk_elems_;
}

Span RingSchedule::chunk(int s, int64_t c) const {
  const Span seg = segment(s);
  const int64_t begin = c * chunk_elems_;
  return {seg.offset + begin, std::min(chunk_elems_, seg.count - begin)};
}

std::vector<ChunkRef> RingSchedule::phase_chunks(Phase phase, bool sending) const {
  std::vector<ChunkRef> chunks;
  for (int k = 0; k < steps_per_phase(); ++k) {
    const int s = sending ? send_segment(phase, k) : recv_segment(phase, k);
    for (int64_t c = 0; c < num_chunks(s); ++c) chunks.push_back({k, s, c});
  }
  return chunks;
}

namespace {

// The engine shared by reduce-scatter and all-gather. Each step sends segment
// send_segment(k) and receives segment recv_segment(k) == send_segment(k+1), chunk by
// chunk. Receives are posted `window` chunks ahead. The chunk received at step k is
// forwarded at step k+1 as soon as `on_received` has finished with it, which
// pipelines the steps; step 0's chunks (our own data) are sent `window` chunks ahead
// of the receives. Every step has its own tag, so interleaving chunks of different
// steps on one link is safe. Why the ring cannot deadlock:
//   1. a chunk received at step k started as a step-0 chunk k+1 ranks to the left, and
//      each rank on the way forwarded it as soon as it arrived there;
//   2. step-0 chunks are a rank's own data: sending them needs nothing received;
//   3. every rank posts its step-0 chunks before it waits on any later step's receive
//      (and `window` ahead of its step-0 receives, below);
// so every chunk's chain of hops starts, and none waits behind a wait that needs it.
template <typename FirstSendPtr, typename RecvPtr, typename OnReceived, typename ForwardPtr>
void run_ring_phase(const RingSchedule& sched, Transport& transport, Phase phase, int tag_base,
                    int window, size_t elem_size, FirstSendPtr first_send_ptr, RecvPtr recv_ptr,
                    OnReceived on_received, ForwardPtr forward_ptr) {
  const int steps = sched.steps_per_phase();
  if (steps == 0) return;

  const std::vector<ChunkRef> recvs = sched.phase_chunks(phase, /*sending=*/false);
  const int64_t num_recvs = static_cast<int64_t>(recvs.size());
  const int first_segment = sched.send_segment(phase, 0);
  const int64_t num_first_sends = sched.num_chunks(first_segment);

  std::vector<Transport::Request> recv_requests(window);
  auto post_recv = [&](int64_t i) {
    if (i >= num_recvs) return;
    const ChunkRef& ref = recvs[i];
    const Span ch = sched.chunk(ref.segment, ref.chunk);
    recv_requests[i % window] = transport.recv_left(
        recv_ptr(i, ch), ch.count * static_cast<int64_t>(elem_size), tag_base + ref.step);
  };
  int64_t first_sends_posted = 0;
  auto post_first_sends_until = [&](int64_t end) {
    end = std::min(end, num_first_sends);
    for (; first_sends_posted < end; ++first_sends_posted) {
      const Span ch = sched.chunk(first_segment, first_sends_posted);
      transport.send_right(first_send_ptr(ch), ch.count * static_cast<int64_t>(elem_size),
                           tag_base);
    }
  };

  for (int64_t i = 0; i < window; ++i) post_recv(i);
  post_first_sends_until(window);
  for (int64_t i = 0; i < num_recvs; ++i) {
    const ChunkRef ref = recvs[i];
    // Our step-0 chunks must be on their way before we wait on later steps, or a
    // right neighbour that receives more step-0 chunks from us than we receive from
    // our left would wait forever.
    post_first_sends_until(ref.step == 0 ? ref.chunk + window + 1 : num_first_sends);
    transport.wait(recv_requests[i % window]);
    const Span ch = sched.chunk(ref.segment, ref.chunk);
    on_received(i, ch);
    post_recv(i + window);
    if (ref.step + 1 < steps)
      transport.send_right(forward_ptr(ch), ch.count * static_cast<int64_t>(elem_size),
                           tag_base + ref.step + 1);
  }
  post_first_sends_until(num_first_sends);
  // Sends read from buffers the next phase overwrites: all must be complete first.
  transport.wait_all();
}

}  // namespace

ReduceTarget::ReduceTarget(const RingSchedule& sched, size_t elem_size, void* out,
                           void* own_out)
    : own_(sched.segment(sched.rank())),
      es_(static_cast<int64_t>(elem_size)),
      out_(static_cast<char*>(out)),
      own_out_(own_out ? static_cast<char*>(own_out) : out_ + own_.offset * es_) {}

void ring_reduce_scatter(const RingSchedule& sched, Transport& transport, DType dtype, Op op,
                         const void* input, void* out, const RecvSlots& slots, void* own_out) {
  ring_reduce_scatter(
      sched, transport, dtype_size(dtype), input, out, slots,
      [&](void* dst, const void* a, const void* b, int64_t n) { reduce(dtype, op, dst, a, b, n); },
      [](void* dst, const void* src, int64_t bytes) { copy_bytes(dst, src, bytes); }, own_out);
}

void ring_reduce_scatter(const RingSchedule& sched, Transport& transport, size_t es,
                         const void* input, void* out, const RecvSlots& slots,
                         const ChunkReducer& reduce_chunk,
                         const std::function<void(void*, const void*, int64_t)>& copy_own,
                         void* own_out) {
  const char* in = static_cast<const char*>(input);
  char* dst = static_cast<char*>(out);
  const ReduceTarget target(sched, es, out, own_out);
  if (sched.size() == 1) {
    if (target.own() != input) copy_own(target.own(), input, sched.total_count() * es);
    return;
  }
  // Every chunk received lands in a slot: one too small would be overrun, silently (a
  // check per call, of what each caller's sizing of its slots must give).
  int64_t largest = 0;
  for (int s = 0; s < sched.size(); ++s) largest = std::max(largest, sched.segment(s).count);
  if (std::min(largest, sched.chunk_elems()) * static_cast<int64_t>(es) > slots.slot_bytes)
    throw std::logic_error("ringreduce internal error: a chunk of " +
                           std::to_string(std::min(largest, sched.chunk_elems()) * es) +
                           " bytes would overrun its scratch slot of " +
                           std::to_string(slots.slot_bytes) + " bytes");
  // Each rank receives every segment but one exactly once, and reduces it with its
  // own input: out = input OP received. So out never needs a copy of input first.
  run_ring_phase(
      sched, transport, Phase::ReduceScatter, /*tag_base=*/0, slots.slots, es,
      [&](Span ch) { return in + ch.offset * es; },
      [&](int64_t i, Span) { return slots.slot(i); },
      [&](int64_t i, Span ch) {
        reduce_chunk(target(ch), in + ch.offset * es, slots.slot(i), ch.count);
      },
      [&](Span ch) { return dst + ch.offset * es; });  // never our own segment
  // The segment we only sent (r-1) is not ours and holds input's bytes in out only
  // when out == input; all-gather overwrites it either way.
}

void ring_allgather(const RingSchedule& sched, Transport& transport, size_t elem_size, void* buf,
                    int window, const void* own_input) {
  char* data = static_cast<char*>(buf);
  const int tag_base = sched.steps_per_phase();  // distinct from reduce-scatter's tags
  const char* own = static_cast<const char*>(own_input);
  const int64_t own_offset = sched.segment(sched.rank()).offset;
  run_ring_phase(
      sched, transport, Phase::AllGather, tag_base, window, elem_size,
      [&](Span ch) {  // (our own segment's chunks)
        return own ? own + (ch.offset - own_offset) * elem_size : data + ch.offset * elem_size;
      },
      [&](int64_t, Span ch) { return data + ch.offset * elem_size; },
      [&](int64_t, Span) {},
      [&](Span ch) { return data + ch.offset * elem_size; });
}

void ring_broadcast(int rank, int size, int root, Transport& transport, void* buf, int64_t bytes,
                    int64_t chunk_bytes, int window, const BroadcastHooks& hooks) {
  if (size == 1 || bytes == 0) return;
  char* data = static_cast<char*>(buf);
  const int position = ((rank - root) % size + size) % size;  // 0 is the root
  const bool receives = position != 0;
  const bool forwards = position != size - 1;
  const int64_t num_chunks = (bytes + chunk_bytes - 1) / chunk_bytes;
  auto chunk_len = [&](int64_t c) { return std::min(chunk_bytes, bytes - c * chunk_bytes); };

  if (!receives) {
    // At most `window` chunks in flight, like everywhere else in the ring.
    std::vector<Transport::Request> sends(window);
    for (int64_t c = 0; c < num_chunks; ++c) {
      if (hooks.ready_to_send) {
        // This rank's own GPU copying the chunk out: no other rank to time out on, but
        // a rank that left, or a stop (Ctrl-C), still ends the wait, and it backs off
        // as every other wait does (ranks may share cores).
        StallTimer never_expires(0);
        int idle = 0;
        while (!hooks.ready_to_send(c)) {
          back_off(&idle);
          never_expires.expired([&] { transport.check_departures(); });
        }
      }
      if (c >= window) transport.wait(sends[c % window]);
      sends[c % window] = transport.send_right(data + c * chunk_bytes, chunk_len(c), 0);
    }
    transport.wait_all();
    return;
  }
  std::vector<Transport::Request> recv_requests(window);
  auto post_recv = [&](int64_t c) {
    if (c < num_chunks)
      recv_requests[c % window] = transport.recv_left(data + c * chunk_bytes, chunk_len(c), 0);
  };
  for (int64_t c = 0; c < window; ++c) post_recv(c);
  for (int64_t c = 0; c < num_chunks; ++c) {
    transport.wait(recv_requests[c % window]);
    post_recv(c + window);
    if (hooks.arrived) hooks.arrived(c);
    if (forwards) transport.send_right(data + c * chunk_bytes, chunk_len(c), 0);
  }
  transport.wait_all();
}

}  // namespace ringreduce
