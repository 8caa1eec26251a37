// What the ring needs from a wire: post a send to the right neighbour, post a
// receive from the left neighbour, wait for either. Messages between one pair of
// ranks are matched in the order they were posted, tag by tag (MPI's non-overtaking rule).
#pragma once

#include <cstdint>

namespace ringreduce {

class Transport {
 public:
  using Request = int64_t;  // opaque handle, valid until waited on

  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // A message is at most kMaxMessageBytes: chunks are capped well below 2^31 bytes
  // so every message size fits MPI's int count.
  // The tag tells apart messages of different steps that are in flight together;
  // only messages with the same tag are matched in order.
  virtual Request send_right(const void* buf, int64_t bytes, int tag) = 0;
  virtual Request recv_left(void* buf, int64_t bytes, int tag) = 0;
  virtual void wait(Request request) = 0;
  virtual bool test(Request request) = 0;  // true once complete; never blocks
  virtual void wait_all() = 0;  // every request still pending
  // Throws TimeoutError if another rank has told us it left the communicator (see
  // Departure in waiting.h); for loops that poll with test().
  virtual void check_departures() {}

  static constexpr int64_t kMaxMessageBytes = int64_t{1} << 30;
};

}  // namespace ringreduce
