"""Ring all-reduce in plain numpy over mpi4py point-to-point calls: the algorithm of
ringreduce's C++ core, written to be read. The tests hold the core to the same answers
bit for bit, so this file is also the core's specification (but for the sign of a NaN,
at the end).

Each of p ranks holds an array x of N bytes. Cut it into p segments (like
np.array_split). Every rank sends only to its right neighbour and receives only from its
left one.

Reduce-scatter, p-1 steps. At step k rank r sends segment r-1-k and receives segment
r-2-k (mod p), which it reduces into its own copy. With p = 4, the segment each rank
sends at each step (it receives what its left neighbour sends):

                 step 0   step 1   step 2   owns afterwards
        rank 0     S3       S2       S1     S0 = x0+x1+x2+x3
        rank 1     S0       S3       S2     S1
        rank 2     S1       S0       S3     S2
        rank 3     S2       S1       S0     S3

Segment S0 starts on rank 1 as x1[S0]; rank 2 adds x2, rank 3 adds x3, rank 0 adds x0.
Every segment travels p-1 hops, and ends on the rank whose number it bears.

All-gather, p-1 more steps. At step k rank r sends segment r-k and receives segment
r-1-k, this time only copying it. Each finished segment travels p-1 hops again, so
every rank ends with the same bytes, computed once by the segment's owner.

Ranks need not go round in rank order: `ring` (Communicator.ring) lists them in the order
they do, and "rank r" above then reads "the rank at position r of the ring"; segment s
is still rank s's block, and still ends on rank s. The core puts each machine's ranks
side by side on the ring, so that few chunks travel between machines.

Cost: each step moves one segment (N/p bytes) per rank, for 2(p-1) steps: every rank
sends and receives 2(p-1)/p * N bytes, which is optimal. The C++ core adds two things
this file leaves out, neither of which changes a bit of the result: it cuts each segment
into chunks, so that a chunk can be sent on while the next one is still arriving; and a
small call skips the steps altogether: its data rides in the header that every call's
ranks first exchange, and each rank reduces the segments it needs itself, each in the
order the ring would (docs/inside.md, "Small calls"). docs/ring.md walks through the
same steps (and `python -m ringreduce explain` prints them); csrc/ring_schedule.h is
this schedule in C++.

Bit for bit, but for the sign of a NaN: where one step makes a NaN (inf - inf) and a
later one meets another, x86 keeps the sign of whichever operand the compiled loop put
first; both are NaN. Ties in min and max, +0 against -0, follow the first operand here
and there: see _minimum."""
from __future__ import annotations

import os
import socket

import numpy as np
from mpi4py import MPI

from ._types import OPS, native, reduction_codes
from .sim import machine_ring_order


def _multiply(a, b, out):
    if np.iscomplexobj(a):
        # Spelled out: numpy's own complex multiply fuses multiply-adds on some CPUs,
        # and the ring must round the same way on every machine.
        real = a.real * b.real - a.imag * b.imag
        imag = a.real * b.imag + a.imag * b.real
        out.real, out.imag = real, imag
    else:
        np.multiply(a, b, out=out)


def _minimum(a, b, out):
    # np.minimum, with its ties spelled out: a NaN wins (a's first), and of two equal
    # values (+0 and -0) the first is kept. numpy leaves that choice to the loop it runs
    # (float16 keeps a, float32 with SIMD b), and every rank must pick the same zero.
    # (Bools: numpy's own, which writes True as 1 whatever nonzero byte held it.)
    if a.dtype == np.bool_:
        np.minimum(a, b, out=out)
    else:
        np.copyto(out, np.where((a <= b) | (a != a), a, b))


def _maximum(a, b, out):
    if a.dtype == np.bool_:
        np.maximum(a, b, out=out)
    else:
        np.copyto(out, np.where((a >= b) | (a != a), a, b))


# The per-step operation for each op; "avg" sums and divides once at the end.
REDUCE = {"sum": np.add, "prod": _multiply, "min": _minimum, "max": _maximum,
          "avg": np.add}


def segment_bounds(count: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's segment, laid out like np.array_split."""
    base, extra = divmod(count, size)
    bounds, start = [], 0
    for s in range(size):
        stop = start + base + (1 if s < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def machine_of_this_process() -> str:
    """The machine this rank runs on, as the core names it: host name / boot id (the
    boot id tells apart hosts that share a name). RINGREDUCE_TEST_MACHINE, for tests,
    pretends: "a,b" puts MPI_COMM_WORLD's rank r on the (r mod 2)th of a and b."""
    # In bytes, cut where the core's C strings cut them (64 of a name, 127 in all),
    # which may be inside a character of a name that is not ASCII.
    pretend = os.environb.get(b"RINGREDUCE_TEST_MACHINE")
    if pretend:
        names = pretend.split(b",")
        host = names[MPI.COMM_WORLD.Get_rank() % len(names)][:64]
    else:
        host = os.fsencode(socket.gethostname())[:64]
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.readline().strip()[:39]
    except OSError:
        boot = b""
    return (host + b"/" + boot)[:127].decode("utf-8", "surrogateescape")


def ring_order(comm=MPI.COMM_WORLD) -> list[int]:
    """The ranks in the order they go round the ring: each machine's side by side,
    machines in the order of their lowest rank. Rank order on one machine, or where
    mpiexec placed ranks machine by machine; round-robin placements (rank r on host
    r mod H) would otherwise send every step of the ring between machines. Rank order
    too where any rank has RINGREDUCE_RING=ranks (for comparing the two)."""
    told = comm.allgather((machine_of_this_process(),
                           os.environ.get("RINGREDUCE_RING") == "ranks"))
    if any(rank_order for _, rank_order in told):  # (one rank asking decides for all)
        return list(range(len(told)))
    return machine_ring_order([machine for machine, _ in told])


def _ring_of(comm, ring) -> tuple[list[int], int]:
    """The ranks in ring order (ring_order(comm) if ring is None), and this rank's
    position."""
    size = comm.Get_size()
    ring = ring_order(comm) if ring is None else [int(r) for r in ring]
    if sorted(ring) != list(range(size)):
        raise ValueError(f"ring must hold each of the {size} ranks once, got {ring}")
    return ring, ring.index(comm.Get_rank())


def _ring_reduce_scatter(work: np.ndarray, op: str, comm, ring=None) -> None:
    """Leave segment `rank` of `work` (a flat array) reduced over all ranks."""
    ring, pos = _ring_of(comm, ring)  # (pos: this rank's place on the ring)
    size = len(ring)
    left, right = ring[(pos - 1) % size], ring[(pos + 1) % size]
    seg = segment_bounds(work.size, size)
    for step in range(size - 1):
        # Segment numbers are their owners' ranks: the segment due at ring position q is
        # segment ring[q] (with the ring in rank order, simply r-1-k and r-2-k).
        send_seg, recv_seg = ring[(pos - 1 - step) % size], ring[(pos - 2 - step) % size]
        received = np.empty(seg[recv_seg][1] - seg[recv_seg][0], work.dtype)
        comm.Sendrecv(_raw(work[slice(*seg[send_seg])]), dest=right, recvbuf=_raw(received),
                      source=left)
        mine = work[slice(*seg[recv_seg])]
        # My data first, then what came around, as the core does (out = input OP
        # received): min and max keep the first of two tied values (+0 and -0), so the
        # order decides the result's bits, which the tests hold the core to.
        REDUCE[op](mine, received, out=mine)
    if op == "avg":
        _divide(work[slice(*seg[comm.Get_rank()])], size)


def _raw(segment: np.ndarray) -> np.ndarray:
    """The segment's bytes: every dtype (bfloat16 too) travels the same way."""
    return segment.view(np.uint8)


def _divide(segment: np.ndarray, size: int) -> None:
    # Complex numbers divide each component (numpy's complex division would
    # multiply by 1/size instead, rounding differently).
    if size == 1:
        return  # x / 1 is x (and a signalling NaN keeps its bits, as in the core)
    parts = segment.view(segment.real.dtype) if np.iscomplexobj(segment) else segment
    # By the count as a number of the segment's own type, as numpy 2 converts a Python
    # int (and the core does): numpy 1 divided float16 in float32 by the exact count
    # once it did not fit (2049 ranks and more: float16 has 2048, then 2050).
    np.true_divide(parts, parts.dtype.type(size), out=parts)


def _ring_allgather(work: np.ndarray, bounds: list[tuple[int, int]], comm, ring=None) -> None:
    """Fill every segment of `work` from its owner; rank r starts with segment r."""
    ring, pos = _ring_of(comm, ring)  # (pos: this rank's place on the ring)
    size = len(ring)
    left, right = ring[(pos - 1) % size], ring[(pos + 1) % size]
    for step in range(size - 1):
        send_seg, recv_seg = ring[(pos - step) % size], ring[(pos - 1 - step) % size]
        comm.Sendrecv(_raw(work[slice(*bounds[send_seg])]), dest=right,
                      recvbuf=_raw(work[slice(*bounds[recv_seg])]), source=left)


def _native(x) -> np.ndarray:
    """x as an array in this machine's byte order, as the core computes and returns it:
    the ring passes raw bytes, and ranks may differ in the byte order of their x."""
    x = np.asarray(x)
    return x.astype(native(x.dtype), copy=False)


def _checked(x, op, where: str) -> tuple[np.ndarray, str]:
    """x as an array (_native), and op's name ("sum" for MPI.SUM too, "max" for MPI.LOR
    on bools), if the core takes x's dtype with op (else the core's own error: no
    integer averages, say)."""
    x = _native(x)
    _, code = reduction_codes(x.dtype, op, f"ringreduce.reference.{where}")
    return x, OPS[code]


def allreduce(x, op: str = "sum", comm=MPI.COMM_WORLD, ring=None) -> np.ndarray:
    """The element-wise reduction of x over all ranks, on every rank. ring: the ranks
    in the order they go round (None: as the core orders them, see ring_order)."""
    x, op = _checked(x, op, "allreduce")
    work = np.array(x, copy=True).reshape(-1)
    if work.size == 0:  # (nothing to send: as the core, no ring steps at all)
        return work.reshape(x.shape)
    _ring_reduce_scatter(work, op, comm, ring)
    _ring_allgather(work, segment_bounds(work.size, comm.Get_size()), comm, ring)
    return work.reshape(x.shape)


def reduce_scatter(x, op: str = "sum", comm=MPI.COMM_WORLD, ring=None) -> np.ndarray:
    """This rank's block (np.array_split layout) of the reduction of x.ravel()."""
    x, op = _checked(x, op, "reduce_scatter")
    work = np.array(x, copy=True).reshape(-1)
    _ring_reduce_scatter(work, op, comm, ring)
    start, stop = segment_bounds(work.size, comm.Get_size())[comm.Get_rank()]
    return work[start:stop].copy()


def allgather(x, comm=MPI.COMM_WORLD, ring=None) -> np.ndarray:
    """Every rank's x concatenated along axis 0 (ranks may differ in len(x))."""
    x = np.atleast_1d(_native(x))
    rows = comm.allgather(x.shape[0])
    row_size = int(np.prod(x.shape[1:], dtype=np.int64))
    starts = np.concatenate([[0], np.cumsum(rows)]) * row_size
    bounds = [(int(starts[r]), int(starts[r + 1])) for r in range(len(rows))]
    work = np.empty(int(starts[-1]), x.dtype)
    work[slice(*bounds[comm.Get_rank()])] = x.reshape(-1)
    _ring_allgather(work, bounds, comm, ring)
    return work.reshape((sum(rows),) + x.shape[1:])


def naive_allreduce(x, op: str = "sum", comm=MPI.COMM_WORLD, root: int = 0) -> np.ndarray:
    """The parameter-server way, for contrast: every rank sends its whole x to the root,
    which reduces them one by one and sends the result back to every rank. The root moves
    (p-1)·N bytes in and (p-1)·N out while the other ranks wait; the ring moves
    2(p-1)/p·N in and the same out on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    x, op = _checked(x, op, "naive_allreduce")
    result = np.array(x, copy=True).reshape(-1)
    if rank == root:
        incoming = np.empty_like(result)
        for other in range(size):
            if other != root:
                comm.Recv(_raw(incoming), source=other)
                REDUCE[op](result, incoming, out=result)
        if op == "avg":
            _divide(result, size)
        for other in range(size):
            if other != root:
                comm.Send(_raw(result), dest=other)
    else:
        comm.Send(_raw(result), dest=root)
        comm.Recv(_raw(result), source=root)
    return result.reshape(x.shape)
