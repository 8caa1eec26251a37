"""ringreduce: ring all-reduce for numpy arrays over MPI communicators from mpi4py.

    import ringreduce as rr
    comm = rr.Communicator()            # over MPI.COMM_WORLD
    y = comm.allreduce(x, op="sum")     # or rr.allreduce(x)
"""
import os as _os

from mpi4py import MPI as _MPI  # mpi4py owns MPI_Init; the core never calls it

from . import _mpi_check

_mpi_check.note_mpi4pys_library()  # (for the advice below, should the core not fit)
try:
    from . import _core
except ImportError as _error:
    if _error.path and _os.path.basename(_error.path).startswith("_core."):
        # The extension is there but cannot load: the MPI library it was linked against
        # moved or went (an mpich wheel uninstalled or upgraded, a venv copied), say.
        from ._mpi_check import cannot_load
        raise ImportError(cannot_load(str(_error), _MPI.Get_library_version())) from _error
    if "_core" not in str(_error):
        raise
    raise ImportError(
        f"ringreduce._core is not built in {_os.path.dirname(__file__)} (is this the "
        "source tree, before a build?): run `bash scripts/bootstrap.sh` there, or "
        "`pip install .`, or run from another folder to use an installed ringreduce"
    ) from None

from ._mpi_check import check_same_mpi as _check_same_mpi

# Before any call into MPI from the core: built for another MPI's ABI, its first call
# would crash (a segmentation fault, not an error).
_check_same_mpi(_core.mpi_built_for(), _MPI.Get_library_version(),
                getattr(_MPI, "_sizeof", lambda _: None)(_MPI.Comm), _core.mpi_library_version)

from ._shortcuts import allgather, allgather_async, allreduce, allreduce_async, broadcast, \
    broadcast_async, reduce_scatter, reduce_scatter_async
from ._types import OPS, DroppedErrorWarning, UnsupportedOpError, cuda_available, \
    supported_dtypes
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

# Named as users catch them (a traceback says "ringreduce.MismatchError", not
# "ringreduce._core.MismatchError"); pickle finds them there too.
for _kind in (MismatchError, MPIError, CollectiveTimeoutError, UnsupportedOpError,
              DroppedErrorWarning):
    _kind.__module__ = "ringreduce"
del _kind

__version__ = "0.1.0"
__all__ = [
    "Communicator", "Handle", "MismatchError", "MPIError", "CollectiveTimeoutError",
    "UnsupportedOpError", "DroppedErrorWarning", "OPS",
    "allreduce", "allreduce_async", "reduce_scatter", "reduce_scatter_async", "allgather",
    "allgather_async", "broadcast", "broadcast_async",
    "supported_dtypes", "allreduce_gradients", "cuda_available",
]
