// Exceptions the core throws. The binding maps each to a Python exception type:
// MismatchError -> ringreduce.MismatchError, MpiError -> ringreduce.MPIError,
// OutOfMemoryError -> a MemoryError,
// std::invalid_argument -> ValueError, anything else -> RuntimeError.
#pragma once

#include <stdexcept>
#include <string>

namespace ringreduce {

// Ranks called the same collective with arguments that do not fit together.
struct MismatchError : std::runtime_error {
  using std::runtime_error::runtime_error;
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

// Runs a phase that moves data. An error there may leave messages in flight (and, on
// a GPU, copies), after which the communicator cannot be trusted again: the error's
// text goes into *broken, and every later call raises it.
template <typename F>
void guarded(std::string* broken, F&& body) {
  try {
    body();
  } catch (const MismatchError&) {
    throw;  // raised before anything moved
  } catch (const std::exception& e) {
    *broken = e.what();
    throw;
  }
}

}  // namespace ringreduce
