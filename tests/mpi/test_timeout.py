"""A rank that never joins a call, or stops halfway through one, must not leave the
others waiting forever: after the Communicator's timeout they raise
CollectiveTimeoutError saying whom they waited for, and a rank that joins late learns
that the others gave up. Each test makes its own Communicator, as a timeout leaves it
unusable, and waits for every rank (world.Barrier) before the next test starts."""
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import _core, communicator

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
TIMEOUT = 0.5
FLOAT32 = _core.DTYPES.index("float32")
SUM = rr.OPS.index("sum")

needs_two = pytest.mark.skipif(SIZE == 1, reason="needs another rank to wait for")


def waited_for(message_pattern, call):
    """Runs call(), which must raise CollectiveTimeoutError matching the pattern after
    about TIMEOUT seconds (not at once, and not much later)."""
    start = time.monotonic()
    with pytest.raises(rr.CollectiveTimeoutError, match=message_pattern) as info:
        call()
    waited = time.monotonic() - start
    assert TIMEOUT <= waited < TIMEOUT + 10, waited
    assert isinstance(info.value, TimeoutError)
    return str(info.value)


def a_ring_over(wire, monkeypatch, **kwargs):
    # The wire is chosen when the Communicator is made (RINGREDUCE_SHM=0: MPI only).
    monkeypatch.setenv("RINGREDUCE_SHM", "1" if wire == "shared memory" else "0")
    ring = rr.Communicator(timeout=TIMEOUT, **kwargs)
    monkeypatch.delenv("RINGREDUCE_SHM")
    if ring.transport != wire:
        ring._abandon()
        pytest.skip(f"the ranks are not all on one machine: no {wire}")
    return ring


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_a_rank_that_never_joins_a_call_makes_the_others_raise(wire, world, monkeypatch):
    ring = a_ring_over(wire, monkeypatch)
    x = np.full(4, RANK + 1.0)
    world.Barrier()
    if RANK == 0:
        others = {2: "rank 1 has", 3: "ranks 1, 2 have"}.get(SIZE, f"ranks 1-{SIZE - 1} have")
        missing = (f"{others} not joined this call within 0.5 s" if wire == "shared memory"
                   else "for every rank to join this call")
        message = waited_for(missing, lambda: ring.allreduce(x))
        assert message.startswith(f"ringreduce.allreduce (rank 0 of {SIZE}): ")
        assert "can no longer be used" in message
        with pytest.raises(rr.CollectiveTimeoutError, match="gave up earlier"):
            ring.allreduce(x)
        ring.close()  # frees nothing that would wait for the others
        world.Barrier()
    else:
        world.Barrier()  # rank 0 has given up by now; this rank comes late
        if wire == "shared memory":
            # Rank 0 said so on its board: no rank waits for it, none goes on (and a
            # rank that gave up for that reason says so too).
            with pytest.raises(rr.CollectiveTimeoutError,
                               match=r"ranks? 0\b.* ha(s|ve) given up on this communicator"):
                ring.allreduce(x)
        else:
            # Over MPI, rank 0's share of the header exchange is still posted: a call
            # small enough to be done in it completes, with rank 0's data.
            np.testing.assert_array_equal(ring.allreduce(x), np.full(4, SIZE * (SIZE + 1) / 2))
        ring._abandon()
    world.Barrier()


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_a_rank_that_stops_inside_the_ring_makes_its_neighbours_raise(wire, world,
                                                                      monkeypatch):
    # allgather in its two halves: every rank agrees on the call, then the last rank
    # (rank 0's left neighbour) stays away from the ring until the others gave up.
    ring = a_ring_over(wire, monkeypatch, chunk_bytes=4096)
    x = np.full(1 << 16, RANK, np.float32)  # 256 KiB a rank: too big for the header
    core = ring._core
    counts = core.allgather_counts(1, x.size, hash((x.size,)) & 0x7FFFFFFFFFFFFFFF, FLOAT32,
                                   4096, -1, False, x)
    out = np.empty((SIZE, x.size), np.float32)
    stopper = SIZE - 1
    if RANK == stopper:
        world.Barrier()
        with pytest.raises(rr.CollectiveTimeoutError, match="neighbour"):
            core.allgather(x, out, counts, x.size, FLOAT32)
    else:
        message = waited_for(r"neighbour\) to (send|take) a chunk",
                             lambda: core.allgather(x, out, counts, x.size, FLOAT32))
        assert message.startswith(f"ringreduce.allgather (rank {RANK} of {SIZE}): ")
        if RANK == 0:
            assert (f"rank {stopper} (the left neighbour) to send a chunk" in message
                    or "rank 1 (the right neighbour) to take a chunk" in message), message
        world.Barrier()
    with pytest.raises(rr.CollectiveTimeoutError, match="gave up earlier"):
        ring.allreduce(x)
    ring.close()
    world.Barrier()


@needs_two
@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
def test_a_stuck_gpu_makes_the_other_ranks_raise(direct, world):
    # The device ring over the host emulation; the last rank's first copy or kernel
    # takes longer than the timeout, as on a GPU stuck behind a long kernel.
    ring = rr.Communicator(timeout=TIMEOUT)
    ring._core.device_host_reduce_bytes = 0  # the device ring, not the host path
    x = np.full(5003, RANK, np.float32)
    out = np.empty_like(x)

    def allreduce():
        ring._core.allreduce_device(x.ctypes.data, out.ctypes.data, x.size, FLOAT32, SUM, 512,
                                    0, 0, 0, direct, True)

    world.Barrier()
    if RANK == SIZE - 1:
        _core.set_emulated_stall(1, 4 * TIMEOUT)
        try:
            with pytest.raises(rr.CollectiveTimeoutError, match="neighbour"):
                allreduce()
        finally:
            _core.set_emulated_stall(0, 0)
    else:
        waited_for(r"neighbour\) to (send|take) a chunk", allreduce)
    ring.close()
    world.Barrier()


def test_timeout_values(monkeypatch):
    with rr.Communicator() as ring:
        assert ring.timeout == communicator.DEFAULT_TIMEOUT
        ring.timeout = 2.5
        assert ring.timeout == 2.5
        ring.timeout = None
        assert ring.timeout is None
    for value in (None, float("inf")):
        with rr.Communicator(timeout=value) as ring:
            assert ring.timeout is None
    for bad, error in ((0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                       ("5", TypeError), (True, TypeError)):
        with pytest.raises(error, match="timeout"):
            rr.Communicator(timeout=bad)  # checked before anything collective
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "12.5")
    assert communicator._default_timeout() == 12.5
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "0")
    assert communicator._default_timeout() is None
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RINGREDUCE_TIMEOUT"):
        communicator._default_timeout()
    monkeypatch.delenv("RINGREDUCE_TIMEOUT")
    assert communicator._default_timeout() == 1800.0


def test_a_wait_shorter_than_the_timeout_is_not_one(world):
    # A rank that arrives late, but within the timeout, is just late.
    with rr.Communicator(timeout=5 * TIMEOUT) as ring:
        if RANK == SIZE - 1:
            time.sleep(TIMEOUT * 2)
        x = np.full(1 << 16, 1.0, np.float32)
        np.testing.assert_array_equal(ring.allreduce(x), np.full(1 << 16, SIZE, np.float32))
