#include "mpi_transport.h"

#include <string>

#include "errors.h"

namespace ringreduce {

void check_mpi(int rc, const char* call, int rank) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  const std::string where = rank >= 0 ? "on rank " + std::to_string(rank) : "(rank not yet known)";
  throw MpiError(std::string(call) + " failed " + where + ": " +
                 (len > 0 ? std::string(text, len) : "error code " + std::to_string(rc)));
}

MpiTransport::MpiTransport(MPI_Comm user_comm) {
  int initialized = 0, finalized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized", -1);
  check_mpi(MPI_Finalized(&finalized), "MPI_Finalized", -1);
  if (!initialized || finalized)
    throw MpiError("MPI is not initialised (or already finalised): import mpi4py.MPI first");
  if (user_comm == MPI_COMM_NULL) throw std::invalid_argument("comm is MPI.COMM_NULL");
  int is_inter = 0;
  check_mpi(MPI_Comm_test_inter(user_comm, &is_inter), "MPI_Comm_test_inter", -1);
  if (is_inter) throw std::invalid_argument("comm is an intercommunicator; use an intracommunicator");
  check_mpi(MPI_Comm_dup(user_comm, &comm_), "MPI_Comm_dup", -1);
  // Errors come back as return codes, which we turn into exceptions with MPI's text,
  // rather than aborting the job from inside MPI.
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", -1);
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank", -1);
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  int* tag_ub = nullptr;
  int found = 0;
  check(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &found), "MPI_Comm_get_attr(MPI_TAG_UB)");
  if (found && tag_ub) tag_ub_ = *tag_ub;
  check(MPI_Comm_set_name(comm_, "ringreduce"), "MPI_Comm_set_name");
}

MpiTransport::~MpiTransport() {
  // A destructor cannot report errors; after MPI_Finalize the handle is gone anyway.
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiTransport::free() {
  if (comm_ != MPI_COMM_NULL) check(MPI_Comm_free(&comm_), "MPI_Comm_free");
}

Transport::Request MpiTransport::send_right(const void* buf, int64_t bytes, int tag) {
  bytes_sent_ += bytes;
  requests_.push_back(MPI_REQUEST_NULL);
  check(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, (rank_ + 1) % size_, wrap_tag(tag),
                  comm_, &requests_.back()),
        "MPI_Isend");
  return static_cast<Request>(requests_.size() - 1);
}

Transport::Request MpiTransport::recv_left(void* buf, int64_t bytes, int tag) {
  requests_.push_back(MPI_REQUEST_NULL);
  check(MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, (rank_ + size_ - 1) % size_,
                  wrap_tag(tag), comm_, &requests_.back()),
        "MPI_Irecv");
  return static_cast<Request>(requests_.size() - 1);
}

void MpiTransport::wait(Request request) {
  check(MPI_Wait(&requests_[request], MPI_STATUS_IGNORE), "MPI_Wait");
}

bool MpiTransport::test(Request request) {
  int flag = 0;
  check(MPI_Test(&requests_[request], &flag, MPI_STATUS_IGNORE), "MPI_Test");
  return flag != 0;
}

void MpiTransport::wait_all() {
  if (requests_.empty()) return;
  const int rc = MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(),
                             MPI_STATUSES_IGNORE);
  requests_.clear();
  check(rc, "MPI_Waitall");
}

void MpiTransport::allgather_bytes(const void* mine, void* all, int bytes) {
  check(MPI_Allgather(mine, bytes, MPI_BYTE, all, bytes, MPI_BYTE, comm_), "MPI_Allgather");
}

}  // namespace ringreduce
