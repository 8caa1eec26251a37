// Exceptions the core throws. The binding maps each to a Python exception type:
// MismatchError -> ringreduce.MismatchError, MpiError -> ringreduce.MPIError,
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

}  // namespace ringreduce
