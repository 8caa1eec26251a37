// The ring schedule: which segment and chunk every rank sends, receives and reduces
// at every step. It knows nothing of MPI; it talks to its neighbours only through a
// Transport, so a test transport (or another wire) plugs in without touching it.
//
// Words (the same in docs/): the buffer is cut into `size` *segments* laid out like
// np.array_split(buffer, size); each segment is cut into *chunks* of at most
// chunk_elems elements, the unit of pipelining. Each rank receives from its *left*
// neighbour (rank - 1) and sends to its *right* neighbour (rank + 1).
//
// That is the ring in rank order, drawn below. Ranks on several machines may go round in
// another order, each machine's ranks side by side (see ring_order_by_machine): then
// "rank r" below reads "the rank at ring position r", and segment s is still rank s's
// block of the buffer, reduced at the position that rank holds.
//
// Reduce-scatter takes size-1 *steps*. At step k rank r sends segment (r-1-k) and
// receives segment (r-2-k), reducing it into its own copy, so that after the last
// step rank r holds segment r fully reduced. With size = 4 (S = segment):
//
//            step 0        step 1        step 2         after reduce-scatter
//   rank 0   send S3 ->    send S2 ->    send S1 ->     owns S0 = x0+x1+x2+x3
//            recv S2 <-    recv S1 <-    recv S0 <-
//   rank 1   send S0 ->    send S3 ->    send S2 ->     owns S1
//   rank 2   send S1 ->    send S0 ->    send S3 ->     owns S2
//   rank 3   send S2 ->    send S1 ->    send S0 ->     owns S3
//
// The chunk sent at step k+1 is the chunk reduced at step k, so chunk c can travel
// on while chunk c+1 is still arriving: that is the pipeline. Segment s always
// starts as rank s+1's data and picks up the other ranks' data in ring order, its
// owner's last: x[s] + (x[s-1] + (... + (x[s+2] + x[s+1]))), ranks mod size. The
// order is fixed by the ring, not by the chunk size, so neither is the result.
//
// All-gather then takes size-1 steps: at step k rank r sends segment (r-k) and
// receives segment (r-1-k), a copy, no arithmetic. Every rank ends with the bytes
// that the segment's owner computed, so the result is bitwise identical everywhere.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtype.h"
#include "transport.h"

namespace ringreduce {

struct Span {
  int64_t offset;  // in elements
  int64_t count;   // in elements
};

enum class Phase { ReduceScatter, AllGather };

// One chunk of one step: chunk `chunk` of segment `segment`, moved at step `step`.
struct ChunkRef {
  int step;
  int segment;
  int64_t chunk;
};

// The order in which ranks go round the ring: ring[q] is the rank at position q. Ranks
// of one machine side by side, machines in the order of their lowest rank, each one's
// ranks in rank order; `machines[r]` names rank r's machine. Every rank computes the same
// from the same names. Rank order itself where that already holds (one machine, or
// ranks placed machine by machine): an empty vector. Why: ranks placed round-robin
// (mpiexec's -f hosts without counts: rank r on host r mod H) would otherwise send
// every chunk of the ring between machines, all of a machine's ranks at once over one
// network link; side by side, only H links of the ring leave a machine.
std::vector<int> ring_order_by_machine(const std::vector<std::string>& machines);

class RingSchedule {
 public:
  // Segments of the given element counts, one per rank, laid out back to back (segment
  // s is rank s's). ring: as ring_order_by_machine returns (empty: rank order).
  RingSchedule(int rank, int size, std::vector<int64_t> segment_counts, int64_t chunk_elems,
               std::vector<int> ring = {});
  // Segments laid out like np.array_split(range(count), size).
  static RingSchedule split_evenly(int rank, int size, int64_t count, int64_t chunk_elems,
                                   std::vector<int> ring = {});

  // The same segments cut into chunks of another size.
  RingSchedule with_chunk_elems(int64_t chunk_elems) const;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Where this rank is on the ring (its rank, in rank order), and who is where.
  int position() const { return position_; }
  int rank_at(int position) const { return ring_.empty() ? wrap(position) : ring_[wrap(position)]; }
  int left() const { return rank_at(position_ - 1); }
  int right() const { return rank_at(position_ + 1); }
  int steps_per_phase() const { return size_ - 1; }
  int64_t chunk_elems() const { return chunk_elems_; }
  int64_t total_count() const { return offsets_.back(); }

  Span segment(int s) const { return {offsets_[s], offsets_[s + 1] - offsets_[s]}; }
  int64_t num_chunks(int s) const;
  Span chunk(int s, int64_t c) const;  // offsets relative to the whole buffer

  // Segment numbers are their owners' ranks, so the segment due at ring position q is
  // rank_at(q) (in rank order, simply r-1-k and r-2-k).
  int reduce_scatter_send_segment(int step) const { return rank_at(position_ - 1 - step); }
  int reduce_scatter_recv_segment(int step) const { return rank_at(position_ - 2 - step); }
  int allgather_send_segment(int step) const { return rank_at(position_ - step); }
  int allgather_recv_segment(int step) const { return rank_at(position_ - 1 - step); }
  int send_segment(Phase phase, int step) const {
    return phase == Phase::ReduceScatter ? reduce_scatter_send_segment(step)
                                         : allgather_send_segment(step);
  }
  int recv_segment(Phase phase, int step) const {
    return phase == Phase::ReduceScatter ? reduce_scatter_recv_segment(step)
                                         : allgather_recv_segment(step);
  }
  // Every chunk this rank sends (or receives) in a phase, step by step, in the order
  // they travel: the left neighbour's sends are exactly our receives, in this order.
  std::vector<ChunkRef> phase_chunks(Phase phase, bool sending) const;

 private:
  int wrap(int s) const { return ((s % size_) + size_) % size_; }

  int rank_;
  int size_;
  int position_;
  std::vector<int> ring_;  // empty: rank order
  int64_t chunk_elems_;
  std::vector<int64_t> offsets_;  // size + 1 entries; segment s is [offsets_[s], offsets_[s+1])
};

// Scratch space for received chunks: `slots` buffers of slot_bytes each (room for the
// largest chunk received). Owned by the caller and reused across calls, so the hot path
// never allocates.
struct RecvSlots {
  void* base;
  int64_t slot_bytes;
  int slots;
  void* slot(int64_t i) const {
    return static_cast<char*>(base) + (i % slots) * slot_bytes;
  }
};

// dst = a OP b for n elements: the CPU loops, or a GPU kernel when the buffers are on
// a GPU and MPI reads device memory itself.
using ChunkReducer = std::function<void(void* dst, const void* a, const void* b, int64_t n)>;

// Reduce-scatter: out[segment r] = OP over all ranks of input[segment r]. Every other
// segment of out but r-1 is overwritten with a partial result; segment r-1, which this
// rank only sends, is left as it was. out may equal input.
// own_out, if given, receives segment r instead of out (the caller's result array,
// which then needs no copy from out); out's segment r is then left as it was too.
void ring_reduce_scatter(const RingSchedule& schedule, Transport& transport, DType dtype, Op op,
                         const void* input, void* out, const RecvSlots& slots,
                         void* own_out = nullptr);
// The same with another reducer and another copy (for device buffers).
void ring_reduce_scatter(const RingSchedule& schedule, Transport& transport, size_t elem_size,
                         const void* input, void* out, const RecvSlots& slots,
                         const ChunkReducer& reduce_chunk,
                         const std::function<void(void*, const void*, int64_t)>& copy_own,
                         void* own_out = nullptr);

// Where a reduce-scatter writes chunk `ch`: into own_out for this rank's own segment
// (when given), else into out.
class ReduceTarget {
 public:
  ReduceTarget(const RingSchedule& sched, size_t elem_size, void* out, void* own_out);
  char* operator()(Span ch) const {
    return ch.offset >= own_.offset && ch.offset < own_.offset + own_.count
               ? own_out_ + (ch.offset - own_.offset) * es_
               : out_ + ch.offset * es_;
  }
  char* own() const { return own_out_; }

 private:
  Span own_;
  int64_t es_;
  char* out_;
  char* own_out_;
};

// All-gather: every rank's segment r of buf is sent around the ring so that all of
// buf ends up equal on every rank. own_input: where this rank's segment is sent from,
// if not from buf (the same bytes).
void ring_allgather(const RingSchedule& schedule, Transport& transport, size_t elem_size,
                    void* buf, int window, const void* own_input = nullptr);

// What a broadcast over staging buffers adds to the chain (all optional).
struct BroadcastHooks {
  // Root: polled until chunk c may be sent.
  std::function<bool(int64_t c)> ready_to_send;
  // The others: chunk c has arrived (it is forwarded right after).
  std::function<void(int64_t c)> arrived;
};

// Broadcast from root: a pipelined chain root -> root+1 -> ... -> root-1, chunk by
// chunk over the whole buffer (rank and root: positions on the ring, which the
// transport's neighbours follow).
void ring_broadcast(int rank, int size, int root, Transport& transport, void* buf,
                    int64_t bytes, int64_t chunk_bytes, int window,
                    const BroadcastHooks& hooks = {});

}  // namespace ringreduce
