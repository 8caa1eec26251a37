"""Module-level collectives: ``rr.allreduce(x)`` means
``rr.Communicator(comm or MPI.COMM_WORLD).allreduce(x)``, with one Communicator made
per MPI communicator and kept for later calls (creation is collective)."""
from __future__ import annotations

import threading

from mpi4py import MPI

from . import _types
from .communicator import Communicator, _check_thread, checked_mpi_comm, mpi_unusable_here

# The Communicator made for an MPI communicator hangs on the communicator itself, as an
# MPI attribute: every mpi4py object for the same communicator (a new one per call, as
# petsc4py's tompi4py() gives) finds it, a Dup() or a new communicator at a reused
# handle does not. _made keeps each alive, here, until the process ends (closing is
# collective), and so out of MPI_Finalize, which deletes some communicators'
# attributes; but not past the user's own Free() of its MPI communicator (see
# _on_free): one Communicator kept per communicator a loop makes and frees kept an MPI
# communicator and its shared memory each, and MPICH ran out of communicators after
# 2045 of them.
_keyval = None
_keyval_made = threading.Lock()  # (two threads' first calls would make two)
_made: list = []
_freed: list = []  # Communicators whose MPI communicator the user freed, to be dropped
_making: dict = {}  # a lock per MPI communicator (handle), for making its Communicator


def _on_free(comm, keyval, ring):
    # The user freed the MPI communicator (MPI_Comm_free, on each of its ranks): its
    # Communicator is dropped, as one the user made and dropped, which frees its own
    # duplicate once every rank has dropped it. Not here, inside MPI's call, where its
    # __del__ could call MPI, but at the next module-level call (or at exit, with the
    # others). MPI_Finalize deletes the predefined communicators' attributes: theirs
    # were finished at exit already, and stay where they are.
    if comm != MPI.COMM_WORLD and comm != MPI.COMM_SELF:
        _freed.append(ring)


def _drop_freed() -> None:
    while _freed:
        try:
            ring = _freed.pop()
        except IndexError:  # (another thread took the last)
            break
        try:
            _made.remove(ring)
        except ValueError:
            pass


def _communicator(comm, caller: str) -> Communicator:
    global _keyval
    if isinstance(comm, Communicator):
        if comm._closed or comm._closing:  # (named here: not the call it would make)
            comm._refuse_as_closed(_types.where(comm.rank, comm.size, caller))
        return comm
    if _freed:
        _drop_freed()
    if comm is None and not mpi_unusable_here():
        comm = MPI.COMM_WORLD
    else:  # (the error, if any, names the function called, not the Communicator)
        comm = checked_mpi_comm(comm, caller)
    if _keyval is None:
        with _keyval_made:
            if _keyval is None:
                _keyval = MPI.Comm.Create_keyval(delete_fn=_on_free)
    ring = comm.Get_attr(_keyval)
    if ring is not None and not ring.closed:
        return ring
    # Refused here, where MPI lets only the main thread call it, named for the call the
    # script made rather than for the Communicator it would make first.
    _check_thread(_types.where(comm.Get_rank(), comm.Get_size(), caller), MPI.Query_thread())
    # One thread at a time makes the Communicator for a given MPI communicator: two
    # threads' first calls at once would make two, with one more MPI_Comm_idup on this
    # rank than on a rank where the second thread came once the first had made it.
    with _keyval_made:
        lock = _making.setdefault(MPI.Comm.py2f(comm), threading.Lock())
    with lock:
        ring = comm.Get_attr(_keyval)
        if ring is None or ring.closed:
            ring = Communicator(comm)
            # Ours, not the caller's: no ResourceWarning for it (closing is collective).
            ring._warn_unclosed = False
            comm.Set_attr(_keyval, ring)
            _made.append(ring)
    return ring


def allreduce(x, op="sum", out=None, comm=None):
    """``Communicator.allreduce(x, op, out)`` on the Communicator kept for ``comm``.

    ``comm=None`` means ``MPI.COMM_WORLD``. The first call on an MPI communicator makes
    its Communicator (collectively, on every rank) and later calls reuse it; an
    ``rr.Communicator`` given as ``comm`` is used as it is.
    """
    return _communicator(comm, "allreduce").allreduce(x, op=op, out=out)


def allreduce_async(x, op="sum", out=None, comm=None):
    """``Communicator.allreduce_async(x, op, out)`` on the Communicator kept for ``comm``
    (see allreduce)."""
    return _communicator(comm, "allreduce_async").allreduce_async(x, op=op, out=out)


def reduce_scatter(x, op="sum", out=None, comm=None):
    """``Communicator.reduce_scatter(x, op, out)`` on the Communicator kept for ``comm``
    (see allreduce)."""
    return _communicator(comm, "reduce_scatter").reduce_scatter(x, op=op, out=out)


def reduce_scatter_async(x, op="sum", out=None, comm=None):
    """``Communicator.reduce_scatter_async(x, op, out)`` on the Communicator kept for
    ``comm`` (see allreduce)."""
    return _communicator(comm, "reduce_scatter_async").reduce_scatter_async(x, op=op, out=out)


def allgather(x, out=None, comm=None):
    """``Communicator.allgather(x, out)`` on the Communicator kept for ``comm`` (see
    allreduce)."""
    return _communicator(comm, "allgather").allgather(x, out=out)


def allgather_async(x, out=None, comm=None):
    """``Communicator.allgather_async(x, out)`` on the Communicator kept for ``comm``
    (see allreduce)."""
    return _communicator(comm, "allgather_async").allgather_async(x, out=out)


def broadcast(x, root=0, comm=None):
    """``Communicator.broadcast(x, root)`` on the Communicator kept for ``comm`` (see
    allreduce)."""
    return _communicator(comm, "broadcast").broadcast(x, root=root)


def broadcast_async(x, root=0, comm=None):
    """``Communicator.broadcast_async(x, root)`` on the Communicator kept for ``comm``
    (see allreduce)."""
    return _communicator(comm, "broadcast_async").broadcast_async(x, root=root)
