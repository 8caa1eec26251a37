// Exceptions the core throws. The binding maps each to a Python exception type:
// MismatchError -> ringreduce.MismatchError, MpiError -> ringreduce.MPIError,
// OutOfMemoryError -> a MemoryError, TimeoutError -> ringreduce.CollectiveTimeoutError,
// std::invalid_argument -> ValueError, anything else (StoppedError too) -> RuntimeError.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ringreduce {

// Ranks called the same collective with arguments that do not fit together. checks:
// where the ranks' call headers met and disagreed, every rank's check, by rank (0: a
// plain call; Python: the error's `checks`), else empty. A caller that lines its calls
// up past the others' reads what call it met there (DistributedOptimizer's agreements:
// whether another rank is in step(), see _LiningUp in optim.py).
struct MismatchError : std::runtime_error {
  explicit MismatchError(const std::string& what, std::vector<int64_t> checks = {})
      : std::runtime_error(what), checks(std::move(checks)) {}
  std::vector<int64_t> checks;
};

// A MismatchError where every rank made an allreduce with a check of one kind (none 0,
// all with the same top byte: the same caller) and none rejected its arguments: every
// rank throws this one alike, so that such callers (allreduce_gradients) can all go on
// together to find out what differs. checks: every rank's check, by rank (Python: the
// error's `checks`), which such a caller may read more from than the message says
// (DistributedOptimizer: which of its settings differ).
struct CheckedCallsMismatch : MismatchError {
  CheckedCallsMismatch(const std::string& what, std::vector<int64_t> checks)
      : MismatchError(what, std::move(checks)) {}
};

// An MPI call failed; the message carries MPI's own error string.
struct MpiError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A rank could not allocate what a collective needs; raised on every rank, before any
// data moved (Python: a MemoryError).
struct OutOfMemoryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A rank waited longer than the communicator's timeout for another rank: one that
// skipped the call, or is stuck elsewhere (Python: ringreduce.CollectiveTimeoutError,
// a TimeoutError). Messages or chunks may be left in flight, so the communicator is
// unusable afterwards. waited_for: the rank whose absence ran the clock out, where the
// wait knows it (a neighbour in the ring, the first rank missing from a shared-memory
// header exchange); the rank passes it on when it gives up, so that a rank that learns
// of that before its own timeout can name the absent rank too.
// vanished: not a timeout, but waited_for's process found ended without a word (see
// ShmChannel::check_alive()). kind: what callers that explain a timeout further tell
// apart by, rather than by the message's words (Python: the error's `_kind`, one of
// kind_name()'s): DistributedOptimizer.step() adds that step() is collective, and must
// be called in one order, where the ranks had not all joined the call.
struct TimeoutError : std::runtime_error {
  enum class Kind : uint8_t {
    kInCall,         // waited on a rank inside the call (the ring, say), or anything else
    kNotJoined,      // some ranks had not joined the call: its header exchange ran out
    kAnotherGaveUp,  // another rank's timeout, which it announced, ended it here
  };
  explicit TimeoutError(const std::string& what, int waited_for = -1, bool vanished = false,
                        Kind kind = Kind::kInCall)
      : std::runtime_error(what), waited_for(waited_for), vanished(vanished), kind(kind) {}
  static const char* kind_name(Kind kind) {
    return kind == Kind::kNotJoined       ? "not joined"
           : kind == Kind::kAnotherGaveUp ? "another gave up"
                                          : "in call";
  }
  int waited_for;
  bool vanished;
  Kind kind;
};

// A call stopped while it waited (StopRequest in waiting.h): another thread of this rank
// asked (RingCommunicator::stop_soon()), or an interrupt (SIGINT) came during it. The
// rank then leaves the communicator, as after any error in a call (Python: RuntimeError,
// or the KeyboardInterrupt of the SIGINT).
struct StoppedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Ranks as messages name them: "rank 3", "ranks 0-2, 5"
inline std::string describe_ranks(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i > 0) out << ", ";
    out << ranks[i];
    if (j > i) out << (j == i + 1 ? ", " : "-") << ranks[j];
    i = j + 1;
  }
  return out.str();
}

}  // namespace ringreduce
