"""ringreduce: ring all-reduce for numpy arrays over MPI communicators from mpi4py.

    import ringreduce as rr
    comm = rr.Communicator()            # over MPI.COMM_WORLD
    y = comm.allreduce(x, op="sum")     # or rr.allreduce(x)
"""
from mpi4py import MPI as _MPI  # mpi4py owns MPI_Init; the core never calls it

from . import _core

if _core.mpi_library_version().strip() != _MPI.Get_library_version().strip():
    raise ImportError(
        "ringreduce._core was built against a different MPI than the one mpi4py loaded:\n"
        f"  ringreduce: {_core.mpi_library_version().splitlines()[0].strip()}\n"
        f"  mpi4py:     {_MPI.Get_library_version().splitlines()[0].strip()}\n"
        "Rebuild ringreduce with the mpicc of mpi4py's MPI (set MPICC), "
        "e.g. `MPICC=/path/to/mpicc pip install --no-build-isolation .`")

from ._shortcuts import allgather, allgather_async, allreduce, allreduce_async, broadcast, \
    broadcast_async, reduce_scatter, reduce_scatter_async
from ._types import OPS, UnsupportedOpError, cuda_available, supported_dtypes
from .gradients import allreduce_gradients
from .communicator import Communicator, Handle

MismatchError = _core.MismatchError
MismatchError.__doc__ = ("Ranks called a collective with arguments that do not fit together "
                         "(count, dtype, op, root, ...); raised on every rank.")
MPIError = _core.MPIError
MPIError.__doc__ = "An MPI call failed; the message carries MPI's own error string."
CollectiveTimeoutError = _core.CollectiveTimeoutError
CollectiveTimeoutError.__doc__ = (
    "A call waited longer than its Communicator's timeout for another rank (one that "
    "skipped the call, or is stuck elsewhere), or learnt that the rank left, or is "
    "ending, so that waiting longer is no use; the Communicator is unusable afterwards. "
    "A TimeoutError.")

__version__ = "0.1.0"
__all__ = [
    "Communicator", "Handle", "MismatchError", "MPIError", "CollectiveTimeoutError",
    "UnsupportedOpError", "OPS",
    "allreduce", "allreduce_async", "reduce_scatter", "reduce_scatter_async", "allgather",
    "allgather_async", "broadcast", "broadcast_async",
    "supported_dtypes", "allreduce_gradients", "cuda_available",
]
