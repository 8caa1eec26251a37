"""Module-level collectives: ``rr.allreduce(x)`` means
``rr.Communicator(comm or MPI.COMM_WORLD).allreduce(x)``, with one Communicator made
per mpi4py communicator and kept for later calls (creation is collective)."""
from __future__ import annotations

import weakref

from mpi4py import MPI

from .communicator import Communicator

_cache: dict[int, tuple] = {}  # id(mpi4py comm) -> (weakref to it, Communicator)


def _communicator(comm) -> Communicator:
    if isinstance(comm, Communicator):
        return comm
    if comm is None:
        comm = MPI.COMM_WORLD
    entry = _cache.get(id(comm))
    if entry is not None and entry[0]() is comm and not entry[1].closed:
        return entry[1]
    ring = Communicator(comm)
    # Ours, not the caller's: no ResourceWarning if a reused id() replaces it (closing
    # it is collective, and ids are reused at different times on different ranks).
    ring._warn_unclosed = False
    _cache[id(comm)] = (weakref.ref(comm), ring)
    return ring


def allreduce(x, op="sum", out=None, comm=None):
    """Communicator(comm).allreduce(x, op, out); comm=None means MPI.COMM_WORLD."""
    return _communicator(comm).allreduce(x, op=op, out=out)


def allreduce_async(x, op="sum", out=None, comm=None):
    """Communicator(comm).allreduce_async(x, op, out)."""
    return _communicator(comm).allreduce_async(x, op=op, out=out)


def reduce_scatter(x, op="sum", out=None, comm=None):
    """Communicator(comm).reduce_scatter(x, op, out)."""
    return _communicator(comm).reduce_scatter(x, op=op, out=out)


def allgather(x, out=None, comm=None):
    """Communicator(comm).allgather(x, out)."""
    return _communicator(comm).allgather(x, out=out)


def broadcast(x, root=0, comm=None):
    """Communicator(comm).broadcast(x, root)."""
    return _communicator(comm).broadcast(x, root=root)
