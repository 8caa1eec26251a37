"""A rank that never joins a call, or stops halfway through one, must not leave the
others waiting forever: after the Communicator's timeout they raise
CollectiveTimeoutError saying whom they waited for, and a rank that joins late learns
that the others gave up. Each test makes its own Communicator, as a timeout leaves it
unusable, and waits for every rank (world.Barrier) before the next test starts."""
import contextlib
import gc
import inspect
from fractions import Fraction
import os
import re
import signal
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import _core, communicator
from ringreduce.optim import SGD, DistributedOptimizer

from helpers import on_one_machine, on_the_worker_without_python, worker_held

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
TIMEOUT = 0.5
FLOAT32 = _core.DTYPES.index("float32")
SUM = rr.OPS.index("sum")

# What a rank waiting in the ring says: it waited for a neighbour, or (on 3 ranks or
# more) another rank gave up first and said so.
RING_WAIT = r"neighbour\) to (send|take) a chunk|rank \d+ has given up"

needs_two = pytest.mark.skipif(SIZE == 1, reason="needs another rank to wait for")


def waited_for(message_pattern, call):
    """Runs call(), which must raise CollectiveTimeoutError matching the pattern after
    about TIMEOUT seconds (not at once, and not much later).

    The lower bound holds from the start of the rank whose clock ran out. That is this
    rank, unless (on 3 ranks or more) the message relays another rank's "has given up":
    that rank may have started its call a moment before this one, so its start is
    checked later by relayed_waits_checked(), which every rank calls."""
    start = time.monotonic()
    with pytest.raises(rr.CollectiveTimeoutError, match=message_pattern) as info:
        call()
    end = time.monotonic()
    assert isinstance(info.value, TimeoutError)
    message = str(info.value)
    assert end - start < TIMEOUT + 10, end - start
    relayed = re.search(r"rank (\d+) has given up", message)
    if relayed and int(relayed.group(1)) != RANK:
        relayed_waits.append((int(relayed.group(1)), end))
    else:
        assert end - start >= TIMEOUT, end - start
    waits_started.append(start)
    return message


# This rank's waited_for() calls in the current test: when each started, and those
# that ended on another rank's giving up, (that rank, when this one raised).
waits_started = []
relayed_waits = []


@pytest.fixture(autouse=True)
def every_relayed_wait_is_checked():
    waits_started.clear()
    relayed_waits.clear()
    yield
    assert not relayed_waits, "call relayed_waits_checked(world) at the end of the test"


def relayed_waits_checked(world):
    """Collective (a barrier too): checks each relayed wait against the start of the
    rank that gave up. time.monotonic() is one clock for every process on a machine."""
    host = MPI.Get_processor_name()
    assert len(waits_started) <= 1, "one waited_for() per rank and test: its start is sent"
    starts = world.allgather((host, waits_started[-1] if waits_started else None))
    for giver, end in relayed_waits:
        giver_host, giver_start = starts[giver]
        assert giver_host == host and giver_start is not None, (giver, starts)
        assert end - giver_start >= TIMEOUT, (giver, end - giver_start)
    relayed_waits.clear()


def raised_within(seconds, message_pattern, call):
    """Runs call(), which must raise CollectiveTimeoutError matching the pattern within
    `seconds` (it learns that a rank left, rather than wait out a timeout)."""
    start = time.monotonic()
    with pytest.raises(rr.CollectiveTimeoutError, match=message_pattern):
        call()
    assert time.monotonic() - start < seconds


def free_here(lock) -> bool:
    """Whether this thread can take lock (an RLock, which has no locked()): False while
    another thread holds it."""
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


def a_ring_over(wire, monkeypatch, **kwargs):
    # The wire is chosen when the Communicator is made (RINGREDUCE_SHM=0: MPI only).
    # Made with time to spare (4 ranks on 2 cores, arriving from the last test, once
    # took over TIMEOUT to make one), then given the timeout its calls are tested with.
    monkeypatch.setenv("RINGREDUCE_SHM", "1" if wire == "shared memory" else "0")
    ring = rr.Communicator(timeout=30, **kwargs)
    ring.timeout = TIMEOUT
    monkeypatch.delenv("RINGREDUCE_SHM")
    if ring.transport != wire:
        ring._abandon()
        pytest.skip(f"the ranks are not all on one machine: no {wire}")
    return ring


@needs_two
@pytest.mark.parametrize("call", ["allreduce", "allreduce_async"])
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_a_rank_that_never_joins_a_call_makes_the_others_raise(wire, call, world,
                                                               monkeypatch):
    ring = a_ring_over(wire, monkeypatch)
    x = np.full(4, RANK + 1.0)
    world.Barrier()
    if RANK == 0:
        others = {2: "rank 1 has", 3: "ranks 1, 2 have"}.get(SIZE, f"ranks 1-{SIZE - 1} have")
        missing = (f"{others} not joined this call within 0.5 s" if wire == "shared memory"
                   else "for every rank to join this call")
        # (The async call is run by the wait itself, or by the worker thread.)
        run = ring.allreduce if call == "allreduce" else lambda x: ring.allreduce_async(x).wait()
        message = waited_for(missing, lambda: run(x))
        # The call made, where the core names the collective it ran (allreduce).
        assert message.startswith(f"ringreduce.{call} (rank 0 of {SIZE}): "), message
        assert "can no longer be used" in message
        # (Named as every call's error is: from a review.)
        with pytest.raises(rr.CollectiveTimeoutError, match=rf"^ringreduce\.allreduce \(rank 0 "
                           rf"of {SIZE}\): this ringreduce Communicator gave up earlier"):
            ring.allreduce(x)
        ring.close()  # frees nothing that would wait for the others
        world.Barrier()
    else:
        world.Barrier()  # rank 0 has given up by now; this rank comes late
        # Rank 0's share of the header exchange is still there (its board, or its
        # pending MPI_Iallgather): a call small enough to be done in it can complete,
        # with rank 0's data as it was then, unless this rank learns first that rank 0
        # left (as it does while it waits for a later rank). Either way, the next call
        # raises, saying so.
        try:
            result = ring.allreduce(x)
        except rr.CollectiveTimeoutError as error:
            assert "rank 0 has given up on this communicator" in str(error)
        else:
            np.testing.assert_array_equal(result, np.full(4, SIZE * (SIZE + 1) / 2))
        with pytest.raises(rr.CollectiveTimeoutError, match=r"rank \d+ has given up"):
            ring.allreduce(x)
        closes_at_once(ring)  # frees nothing that would wait for rank 0
    world.Barrier()


@needs_two
@pytest.mark.parametrize("late_call", ["allreduce", "close"])
@pytest.mark.parametrize("giver", ["rank 0", "the last rank"])
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_a_late_call_unlike_the_one_a_rank_gave_up_says_that_it_gave_up(wire, giver, late_call,
                                                                        world, monkeypatch):
    # As above, but the late ranks make another call than the one the rank that gave up
    # had posted: their header exchange completes with its header, which differs from
    # theirs. That is no mismatch to report (MismatchError promises a usable
    # Communicator): that rank has left, and they must say so at once. From a review:
    # their first call raised "ranks disagree: count (x.size): 1000 on rank 0; 3 on
    # ranks 1, 2", and only the next one said that rank 0 had given up. The last rank
    # gives up too, so that rank 0 is among the late ones. A late close() returns, as
    # it does after any departure, rather than raise MismatchError.
    ring = a_ring_over(wire, monkeypatch)
    gives_up = 0 if giver == "rank 0" else SIZE - 1
    world.Barrier()
    if RANK == gives_up:
        waited_for("not joined this call|for every rank to join this call",
                   lambda: ring.allreduce(np.ones(1000)))
        ring.close()
        world.Barrier()
    else:
        world.Barrier()  # that rank has given up by now; this rank comes late
        if late_call == "allreduce":
            gone = rf"rank {gives_up} has given up on this communicator \(a timeout there"
            start = time.monotonic()
            with pytest.raises(rr.CollectiveTimeoutError) as info:
                ring.allreduce(np.ones(3))
            assert time.monotonic() - start < TIMEOUT  # learnt, not waited out
            message = str(info.value)
            assert message.startswith(f"ringreduce.allreduce (rank {RANK} of {SIZE}): "), message
            assert re.search(gone, message) and "disagree" not in message, message
            assert "can no longer be used" in message
            with pytest.raises(rr.CollectiveTimeoutError, match=gone):
                ring.allreduce(np.ones(3))
        closes_at_once(ring)  # frees nothing that would wait for that rank
    world.Barrier()


@needs_two
def test_a_rank_that_makes_its_communicator_too_late_makes_every_rank_raise(world):
    # Making a Communicator is collective, and timed too: the ranks that came give up
    # instead of waiting forever. The late rank's duplicate of the world communicator
    # completes theirs (so that communicator stays in step for the barrier below); it
    # then waits in vain for the others to finish making theirs, and gives up too.
    late = RANK == SIZE - 1
    if late:
        time.sleep(4 * TIMEOUT)
    message = waited_for("not every rank made its Communicator within 0.5 s",
                         lambda: rr.Communicator(timeout=TIMEOUT))
    assert message.startswith(f"ringreduce.Communicator (rank {RANK} of {SIZE}): ")
    assert ("left to MPI_Finalize" if late else "MPI_Comm_idup stays pending") in message
    world.Barrier()
    with rr.Communicator(timeout=30) as ring:  # and the next one works
        np.testing.assert_array_equal(ring.allreduce(np.ones(3)), np.full(3, SIZE))


@needs_two
@pytest.mark.parametrize("step", [1, 2, 3], ids=["agreement", "offers", "mapped"])
def test_a_rank_held_up_while_making_its_communicator_leaves_no_one_waiting(step, world):
    # The last rank has its duplicate, then is held up (4x the timeout) before a later
    # step of making its Communicator: the agreement that every rank goes on, or one of
    # the shared-memory wire's two exchanges. The others give up there. Whatever they
    # had posted before giving up completes the late rank's step, but nothing after it
    # blocks without a timeout: the late rank raises too (before, it went on into MPI's
    # blocking making of a shared window and waited there for good). After the last
    # step (the offers, where the ranks are on several machines: no memory to map) it
    # may instead get a Communicator, whose first call then times out, like any call a
    # rank skipped.
    late = RANK == SIZE - 1
    last_step = 3 if on_one_machine() else 2
    if step > last_step:
        pytest.skip("ranks that share no memory map none: no such step")
    if late:
        _core.set_creation_pause(step, 4 * TIMEOUT)
    start = time.monotonic()
    try:
        ring = rr.Communicator(timeout=TIMEOUT)
    except rr.CollectiveTimeoutError as error:
        assert "not every rank made its Communicator within 0.5 s" in str(error)
        ring = None
    finally:
        _core.set_creation_pause(0, 0)
    assert time.monotonic() - start < 4 * TIMEOUT + 10
    if not late or step < last_step:
        assert ring is None
    if ring is not None:  # (over MPI messages, MPI cannot say which rank has not)
        with pytest.raises(rr.CollectiveTimeoutError,
                           match="not joined this call|for every rank to join this call"):
            ring.allreduce(np.ones(3))
        closes_at_once(ring)
    world.Barrier()
    with rr.Communicator(timeout=30) as ring:  # and the next one works
        np.testing.assert_array_equal(ring.allreduce(np.ones(3)), np.full(3, SIZE))


def test_ranks_with_and_without_a_timeout_make_a_communicator_together(world):
    # Timed or not, every rank makes its duplicate the same (non-blocking) way: MPI
    # never pairs a blocking collective with a non-blocking one.
    with rr.Communicator(timeout=None if RANK == 0 else 30) as ring:
        np.testing.assert_array_equal(ring.allreduce(np.ones(3)), np.full(3, SIZE))


def given_up_for_good(ring, world):
    """After a call timed out: the communicator refuses the next call, closes at once,
    and every relayed wait is checked (collective)."""
    with pytest.raises(rr.CollectiveTimeoutError, match="gave up earlier"):
        ring.allreduce(np.zeros(4, np.float32))
    closes_at_once(ring)
    relayed_waits_checked(world)


def closes_at_once(ring):
    """close() returns, without waiting for ranks that have left."""
    start = time.monotonic()
    ring.close()
    assert ring.closed
    assert time.monotonic() - start < 5


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
    # Rank 0's neighbours on the ring: SIZE - 1 and 1, unless the ranks go round in
    # another order (RINGREDUCE_TEST_MACHINE), which the messages follow.
    stopper, right = ring.ring[-1], ring.ring[1 % SIZE]
    if RANK == stopper:
        world.Barrier()
        # The others left, and said so: no waiting for the timeout here.
        raised_within(TIMEOUT, r"rank \d+ has given up",
                      lambda: core.allgather(x, out, counts, x.size, FLOAT32))
    else:
        message = waited_for(RING_WAIT, lambda: core.allgather(x, out, counts, x.size, FLOAT32))
        assert message.startswith(f"ringreduce.allgather (rank {RANK} of {SIZE}): ")
        if RANK == 0:
            assert (f"rank {stopper} (the left neighbour) to send a chunk" in message
                    or f"rank {right} (the right neighbour) to take a chunk" in message
                    or "has given up" in message), message
        world.Barrier()
    given_up_for_good(ring, world)



@needs_two
def test_optimizers_stepped_in_another_order_elsewhere_are_told_that_order_matters(world):
    # (From a review.) A step's last all-reduce starts in step() (so that a rank can
    # still abandon the step), which makes step() collective: ranks that step two
    # DistributedOptimizers in different orders wait for each other. The error named
    # only an allreduce that "a rank skipped"; every rank had made it.
    from ringreduce.optim import SGD, DistributedOptimizer
    rings = [rr.Communicator(timeout=30), rr.Communicator(timeout=30)]
    optimizers = []
    for ring in rings:
        ring.timeout = TIMEOUT
        params = [np.zeros(1000), np.zeros(10)]
        optimizers.append(DistributedOptimizer(SGD(params, lr=0.1), comm=ring,
                                               bucket_mb=0.001))
        optimizers[-1].grad_ready(1, np.ones(10))
        optimizers[-1].grad_ready(0, np.ones(1000))
    # Every gradient is in: each optimizer's buckets but the last have started.
    first = optimizers[0] if RANK == 0 else optimizers[1]
    message = waited_for(r"steps several DistributedOptimizers in another order \(make "
                         r"their step\(\) calls in the same order on every rank\): "
                         r"ringreduce\.allreduce", first.step)
    assert message.startswith(f"ringreduce.DistributedOptimizer.step (rank {RANK} of {SIZE}): ")
    world.Barrier()
    for ring in rings:
        ring._abandon()
    relayed_waits_checked(world)


@needs_two
def test_allreduce_gradients_that_times_out_names_itself(world):
    # (From a review.) Its error named the "ringreduce.allreduce" the script never
    # called: it names allreduce_gradients, and that it is collective, with the core's
    # error (what kind of timeout, on whom) after it and as its cause.
    ring = rr.Communicator(timeout=30)
    ring.timeout = TIMEOUT
    if RANK == 0:
        grads = [np.ones(10), np.ones(20_000)]  # (a bucket, and one reduced in place)
        message = waited_for(r"its all-reduces did not complete", lambda:
                             rr.allreduce_gradients(grads, comm=ring))
        assert message.startswith(f"ringreduce.allreduce_gradients (rank 0 of {SIZE}): its "
                                  "all-reduces did not complete"), message
        assert "every rank must call it" in message
        assert f": ringreduce.allreduce (rank 0 of {SIZE}): " in message, message
        # Its next call: this Communicator gave up earlier, named the same way, with
        # the core's error as the cause (which says what kind of timeout: _kind).
        with pytest.raises(rr.CollectiveTimeoutError, match=(
                rf"^ringreduce\.allreduce_gradients \(rank 0 of {SIZE}\): its all-reduces "
                r"did not complete.*gave up earlier")) as again:
            rr.allreduce_gradients(grads, comm=ring)
        assert again.value.__cause__._kind == "in call", again.value.__cause__
        np.testing.assert_array_equal(grads[1], 1)  # nothing reduced
    world.Barrier()
    ring._abandon()
    relayed_waits_checked(world)


@needs_two
@pytest.mark.parametrize("call", ["allreduce", "allreduce_gradients", "DistributedOptimizer",
                                  "broadcast_parameters", "load_state_dict"])
def test_a_rank_that_rejected_its_arguments_raises_its_own_error_though_no_one_came(
        call, world):
    # (From a review.) A rank that rejects its arguments tells the others in the call's
    # header exchange; where they never come, that times out, and the timeout was all it
    # raised (allreduce_gradients and broadcast_parameters dropped its own error): its
    # own error is what it can mend; the timeout is noted on it.
    ring = rr.Communicator(timeout=30)
    opt = DistributedOptimizer(SGD([np.zeros(3)], lr=0.1), comm=ring)
    ring.timeout = TIMEOUT
    calls = {
        "allreduce": (lambda: ring.allreduce(np.ones(3), op="bogus"), ValueError,
                      r"^ringreduce\.allreduce \(rank 0 of \d+\): op 'bogus' is not one"),
        "allreduce_gradients": (lambda: rr.allreduce_gradients([np.ones(3)], op="bogus",
                                                               comm=ring), ValueError,
                                r"^ringreduce\.allreduce_gradients .*op 'bogus' is not one"),
        "DistributedOptimizer": (lambda: DistributedOptimizer(
            SGD([np.zeros(3)], lr=0.1), comm=ring, bucket_mb=-1), ValueError,
            r"bucket_mb must be a number of MiB > 0"),
        "broadcast_parameters": (lambda: opt.broadcast_parameters(root=SIZE), ValueError,
                                 r"root"),
        "load_state_dict": (lambda: opt.load_state_dict({"no": "state"}), KeyError,
                            r"load_state_dict"),
    }
    if RANK == 0:
        run, kind, pattern = calls[call]
        start = time.monotonic()
        with pytest.raises(kind, match=pattern) as info:
            run()
        assert time.monotonic() - start >= TIMEOUT  # (it waited for the others to come)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        if hasattr(info.value, "add_note"):
            # (Over MPI between machines: "waited ... for every rank to join this call".)
            assert re.search(r"^\(Then telling the other ranks so timed out: ringreduce\.\S+ "
                             r"\(rank 0 of \d+\): .*(not joined|for every rank to join)",
                             notes), notes
    world.Barrier()
    ring._abandon()


@needs_two
def test_a_rank_that_stops_inside_a_broadcast_makes_the_root_raise(world, monkeypatch):
    # 256 KiB: past the root's board, and few enough chunks that the root puts them all
    # in its slots at once; it then waits for its right neighbour (rank 1) to take them,
    # which stays away from the ring, after the header exchange, until the others gave up.
    ring = a_ring_over("shared memory", monkeypatch)
    x = np.full(1 << 16, RANK, np.float32)
    if RANK == 1:
        # Long enough for rank 0's giving up to be there when it comes back (which it then
        # raises, though all the chunks are in rank 0's slots).
        _core.set_shm_broadcast_pause(TIMEOUT + 4)
        try:
            raised_within(TIMEOUT + 15, r"rank \d+ has given up",
                          lambda: ring.broadcast(x, root=0))
        finally:
            _core.set_shm_broadcast_pause(0)
    else:
        message = waited_for(RING_WAIT, lambda: ring.broadcast(x, root=0))
        if RANK == 0:  # (on 3 ranks or more, rank 2, waiting on rank 1 too, may tell first)
            assert ("rank 1 (the right neighbour) to take a chunk" in message
                    or "has given up" in message), message
    world.Barrier()
    given_up_for_good(ring, world)

@needs_two
def test_a_late_rank_never_completes_a_call_the_others_gave_up(world, monkeypatch):
    # Over MPI, the ranks that gave up leave their sends with MPI. Rows small enough to
    # be sent eagerly (but not in the header: no x with the counts) let a late rank's
    # receives complete from them; it must still raise, not return a result that the
    # others' callers may be changing under MPI's feet.
    ring = a_ring_over("MPI", monkeypatch, chunk_bytes=1024)
    x = np.full(256, RANK + 1, np.float32)
    core = ring._core
    counts = core.allgather_counts(1, x.size, hash((x.size,)) & 0x7FFFFFFFFFFFFFFF, FLOAT32,
                                   1024, -1, False)
    out = np.zeros((SIZE, x.size), np.float32)
    stopper = SIZE - 1
    if RANK == stopper:
        world.Barrier()
        with pytest.raises(rr.CollectiveTimeoutError, match=r"rank \d+ has given up"):
            core.allgather(x, out, counts, x.size, FLOAT32)
    else:
        waited_for(RING_WAIT, lambda: core.allgather(x, out, counts, x.size, FLOAT32))
        # MPI may still read them when the late rank comes: they must outlive the call.
        kept = [weakref.ref(x), weakref.ref(out)]
        del x, out
        gc.collect()
        assert all(ref() is not None for ref in kept)
        world.Barrier()
    closes_at_once(ring)
    relayed_waits_checked(world)


@needs_two
def test_the_arrays_of_an_async_call_given_up_outlive_it(world, monkeypatch):
    # As for a blocking call: x and the result of an allreduce that the worker ran
    # without Python, and gave up, stay alive after its Handle is gone, since MPI may
    # still read them (pending sends) when the late rank comes.
    ring = a_ring_over("MPI", monkeypatch)
    if not ring._executor.threaded:
        pytest.skip("MPI without MPI_THREAD_MULTIPLE: asynchronous calls run inline")
    x = async_input("FastPath")
    out = np.empty_like(x)
    stopper = SIZE - 1
    if RANK == stopper:
        world.Barrier()
        raised_within(TIMEOUT + 10, r"rank \d+ has given up", lambda: ring.allreduce(x))
    else:
        handle = ring.allreduce_async(x, out=out)
        assert queued_by("FastPath", handle)
        with pytest.raises(rr.CollectiveTimeoutError):
            handle.wait()
        kept = [weakref.ref(x), weakref.ref(out)]
        del x, out, handle
        gc.collect()
        ring._executor.drain()
        assert all(ref() is not None for ref in kept)
        world.Barrier()
    closes_at_once(ring)
    relayed_waits_checked(world)


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_ranks_without_a_timeout_learn_that_a_rank_gave_up_and_on_whom(wire, world,
                                                                       monkeypatch):
    # Only rank 0 has a timeout; the others would wait forever for the last rank, which
    # stays away, were it not for rank 0 telling them it has given up. They name the
    # rank it waited for, as their own timeout would have, where rank 0 knew it: a
    # shared-memory header exchange sees who is missing, MPI_Iallgather does not.
    ring = a_ring_over(wire, monkeypatch)
    ring.timeout = TIMEOUT if RANK == 0 else None
    x = np.full(1 << 16, 1.0, np.float32)  # a ring call, not one done in the header
    stopper = SIZE - 1
    on_whom = f", waiting for rank {stopper}" if wire == "shared memory" else ""
    gave_up = re.escape(f"rank 0 has given up on this communicator (a timeout there{on_whom})")
    if RANK == stopper:
        world.Barrier()
        # (Without a timeout: without the note it would wait for good.)
        raised_within(10, gave_up, lambda: ring.allreduce(x))
    elif RANK == 0:
        # The last rank never joins: rank 0 waits in the header exchange.
        waited_for(r"not joined this call|for every rank to join this call",
                   lambda: ring.allreduce(x))
        world.Barrier()
    else:
        raised_within(TIMEOUT + 10, gave_up, lambda: ring.allreduce(x))
        world.Barrier()
    closes_at_once(ring)
    world.Barrier()


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_ranks_without_a_timeout_learn_whom_a_rank_waited_for_in_the_ring(wire, world,
                                                                         monkeypatch):
    # As above, but the last rank agrees on the call and then stays away from the ring:
    # rank 0, the only one with a timeout, gives up on a neighbour, and the others'
    # messages name the rank its own message names.
    ring = a_ring_over(wire, monkeypatch, chunk_bytes=4096)
    ring.timeout = TIMEOUT if RANK == 0 else None
    x = np.full(1 << 16, RANK, np.float32)  # 256 KiB a rank: too big for the header
    core = ring._core
    counts = core.allgather_counts(1, x.size, hash((x.size,)) & 0x7FFFFFFFFFFFFFFF, FLOAT32,
                                   4096, -1, False, x)
    out = np.empty((SIZE, x.size), np.float32)
    call = lambda: core.allgather(x, out, counts, x.size, FLOAT32)  # noqa: E731
    gave_up = r"rank 0 has given up on this communicator \(a timeout there, waiting for rank (\d+)\)"
    told = None
    if RANK == SIZE - 1:
        world.Barrier()
        raised_within(10, gave_up, call)  # (no timeout: without the note, for good)
    elif RANK == 0:
        message = waited_for(r"for rank \d+ \(the (left|right) neighbour\)", call)
        told = int(re.search(r"for rank (\d+) \(the", message).group(1))
        world.Barrier()
    else:
        start = time.monotonic()
        with pytest.raises(rr.CollectiveTimeoutError, match=gave_up) as info:
            call()
        assert time.monotonic() - start < TIMEOUT + 10
        told = int(re.search(gave_up, str(info.value)).group(1))
        world.Barrier()
    told_everywhere = world.allgather(told)
    assert all(t in (None, told_everywhere[0]) for t in told_everywhere), told_everywhere
    closes_at_once(ring)
    relayed_waits_checked(world)


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_an_error_leaving_a_with_block_tells_the_others(wire, world, monkeypatch):
    # The last rank fails (on its own) and leaves its `with` block; the others, already
    # in an allreduce that will never see it, raise at once instead of after the
    # timeout, and their close() frees nothing that would wait for it.
    ring = a_ring_over(wire, monkeypatch)
    ring.timeout = 60
    x = np.full(1 << 16, 1.0, np.float32)
    if RANK == SIZE - 1:
        with pytest.raises(KeyError):
            with ring:
                raise KeyError("only on this rank")
        assert ring.closed
    else:
        # (the message names this among the causes: no close() was called there)
        raised_within(10, f"rank {SIZE - 1} has left this communicator .*an exception "
                          "that left its `with` block", lambda: ring.allreduce(x))
        closes_at_once(ring)
    world.Barrier()


@needs_two
@pytest.mark.parametrize("compression", [None, "fp16"])
def test_a_rank_that_leaves_during_backward_is_named_by_the_others_step(compression, world,
                                                                        monkeypatch):
    # (helper 234) The last rank's backward fails, and the exception leaves its `with`
    # block; the others, in step(), raised at once, as they should, but named
    # "ringreduce.allreduce", a call the script never made.
    from ringreduce.optim import SGD, DistributedOptimizer
    ring = a_ring_over("shared memory", monkeypatch)
    ring.timeout = 60
    params = [np.zeros((30, 20), np.float32), np.zeros(20, np.float32)]
    opt = DistributedOptimizer(SGD(params, lr=1.0), comm=ring, bucket_mb=0.001,
                               compression=compression)
    opt.step([np.ones((30, 20), np.float32), np.ones(20, np.float32)])  # (fp16: agreed)
    if RANK == SIZE - 1:
        with pytest.raises(KeyError):
            with ring:
                opt.grad_ready(1, np.ones(20, np.float32))
                raise KeyError("only on this rank, halfway through backward")
    else:
        opt.grad_ready(1, np.ones(20, np.float32))
        opt.grad_ready(0, np.ones((30, 20), np.float32))
        raised_within(10, rf"^ringreduce\.DistributedOptimizer\.step \(rank {RANK} of {SIZE}\):"
                          rf" rank {SIZE - 1} has left this communicator", opt.step)
        closes_at_once(ring)
    world.Barrier()


@needs_two
@pytest.mark.parametrize("how", ["leaves", "never comes"])
def test_a_rank_away_from_an_fp16_scale_agreement_is_named_by_the_others_step(how, world):
    # (helper 237) With "fp16", a bucket's first all-reduce waits for the ranks'
    # agreement on its scale (a blocking all-reduce, in step(): see
    # test_an_fp16_bucket_agrees_on_its_first_scale_in_step_alone): where the last rank
    # had left (an exception left its `with` block) or never came, the others raised
    # "ringreduce.allreduce (rank 0 of 3): ...", a call the script never made.
    ring = rr.Communicator(timeout=30)
    params = [np.zeros((30, 20), np.float32), np.zeros(20, np.float32)]
    opt = DistributedOptimizer(SGD(params, lr=1.0), comm=ring, bucket_mb=0.001,
                               compression="fp16")  # (params[1]'s bucket starts first)
    ring.timeout = 60 if how == "leaves" else TIMEOUT
    named = rf"^ringreduce\.DistributedOptimizer\.step \(rank {RANK} of {SIZE}\): "
    grads = [np.ones((30, 20), np.float32), np.ones(20, np.float32)]
    if RANK == SIZE - 1:
        if how == "leaves":
            with pytest.raises(KeyError):
                with ring:
                    raise KeyError("only on this rank, before its backward")
    elif how == "leaves":
        raised_within(10, named + rf"rank {SIZE - 1} has left this communicator",
                      lambda: opt.step(grads))
        closes_at_once(ring)
    else:
        # (Over MPI between machines: "waited ... for every rank to join this call".)
        waited_for(named + r"this step's all-reduces did not complete.*"
                   rf"(rank {SIZE - 1} has not joined this call|rank \d+ has given up"
                   r"|waited \S+ s \(the timeout\) for every rank to join this call)",
                   lambda: opt.step(grads))
    world.Barrier()
    ring._abandon()
    relayed_waits_checked(world)


@needs_two
@pytest.mark.parametrize("at", ["all-reduce", "broadcast", "allgather"])
@pytest.mark.parametrize("call", ["DistributedOptimizer", "load_state_dict",
                                  "broadcast_parameters", "allreduce_gradients"])
def test_a_rank_that_leaves_an_agreement_is_named_by_the_others_call(call, at, world,
                                                                     monkeypatch):
    # (helper 237) These calls begin with an agreement (gradients.agree_or_raise; for
    # allreduce_gradients, where its first call's checks differ): where the last rank
    # left during it (before its all-reduce; before the broadcast of why it rejected its
    # arguments; before the allgather that names the ranks whose arguments differ), the
    # others' error began "ringreduce.allreduce" ("broadcast", "allgather"), calls the
    # script never made.
    ring = rr.Communicator(timeout=60)
    opt = DistributedOptimizer(SGD([np.zeros(3)], lr=0.1), comm=ring)
    saved = opt.state_dict()
    last = RANK == SIZE - 1
    rejects = last and at == "broadcast"
    # (allreduce_gradients agrees only where its first call's checks differ)
    differs = last and (at == "allgather" or call == "allreduce_gradients" and not rejects)
    runs = {
        "DistributedOptimizer": lambda: DistributedOptimizer(
            SGD([np.zeros(4 if differs else 3)], lr=0.1), comm=ring,
            bucket_mb=-1 if rejects else 25),
        "load_state_dict": lambda: opt.load_state_dict(
            {"no": "state"} if rejects else
            dict(saved, optimizer=dict(saved["optimizer"], lr=0.2)) if differs else saved),
        "broadcast_parameters": lambda: opt.broadcast_parameters(
            root=SIZE if rejects else SIZE - 1 if differs else 0),
        "allreduce_gradients": lambda: rr.allreduce_gradients(
            [np.ones(4 if differs else 3)], op="bogus" if rejects else "avg", comm=ring),
    }
    if last:
        def leave(*args, **kwargs):
            with ring:
                raise KeyError("only on this rank, in the agreement")

        monkeypatch.setattr(rr.Communicator, at.replace("-", ""), leave)
        with pytest.raises(Exception):  # (its own error, or the KeyError)
            runs[call]()
        assert ring.closed
    else:
        prefix = call if call in ("DistributedOptimizer", "allreduce_gradients") else \
            f"DistributedOptimizer.{call}"
        raised_within(10, rf"^ringreduce\.{re.escape(prefix)} \(rank {RANK} of {SIZE}\): "
                          rf"rank {SIZE - 1} has left this communicator", runs[call])
        closes_at_once(ring)
    world.Barrier()


@needs_two
@pytest.mark.parametrize("at", ["the parameters", "the optimizer's state"])
def test_a_rank_that_leaves_broadcast_parameters_halfway_is_named_by_the_others(at, world,
                                                                                monkeypatch):
    # (helper 237) Past its agreement: where the last rank left during the broadcasts
    # themselves, the others' error began "ringreduce.broadcast (rank 0 of 3): ...".
    ring = rr.Communicator(timeout=60)
    opt = DistributedOptimizer(SGD([np.zeros(3), np.zeros(4)], lr=0.1), comm=ring)
    if RANK == SIZE - 1:
        real, made = rr.Communicator.broadcast, []

        def broadcast(self, x, root=0):
            if len(made) == (0 if at == "the parameters" else 2):  # (two parameters)
                with ring:
                    raise KeyError("only on this rank, in broadcast_parameters")
            made.append(x)
            return real(self, x, root=root)

        monkeypatch.setattr(rr.Communicator, "broadcast", broadcast)
        with pytest.raises(KeyError):
            opt.broadcast_parameters()
        assert ring.closed
    else:
        raised_within(10, rf"^ringreduce\.DistributedOptimizer\.broadcast_parameters \(rank "
                          rf"{RANK} of {SIZE}\): rank {SIZE - 1} has left this communicator",
                      opt.broadcast_parameters)
        closes_at_once(ring)
    world.Barrier()


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_a_rank_that_drops_its_communicator_unclosed_is_reported_at_once(
        wire, world, monkeypatch):
    # The last rank makes fewer calls, then drops the Communicator without close() (at
    # the end of `python -m mpi4py script.py` the script's globals go so): the others,
    # in a call it will never make, raise at once (on shared memory it marks itself
    # gone; over MPI messages its close, begun as it is dropped, meets their call; they
    # waited out their timeout there), and their close() frees nothing.
    ring = a_ring_over(wire, monkeypatch)
    x = np.full(1 << 10, 1.0, np.float32)
    ring.allreduce(x)
    if RANK == SIZE - 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del ring
            gc.collect()
    else:
        ring.timeout = 60
        raised_within(10, f"rank {SIZE - 1} has stopped using this communicator without "
                      r"closing it \(its process ended, or dropped the Communicator\), "
                      "after fewer calls on it than this rank made", lambda: ring.allreduce(x))
        closes_at_once(ring)
    relayed_waits_checked(world)


def async_input(path):
    """An array for a ring call (not one done in the header) that allreduce_async
    queues as `path` says: from the FastPath (runs without Python), or as Python work."""
    if path == "FastPath":
        rr._types.reduction_codes(np.dtype(np.float32), "sum", "test")  # (seen before)
        return np.full(1 << 16, 1.0, np.float32)
    return np.full(1 << 17, 1.0, np.float32)[::2]  # strided: the general path


def queued_by(path, handle):
    return on_the_worker_without_python(handle) == (path == "FastPath")


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
@pytest.mark.parametrize("path", ["FastPath", "Python"])
def test_an_error_leaving_a_with_block_stops_its_calls_in_flight(path, wire, world,
                                                                 monkeypatch):
    # The last rank has an allreduce running on its worker thread (waiting for the
    # others, who are elsewhere) and another queued when an exception leaves its `with`
    # block: the running one stops at once, the queued one never starts, and the rank
    # leaves (before, it stayed in the call until the timeout, and a daemon thread
    # inside MPI at exit aborted or hung the process).
    ring = a_ring_over(wire, monkeypatch)
    if not ring._executor.threaded:
        pytest.skip("MPI without MPI_THREAD_MULTIPLE: asynchronous calls run inline")
    ring.timeout = 60
    x = async_input(path)
    if RANK == SIZE - 1:
        start = time.monotonic()
        with pytest.raises(KeyError):
            with ring:
                running = ring.allreduce_async(x)
                queued = ring.allreduce_async(x)
                assert queued_by(path, running) and queued_by(path, queued)
                deadline = time.monotonic() + 10
                while free_here(ring._executor.running):  # until the worker has started it
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                time.sleep(0.05)  # and is waiting in its header exchange
                raise KeyError("only on this rank")
        assert time.monotonic() - start < 10
        # (The call and the rank first, as in every call's error, and the reason.)
        with pytest.raises(RuntimeError, match=rf"^ringreduce\.allreduce_async \(rank {RANK} of "
                           rf"{SIZE}\): stopped on this rank, which is leaving the "
                           r"communicator \(an exception left the Communicator's `with` block"):
            running.wait(0)
        with pytest.raises(ValueError, match="never ran: an exception left"):
            queued.wait(0)
        assert ring.closed and ring._core.departed and not ring._executor.started
        world.Barrier()
    else:
        world.Barrier()
        the_last_rank_is_found_gone(ring, x)
    world.Barrier()


def the_last_rank_is_found_gone(ring, x):
    """On the other ranks, once the last one left at an exception in its `with` block:
    the next call says so at once, and so does closing."""
    # Its header is still posted, so this call gets as far as the ring.
    raised_within(10, f"rank {SIZE - 1} has left", lambda: ring.allreduce(x))
    closes_at_once(ring)


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_each_call_that_never_ran_after_a_with_block_was_left_names_itself(wire, world,
                                                                         monkeypatch):
    # As above, with calls of every kind queued behind the running one, a blocking one
    # among them (another thread's): each that never ran raises a ValueError of its own
    # that begins, as every call's error does, with the call and the rank (before, all
    # raised one and the same error, "ringreduce: a collective of <Communicator ...>
    # never ran", which named none of them).
    ring = a_ring_over(wire, monkeypatch)
    if not ring._executor.threaded:
        pytest.skip("MPI without MPI_THREAD_MULTIPLE: asynchronous calls run inline")
    ring.timeout = 60
    x = async_input("FastPath")
    if RANK == SIZE - 1:
        blocking = []

        def a_blocking_allgather():
            try:
                ring.allgather(x)
            except ValueError as error:
                blocking.append(error)

        thread = threading.Thread(target=a_blocking_allgather)
        with pytest.raises(KeyError):
            with ring:
                running = ring.allreduce_async(x)
                queued = {"allreduce_async": ring.allreduce_async(x),
                          "reduce_scatter_async": ring.reduce_scatter_async(x),
                          "allgather_async": ring.allgather_async(x),
                          "broadcast_async": ring.broadcast_async(x.copy())}
                thread.start()
                deadline = time.monotonic() + 10
                # Until the blocking call is queued too (6 in the queue, the first among
                # them), and the worker has started the first (else, on a loaded
                # machine, that one too never ran).
                while ring._executor.calls.pending() < 6 or free_here(ring._executor.running):
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                time.sleep(0.05)  # (and is waiting in its header exchange)
                raise KeyError("only on this rank")
        thread.join(10)
        assert not thread.is_alive()
        with pytest.raises(RuntimeError, match="stopped on this rank"):
            running.wait(0)
        raised = []
        for name, handle in queued.items():
            with pytest.raises(ValueError, match=rf"^ringreduce\.{name} \(rank {RANK} of {SIZE}\): "
                               r"never ran: an exception left the Communicator's `with` block "
                               "first, and this rank left the communicator$") as error:
                handle.wait(0)
            raised.append(error.value)
            with pytest.raises(ValueError) as again:  # (the same error at every wait)
                handle.wait()
            assert again.value is error.value
        assert len(blocking) == 1
        assert re.match(rf"ringreduce\.allgather \(rank {RANK} of {SIZE}\): never ran: an "
                        "exception left", str(blocking[0])), blocking[0]
        assert len({id(error) for error in raised + blocking}) == len(queued) + 1
        world.Barrier()
    else:
        world.Barrier()
        the_last_rank_is_found_gone(ring, x)
    world.Barrier()

@contextlib.contextmanager
def ctrl_c_soon():
    """A SIGINT to this process 0.3 s in, as Ctrl-C would send; the block must be over
    within 10 s (not after the 60 s timeouts the tests set)."""
    ctrl_c = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    ctrl_c.start()
    try:
        yield
    finally:
        ctrl_c.cancel()
    assert time.monotonic() - start < 10


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
@pytest.mark.parametrize("mode", ["blocking", "async, FastPath", "async, Python",
                                  "async, FastPath, run by wait()",
                                  "async, Python, run by wait()"])
def test_ctrl_c_stops_a_call_that_waits_for_ranks_that_will_not_come(mode, wire, world,
                                                                    monkeypatch):
    # Rank 0 calls alone; a SIGINT to it (Ctrl-C) stops the call at its next look around
    # instead of after the timeout: KeyboardInterrupt on the main thread, and the rank
    # leaves, so the others' next call raises at once. The same for a call that wait()
    # runs in the main thread, the worker not having started it (CallQueue::run_here).
    ring = a_ring_over(wire, monkeypatch)
    if mode != "blocking" and not ring._executor.threaded:
        pytest.skip("MPI without MPI_THREAD_MULTIPLE: asynchronous calls run inline")
    ring.timeout = 60
    x = np.full(1 << 16, 1.0, np.float32)
    if RANK == 0:
        with ctrl_c_soon():
            if mode == "blocking":
                with pytest.raises(KeyboardInterrupt):
                    ring.allreduce(x)
            else:
                path = mode.split(", ")[1]
                by_wait = mode.endswith("run by wait()")
                with worker_held(ring, by_wait) as calls:
                    handle = ring.allreduce_async(async_input(path))
                    assert queued_by(path, handle)
                    with pytest.raises(KeyboardInterrupt):
                        handle.wait()  # interrupted in Python; the call stops on its own
                    assert calls.run_by_callers == 1 or not by_wait
                # (The call and the rank first, as in every call's error.)
                with pytest.raises(RuntimeError, match=r"^ringreduce\.allreduce_async \(rank 0 "
                                   r"of \d+\): interrupted \(SIGINT\)"):
                    handle.wait(10)
        assert ring._core.departed
        # Later calls say why, and that it was no MPI error (it once said it was).
        with pytest.raises(RuntimeError, match=r"^ringreduce\.allreduce \(rank 0 of \d+\): "
                           r"this ringreduce Communicator is unusable after an earlier error on "
                           r"this rank: interrupted \(SIGINT\)") as later:
            ring.allreduce(x)
        assert not isinstance(later.value, rr.MPIError)
        world.Barrier()
    else:
        world.Barrier()
        # (Ctrl-C among the reasons it gives: it named only errors, exceptions and close().)
        raised_within(10, r"rank 0 has left this communicator \(an error there, Ctrl-C, ",
                      lambda: ring.allreduce(x))
    closes_at_once(ring)
    world.Barrier()


@needs_two
@pytest.mark.parametrize("waited", ["FastPath", "Python"])
def test_ctrl_c_in_an_earlier_python_call_that_a_wait_runs_raises_from_that_wait(
        waited, world, monkeypatch):
    # A wait() runs the calls queued before its own in its thread (CallQueue::run_here).
    # Where Ctrl-C stops one of them that the Python layer queued, Python's handler
    # raises KeyboardInterrupt inside it, which that call kept as its own error: the
    # wait that ran it raised nothing, left its own call to the worker and raised what
    # that call met there (RuntimeError, the rank having left), or, with the worker
    # held, waited for it. It must raise KeyboardInterrupt, as where the worker runs
    # the calls; the interrupted call's own wait raises what the worker's would.
    ring = a_ring_over("shared memory", monkeypatch)
    if not ring._executor.threaded:
        pytest.skip("MPI without MPI_THREAD_MULTIPLE: asynchronous calls run inline")
    ring.timeout = 60
    x = np.full(1 << 16, 1.0, np.float32)
    if RANK == 0:
        with ctrl_c_soon():
            with worker_held(ring) as calls:
                first = ring.allreduce_async(async_input("Python"))
                second = ring.allreduce_async(async_input(waited))
                assert queued_by("Python", first) and queued_by(waited, second)
                with pytest.raises(KeyboardInterrupt):
                    second.wait()
                assert calls.run_by_callers == 1
        assert ring._core.departed
        for handle in (first, second):
            with pytest.raises(RuntimeError, match=r"interrupted \(SIGINT\)"):
                handle.wait(10)
        world.Barrier()
    else:
        world.Barrier()
        raised_within(10, r"rank 0 has left this communicator", lambda: ring.allreduce(x))
    closes_at_once(ring)
    world.Barrier()


@needs_two
def test_ctrl_c_still_stops_a_call_after_signal_signal_replaced_the_handler(world):
    # signal.signal(SIGINT, ...) after importing ringreduce replaces the handler that
    # counts SIGINTs for the core; making a Communicator puts it back in front.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ring = rr.Communicator(timeout=60)
        x = np.full(1 << 16, 1.0, np.float32)
        if RANK == 0:
            with ctrl_c_soon():
                with pytest.raises(KeyboardInterrupt):
                    ring.allreduce(x)
            world.Barrier()
        else:
            world.Barrier()
            raised_within(10, "rank 0 has left", lambda: ring.allreduce(x))
        closes_at_once(ring)
    finally:
        signal.signal(signal.SIGINT, previous)
    world.Barrier()


@needs_two
def test_a_sigint_handler_of_the_programs_own_decides_what_ctrl_c_does(world):
    # A graceful stop: the program's handler notes the SIGINT and the call in flight
    # goes on. (Installed before the Communicator was made, it once had the call
    # stopped, and the rank leave the communicator.)
    noted = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        ring = rr.Communicator(timeout=60)
        x = np.full(1 << 16, 1.0, np.float32)
        if RANK == 0:
            ctrl_c = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
            ctrl_c.start()
            result = ring.allreduce(x)  # the others join a second later
            ctrl_c.join()
            assert noted == [signal.SIGINT]
        else:
            time.sleep(1.0)
            result = ring.allreduce(x)
        assert (result == SIZE).all()
        ring.close()
    finally:
        signal.signal(signal.SIGINT, previous)
    world.Barrier()


@needs_two
def test_ctrl_c_stops_making_a_communicator_the_others_do_not_make(world):
    # Making one waits for every rank too: a SIGINT ends rank 0's wait at once
    # (KeyboardInterrupt), not after the timeout. The others, coming late, complete its
    # pending duplicate and give up in turn, as after a timeout there.
    if RANK == 0:
        with ctrl_c_soon(), pytest.raises(KeyboardInterrupt):
            rr.Communicator(timeout=60)
        world.Barrier()
    else:
        world.Barrier()
        waited_for("not every rank made its Communicator within 0.5 s",
                   lambda: rr.Communicator(timeout=TIMEOUT))
    world.Barrier()
    with rr.Communicator(timeout=30) as ring:  # and the next one works
        np.testing.assert_array_equal(ring.allreduce(np.ones(3)), np.full(3, SIZE))


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_calls_after_a_ctrl_c_that_came_between_calls_still_work(wire, world, monkeypatch):
    # Only a SIGINT during a call stops it: one that came before (and was handled) does not.
    ring = a_ring_over(wire, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # (the handler raises here, in Python)
    np.testing.assert_array_equal(ring.allreduce(np.ones(1 << 16)), np.full(1 << 16, SIZE))
    ring.close()


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_close_where_others_call_a_collective_raises_everywhere(wire, world, monkeypatch):
    ring = a_ring_over(wire, monkeypatch)
    x = np.full(16, 1.0, np.float32)
    if RANK == 0:
        with pytest.raises(rr.MismatchError, match="collective: close on rank 0; allreduce on"):
            ring.close()
        assert ring.closed
    else:
        with pytest.raises(rr.MismatchError, match="collective: close on rank 0; allreduce on"):
            ring.allreduce(x)
        # Rank 0 has left: this rank's calls raise at once, and close() frees nothing.
        with pytest.raises(rr.CollectiveTimeoutError, match="rank 0 has left"):
            ring.allreduce(x)
        closes_at_once(ring)
    world.Barrier()


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_close_raises_when_a_rank_never_closes(wire, world, monkeypatch):
    # close() times out like any call: it must say so, not return as if it had freed
    # everything (on shared memory it once took its own departure for another rank's).
    ring = a_ring_over(wire, monkeypatch)
    if RANK == 0:
        waited_for(r"ringreduce.close .*(not joined this call within 0.5 s|waited 0.5 s "
                   r"\(the timeout\) for every rank to join)", ring.close)
        assert ring.closed
        world.Barrier()
    else:
        world.Barrier()  # (rank 0 has given up)
        closes_at_once(ring)
    world.Barrier()


def test_close_waits_for_every_rank_and_frees(world):
    # The common case: ranks reach close() at different times, all within the timeout.
    ring = rr.Communicator(timeout=30)
    if RANK == SIZE - 1:
        time.sleep(0.3)
    ring.close()
    assert ring.closed
    with pytest.raises(ValueError, match="closed"):
        ring.allreduce(np.ones(4))
    world.Barrier()


@needs_two
@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
def test_a_stuck_gpu_makes_the_other_ranks_raise(direct, world):
    # The device ring over the host emulation; the last rank's first copy or kernel
    # takes longer than the timeout, as on a GPU stuck behind a long kernel.
    ring = rr.Communicator(timeout=30)  # (made in time on a busy machine too)
    ring.timeout = TIMEOUT
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
            # Back from the stall, it learns that the others gave up meanwhile.
            with pytest.raises(rr.CollectiveTimeoutError, match="has given up|has left"):
                allreduce()
        finally:
            _core.set_emulated_stall(0, 0)
    else:
        waited_for(RING_WAIT, allreduce)
    closes_at_once(ring)
    relayed_waits_checked(world)


@needs_two
def test_a_long_call_that_keeps_moving_never_times_out(world):
    # Every rank's emulated GPU is slow: every copy and kernel takes 0.01 s, so the
    # call takes several timeouts, but chunks keep coming: the clock starts again at
    # each one. (Only one slow rank would leave the others waiting for its whole
    # reduce-scatter before the first all-gather chunk: a real stall.)
    ring = rr.Communicator(timeout=30)  # (made in time on a busy machine too)
    ring.timeout = TIMEOUT
    ring._core.device_host_reduce_bytes = 0  # the device ring, not the host path
    n = 16003
    x = np.arange(n, dtype=np.float32) + RANK
    out = np.empty_like(x)
    world.Barrier()
    _core.set_emulated_stall(1, 0.01, 1)
    start = time.monotonic()
    try:
        ring._core.allreduce_device(x.ctypes.data, out.ctypes.data, n, FLOAT32, SUM, 512,
                                    0, 0, 0, False, True)
    finally:
        _core.set_emulated_stall(0, 0)
    took = world.allreduce(time.monotonic() - start, op=MPI.MAX)
    assert took > 3 * TIMEOUT, f"the call took {took:.2f} s: too short to show anything"
    expected = SIZE * np.arange(n, dtype=np.float32) + SIZE * (SIZE - 1) / 2
    np.testing.assert_array_equal(out, expected)
    ring.close()
    world.Barrier()


@needs_two
def test_a_long_call_on_shared_memory_that_keeps_moving_never_times_out(world, monkeypatch):
    # As above, on the host ring over shared memory: rank 0 waits 0.05 s before each
    # chunk it sends, so the others, whose chunks wait on its chunks, idle between them
    # (reading the clock), and the call takes several timeouts in all. The clock must
    # start again at each chunk. (Every rank slowed alike would sleep at the same time,
    # and then find its chunk there: no idle turns, nothing tested.)
    ring = a_ring_over("shared memory", monkeypatch, chunk_bytes=2048)
    n = 1 << 14  # 64 KiB: past the header, 2048-byte chunks (some 32 sends or more)
    x = np.arange(n, dtype=np.float32) + RANK
    world.Barrier()
    _core.set_shm_send_pause(0.05 if RANK == 0 else 0)
    start = time.monotonic()
    try:
        out = ring.allreduce(x)
    finally:
        _core.set_shm_send_pause(0)
    took = world.allreduce(time.monotonic() - start, op=MPI.MAX)
    assert took > 3 * TIMEOUT, f"the call took {took:.2f} s: too short to show anything"
    expected = SIZE * np.arange(n, dtype=np.float32) + SIZE * (SIZE - 1) / 2
    np.testing.assert_array_equal(out, expected)
    ring.close()
    world.Barrier()


def test_timeout_values(monkeypatch):
    monkeypatch.delenv("RINGREDUCE_TIMEOUT", raising=False)  # (a harness may set it)
    with rr.Communicator() as ring:
        assert ring.timeout == communicator.DEFAULT_TIMEOUT
        ring.timeout = 2.5
        assert ring.timeout == 2.5
        ring.timeout = None
        assert ring.timeout is None
        with pytest.raises(ValueError, match=rf"Communicator\.timeout \(rank {RANK} of {SIZE}\)"):
            ring.timeout = -1
    for value in (None, float("inf"), 10 ** 400):  # (an int past float's range too)
        with rr.Communicator(timeout=value) as ring:
            assert ring.timeout is None
    # Any real number, as Handle.wait(timeout) takes (a Fraction was refused here).
    for value, seconds in ((Fraction(5, 2), 2.5), (np.float32(1.5), 1.5), (np.int8(3), 3.0)):
        with rr.Communicator(timeout=value) as ring:
            assert ring.timeout == seconds and type(ring.timeout) is float
    for bad, error in ((0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                       (-10 ** 400, ValueError),
                       ("5", TypeError), (True, TypeError)):
        with pytest.raises(error, match=rf"Communicator \(rank {RANK} of {SIZE}\): timeout"):
            rr.Communicator(timeout=bad)  # (on every rank: each raises its own error)
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "12.5")
    assert communicator._default_timeout() == 12.5
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "0")
    assert communicator._default_timeout() is None
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", " ")  # set but empty: as unset
    assert communicator._default_timeout() == 1800.0
    for bad in ("soon", "-5", "nan"):
        monkeypatch.setenv("RINGREDUCE_TIMEOUT", bad)
        with pytest.raises(ValueError, match=rf"\(rank {RANK} of {SIZE}\): RINGREDUCE_TIMEOUT"):
            rr.Communicator()  # (read when a Communicator is made)
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "7")
    with rr.Communicator() as ring:
        assert ring.timeout == 7
    with rr.Communicator(timeout=3) as ring:  # an explicit timeout wins
        assert ring.timeout == 3
    monkeypatch.delenv("RINGREDUCE_TIMEOUT")
    assert communicator._default_timeout() == 1800.0
    # help(Communicator) says where the default comes from
    default = inspect.signature(rr.Communicator).parameters["timeout"].default
    assert repr(default) == "$RINGREDUCE_TIMEOUT or 1800"


def test_a_wait_shorter_than_the_timeout_is_not_one(world):
    # A rank that arrives late, but within the timeout, is just late.
    with rr.Communicator(timeout=10 * TIMEOUT) as ring:  # (3 s for a rank held up more)
        if RANK == SIZE - 1:
            time.sleep(TIMEOUT * 2)
        x = np.full(1 << 16, 1.0, np.float32)
        np.testing.assert_array_equal(ring.allreduce(x), np.full(1 << 16, SIZE, np.float32))


def both_calls_summed_in_time(start, total, result, x):
    """The two drop tests' ending: the call on `b` and the one dropped on `a` both
    summed, well within their timeouts (20 s)."""
    assert time.monotonic() - start < 10
    np.testing.assert_array_equal(total, np.full(3, float(SIZE)))
    np.testing.assert_array_equal(result, np.full(x.shape, float(SIZE), np.float32))


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
@pytest.mark.parametrize("path", ["FastPath", "Python"])
def test_dropping_a_communicator_with_calls_in_flight_does_not_wait_for_them(
        path, wire, world, monkeypatch):
    # Rank 0 drops Communicator `a` (here in a garbage collection, which may run at any
    # allocation) while an allreduce on it waits for the others, who first wait for
    # rank 0 in a call on `b`. The drop must leave that call to the worker: waiting for
    # it there waited until the timeout (for good without one), as the others could not
    # get past their call on `b`.
    a, b = a_ring_over(wire, monkeypatch), a_ring_over(wire, monkeypatch)
    a.timeout = b.timeout = 20
    x = async_input(path)
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # (a is dropped unclosed)
        if RANK == 0:
            handle = a.allreduce_async(x)
            assert queued_by(path, handle)
            dropped = weakref.ref(a)
            del a
            gc.collect()
            assert dropped() is None  # (the handle keeps only what its call needs)
            total = b.allreduce(np.ones(3))
            result = handle.wait()
        else:
            total = b.allreduce(np.ones(3))
            result = a.allreduce_async(x).wait()
            del a
            gc.collect()
    both_calls_summed_in_time(start, total, result, x)
    b.close()
    world.Barrier()


@needs_two
@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_a_communicator_dropped_with_calls_in_flight_tells_the_others_once_they_are_over(
        wire, world, monkeypatch):
    # Rank 0 drops `a` with a call in flight (keeping its Handle, which keeps the core),
    # then calls `b`; the others make one call more on `a` before their call on `b`.
    # Once the call in flight is over, rank 0 must tell the others it has gone (it did
    # when the drop waited for the call; leaving it until exit stalled both ranks).
    a, b = a_ring_over(wire, monkeypatch), a_ring_over(wire, monkeypatch)
    a.timeout = b.timeout = 20
    x = np.full(1 << 16, 1.0, np.float32)
    rr._types.reduction_codes(np.dtype(np.float32), "sum", "test")  # (the FastPath's)
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # (a is dropped unclosed)
        if RANK == 0:
            handle = a.allreduce_async(x)
            del a
            gc.collect()
            total = b.allreduce(np.ones(3))
            result = handle.wait()
        else:
            result = a.allreduce_async(x).wait()
            raised_within(10, "rank 0 has stopped using this communicator without "
                          "closing it", lambda: a.allreduce(x))
            total = b.allreduce(np.ones(3))
            del a
            gc.collect()
    both_calls_summed_in_time(start, total, result, x)
    b.close()
    world.Barrier()
