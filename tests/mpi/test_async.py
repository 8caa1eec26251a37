"""allreduce_async, reduce_scatter_async, allgather_async and broadcast_async: many in
flight, results in order, errors at wait()."""
import collections
import gc
import os
import re
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from fractions import Fraction

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import _core, communicator, reference

from helpers import NumpyWithoutMemory, bitwise_equal, on_the_worker_without_python, rank_data, \
    worker_held

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()


def needs_a_worker(comm):
    if SIZE == 1:
        pytest.skip("one rank runs host calls at once")
    if not comm._executor.threaded:
        pytest.skip("MPI without MPI_THREAD_MULTIPLE: asynchronous calls run inline")


def test_calls_queued_without_python_and_with_it_run_in_order(comm):
    # Contiguous numpy arrays of a dtype and op seen before go to the worker from the
    # FastPath; others (strided, a dtype not seen yet) as Python work; blocking calls
    # between them queue behind them too. All in one order, on every rank.
    needs_a_worker(comm)
    a = rank_data(np.dtype(np.float32), 5000)
    b = rank_data(np.dtype(np.float64), 4000, salt=1)
    c = rank_data(np.dtype(np.int32), 3, salt=2)
    expected = [comm.allreduce(a), comm.allreduce(b[::2]), comm.allreduce(a, op="max"),
                comm.allreduce(c, op="prod")]
    out = np.empty_like(a)
    handles = [comm.allreduce_async(a), comm.allreduce_async(b[::2])]
    blocking = comm.allreduce(a, op="max")
    handles += [comm.allreduce_async(c, op="prod"), comm.allreduce_async(a, out=out)]
    gathered = comm.allgather(np.array([RANK]))
    assert [on_the_worker_without_python(h) for h in handles] == [True, False, True, True]
    # They finish in the order they were made: whatever is done is always a prefix.
    while not handles[-1].done():
        done = [h.done() for h in handles]
        assert done == sorted(done, reverse=True), done
        time.sleep(0.0001)
    assert handles[3].wait() is out
    for h, want in zip(handles, [expected[0], expected[1], expected[3], expected[0]]):
        assert bitwise_equal(h.wait(), want)
    assert bitwise_equal(blocking, expected[2])
    np.testing.assert_array_equal(gathered, np.arange(SIZE))


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "broadcast"])
def test_calls_on_the_worker_finish_while_this_thread_holds_the_gil(comm, collective):
    # The worker needs no GIL for an allreduce, reduce_scatter or broadcast of host
    # arrays: the calls finish while this thread runs Python without a pause. A worker
    # that took the GIL before or after each call (as a Python thread does) would wait
    # out the switch interval, set here to 5 s, for every one of them.
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float32), 1 << 16)
    if collective == "broadcast":
        expected = comm.broadcast(x.copy(), root=0)
        start_one = lambda: comm.broadcast_async(x.copy(), root=0)  # noqa: E731
    else:
        expected = getattr(comm, collective)(x)
        start_one = lambda: getattr(comm, collective + "_async")(x)  # noqa: E731
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        start = time.monotonic()
        handles = [start_one() for _ in range(4)]
        while not handles[-1].done() and time.monotonic() - start < 4:
            pass
        done = handles[-1].done()
    finally:
        sys.setswitchinterval(interval)
    assert all(on_the_worker_without_python(h) for h in handles)
    assert done, "the worker waited for this thread's GIL"
    for h in handles:
        assert bitwise_equal(h.wait(), expected)


def test_many_in_flight_waited_in_any_order(small_chunks, comm):
    inputs = [rank_data(np.dtype(dt), n, salt=i)
              for i, (dt, n) in enumerate([(np.float32, 1000), (np.int64, 3), (np.float64, 0),
                                           (np.float16, 4097), (np.complex64, 50)] * 4)]
    expected = [comm.allreduce(x) for x in inputs]
    handles = [small_chunks.allreduce_async(x) for x in inputs]
    for handle, want in reversed(list(zip(handles, expected))):
        assert bitwise_equal(handle.wait(), want)
        assert handle.done()
        assert bitwise_equal(handle.wait(), want)  # waiting twice gives the same array


def test_async_in_place_and_out(comm):
    x = rank_data(np.dtype(np.float64), 300)
    expected = comm.allreduce(x, op="avg")
    out = np.empty_like(x)
    h1 = comm.allreduce_async(x, op="avg", out=out)
    buf = x.copy()
    h2 = comm.allreduce_async(buf, op="avg", out=buf)
    assert h1.wait() is out and h2.wait() is buf
    assert bitwise_equal(out, expected) and bitwise_equal(buf, expected)


def test_blocking_calls_queue_behind_async_ones(comm):
    a = rank_data(np.dtype(np.float32), 100_000)
    b = rank_data(np.dtype(np.float32), 10, salt=1)
    ha = comm.allreduce_async(a)
    yb = comm.allreduce(b)  # must not overtake ha on any rank
    hc = comm.allreduce_async(b, op="max")
    g = comm.allgather(np.array([RANK]))
    assert bitwise_equal(ha.wait(), comm.allreduce(a))
    assert bitwise_equal(yb, comm.allreduce(b))
    assert bitwise_equal(hc.wait(), comm.allreduce(b, op="max"))
    np.testing.assert_array_equal(g, np.arange(SIZE))


def test_mismatch_surfaces_at_wait_and_the_queue_goes_on(comm):
    if SIZE < 2:
        pytest.skip("needs two ranks to disagree")
    comm.allreduce(np.ones(3))  # (float64 sums seen before: the FastPath queues them)
    first = comm.allreduce_async(rank_data(np.dtype(np.float32), 20))
    bad = comm.allreduce_async(np.ones(5 + RANK))
    after = comm.allreduce_async(np.ones(5))
    assert first.wait().shape == (20,)
    with pytest.raises(rr.MismatchError, match="count") as raised:
        bad.wait()
    with pytest.raises(rr.MismatchError) as again:
        bad.wait()
    assert again.value is raised.value  # one error, as a _Work keeps it
    for info in (raised, again):  # (wait() once, then where the call ran)
        assert [frame.name for frame in traceback.extract_tb(info.tb)].count("wait") == 1
    assert on_the_worker_without_python(bad) == comm._executor.threaded
    np.testing.assert_array_equal(after.wait(), np.full(5, float(SIZE)))


def _every_async_call(comm, salt=0):
    """Calls of every kind, each made with its _async form and blocking: (name, start,
    expected), where start() makes the asynchronous call and returns (its Handle, what
    its wait() must return, or None for a new array), and expected is the blocking
    call's result (computed now, with nothing in flight)."""
    calls = []
    for n, dtype in ((0, np.float32), (7, np.int64), (1003, np.float64), (4097, np.float16)):
        x = rank_data(np.dtype(dtype), n, salt=salt + n)
        calls.append((f"reduce_scatter {n} {dtype.__name__}", x,
                      lambda x=x: (comm.reduce_scatter_async(x), None),
                      comm.reduce_scatter(x)))
    x = rank_data(np.dtype(np.float32), 2000, salt=salt + 1)[::2]  # (strided: copied)
    out = np.empty(len(np.array_split(np.empty(1000), SIZE)[RANK]), np.float32)
    calls.append(("reduce_scatter max out=", x,
                  lambda: (comm.reduce_scatter_async(x, op="max", out=out), out),
                  comm.reduce_scatter(x, op="max")))
    rows = (RANK * 2 + 1) % 4  # (one rank with none, on 4)
    y = rank_data(np.dtype(np.int32), rows * 6, salt=salt + 2).reshape(rows, 2, 3)
    calls.append(("allgather rows", y, lambda: (comm.allgather_async(y), None),
                  comm.allgather(y)))
    total = sum((r * 2 + 1) % 4 for r in range(SIZE))
    gathered = np.empty((total, 2, 3), np.int32)
    calls.append(("allgather out=", y, lambda: (comm.allgather_async(y, out=gathered), gathered),
                  comm.allgather(y)))
    scalar = np.float64(RANK + 0.5)
    calls.append(("allgather 0-d", scalar, lambda: (comm.allgather_async(scalar), None),
                  comm.allgather(scalar)))
    for root in range(SIZE):
        z = rank_data(np.dtype(np.complex64), 5000, salt=salt + 10 + root)
        want = comm.broadcast(z.copy(), root=root)
        calls.append((f"broadcast root {root}", z, lambda z=z, root=root:
                      (comm.broadcast_async(z, root=root), z), want))
    return calls


def test_every_collective_has_an_async_form_that_gives_the_blocking_result(small_chunks, comm):
    # Each in flight with the others, with allreduce_async and blocking calls between
    # them, and waited for in reverse order: the same bits as the blocking call's.
    for ring in (small_chunks, comm):
        calls = _every_async_call(ring)
        a = rank_data(np.dtype(np.float32), 3000, salt=99)
        a_sum, a_max = ring.allreduce(a), ring.allreduce(a, op="max")
        started = []
        for k, (name, x, start, want) in enumerate(calls):
            started.append((name, *start(), want))
            if k % 3 == 0:
                started.append(("allreduce_async", ring.allreduce_async(a), None, a_sum))
            if k % 4 == 1:  # (a blocking call queues behind them)
                assert bitwise_equal(ring.allreduce(a, op="max"), a_max)
        for name, handle, returns, want in reversed(started):
            got = handle.wait()
            assert handle.done()
            if returns is not None:
                assert got is returns, name
            assert bitwise_equal(got, want), name
            assert handle.wait() is got  # (waiting twice gives the same array)


def test_async_collectives_match_the_reference_ring(comm):
    x = rank_data(np.dtype(np.float64), 10_007, salt=3)
    handles = [comm.reduce_scatter_async(x, op=op) for op in ("sum", "prod", "min", "avg")]
    for op, handle in zip(("sum", "prod", "min", "avg"), handles):
        assert bitwise_equal(handle.wait(), reference.reduce_scatter(x, op)), op
    y = rank_data(np.dtype(np.int16), 3 * (RANK + 1), salt=4).reshape(RANK + 1, 3)
    np.testing.assert_array_equal(comm.allgather_async(y).wait(), reference.allgather(y))


def test_calls_of_every_kind_finish_in_the_order_they_were_made(comm):
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float32), 200_000)
    if RANK == SIZE - 1:
        time.sleep(0.3)  # (so that on the other ranks several are still queued)
    handles = [comm.allreduce_async(x), comm.reduce_scatter_async(x), comm.allgather_async(x),
               comm.broadcast_async(x.copy(), root=SIZE - 1), comm.reduce_scatter_async(x[::2]),
               comm.allreduce_async(x, op="max")]
    while not handles[-1].done():
        done = [h.done() for h in handles]
        assert done == sorted(done, reverse=True), done
        time.sleep(0.0001)
    assert bitwise_equal(handles[3].wait(), MPI.COMM_WORLD.bcast(x, root=SIZE - 1))
    assert handles[2].wait().shape == (SIZE * x.size,)


def test_bad_arguments_to_an_async_collective_raise_at_the_call_on_that_rank_only(comm):
    # The others' calls are made, and their waits raise MismatchError naming the rank
    # (as for a blocking call: the rank that rejected its arguments still joins the
    # call's header exchange); the calls after go on.
    pending = comm.allreduce_async(np.ones(1000))
    x = np.arange(12.0)
    bad = {"reduce_scatter_async": lambda: comm.reduce_scatter_async(x, op="nope"),
           "allgather_async": lambda: comm.allgather_async(x, out=np.empty(3, np.int8)),
           "broadcast_async": lambda: comm.broadcast_async(x.astype(">f8"))}
    good = {"reduce_scatter_async": lambda: comm.reduce_scatter_async(x),
            "allgather_async": lambda: comm.allgather_async(x),
            "broadcast_async": lambda: comm.broadcast_async(x.copy())}
    for name in bad:
        if RANK == 0:
            with pytest.raises((ValueError, TypeError),
                               match=rf"^ringreduce\.{name} \(rank 0 of {SIZE}\): "):
                bad[name]()
        else:
            handle = good[name]()
            with pytest.raises(rr.MismatchError, match=rf"^ringreduce\.{name}\b.*rank 0"):
                handle.wait()
    np.testing.assert_array_equal(pending.wait(), np.full(1000, float(SIZE)))
    np.testing.assert_array_equal(comm.allgather_async(np.array([RANK])).wait(),
                                  np.arange(SIZE))


def test_ranks_that_start_different_async_calls_all_raise_at_wait(comm):
    if SIZE < 2:
        pytest.skip("needs two ranks to disagree")
    x = np.arange(12.0)
    roots = comm.broadcast_async(x.copy(), root=RANK)
    kinds = comm.allgather_async(x) if RANK == 0 else comm.reduce_scatter_async(x)
    after = comm.reduce_scatter_async(x)
    with pytest.raises(rr.MismatchError, match=r"^ringreduce\.broadcast_async: ranks disagree"
                                               r".*root: 0 on rank 0; 1 on rank 1"):
        roots.wait()
    with pytest.raises(rr.MismatchError):
        kinds.wait()
    assert bitwise_equal(after.wait(), reference.reduce_scatter(x, "sum"))


def test_async_collectives_wait_with_a_timeout(comm):
    if SIZE == 1:
        pytest.skip("needs a rank to wait for")
    x = np.ones(1000)
    if RANK == SIZE - 1:
        time.sleep(0.5)  # the others' calls wait for this rank's
    handles = {"reduce_scatter_async": comm.reduce_scatter_async(x),
               "allgather_async": comm.allgather_async(x),
               "broadcast_async": comm.broadcast_async(x.copy())}
    for name, handle in handles.items():
        try:
            handle.wait(timeout=0.01)
            assert RANK == SIZE - 1 or name != "reduce_scatter_async", \
                "done before the last rank started it"
        except TimeoutError as error:
            assert f"ringreduce.{name} (rank {RANK} of {SIZE}): still running" in str(error)
        handle.wait(timeout=60)
    assert bitwise_equal(handles["allgather_async"].wait(), np.ones(SIZE * 1000))


def test_module_level_async_collectives(world):
    x = rank_data(np.dtype(np.float32), 999, salt=5)
    handles = [rr.reduce_scatter_async(x), rr.allgather_async(x, comm=world),
               rr.broadcast_async(x.copy(), root=SIZE - 1)]
    assert bitwise_equal(handles[0].wait(), reference.reduce_scatter(x, "sum"))
    assert bitwise_equal(handles[1].wait(), np.concatenate(world.allgather(x)))
    assert bitwise_equal(handles[2].wait(), world.bcast(x, root=SIZE - 1))
    assert {"reduce_scatter_async", "allgather_async", "broadcast_async"} <= set(rr.__all__)


@pytest.mark.parametrize("held_on", ["every rank", "rank 0"])
def test_a_wait_runs_the_calls_the_worker_has_not_started(held_on, small_chunks):
    # A caller that would only sleep until the worker is done runs its call itself, and
    # those queued before it, in order, where the worker has not started them: on ranks
    # that share a core between the two threads, every call handed over costs two
    # context switches. The same results either way, and on ranks whose worker runs
    # them meanwhile.
    comm = small_chunks
    needs_a_worker(comm)
    inputs = [(rank_data(np.dtype(np.float32), 1000), "sum"),
              (rank_data(np.dtype(np.int64), 7, salt=1), "max"),
              (rank_data(np.dtype(np.float64), 300, salt=2), "avg"),
              (rank_data(np.dtype(np.float16), 33, salt=3), "prod")]
    expected = [comm.allreduce(x, op=op) for x, op in inputs]
    held = held_on == "every rank" or RANK == 0
    with worker_held(comm, held) as calls:
        before = calls.run_by_callers
        in_place = inputs[2][0].copy()
        handles = [comm.allreduce_async(x, op=op) for x, op in inputs[:2]]
        handles.append(comm.allreduce_async(in_place, op="avg", out=in_place))
        handles.append(comm.allreduce_async(inputs[3][0], op="prod"))
        assert all(on_the_worker_without_python(h) for h in handles)
        if held:
            time.sleep(0.05)  # (a worker that took one would have by now)
            assert not any(h.done() for h in handles) and calls.pending() == 4
        assert handles[2].wait() is in_place  # runs the two before it, not the one after
        if held:
            assert [h.done() for h in handles] == [True, True, True, False]
            assert calls.run_by_callers - before == 3
        for h, want in zip(handles, expected):
            assert bitwise_equal(h.wait(), want)
        if held:  # (a call the worker ran leaves the queue a moment after it is done)
            assert calls.pending() == 0


def test_a_wait_leaves_the_calls_queued_after_its_own_to_the_worker(world):
    # One may wait for ranks that wait for what this rank does once the wait returns:
    # here rank 0 queues two calls, and rank 1 makes its second only after a message
    # rank 0 sends after its first wait. A wait that ran both would wait for rank 1 in
    # the second, and rank 1 for it in its receive, until the timeout.
    if SIZE < 2:
        pytest.skip("needs two ranks")
    with rr.Communicator(world, timeout=10) as ring:
        needs_a_worker(ring)
        x = np.ones(1000, np.float32)
        for _ in range(5):
            if RANK == 0:
                with worker_held(ring):
                    first, second = ring.allreduce_async(x), ring.allreduce_async(x)
                    first.wait()
                    assert not second.done()
                world.send("first done", dest=1)
                np.testing.assert_array_equal(second.wait(), np.full(1000, float(SIZE)))
            else:
                np.testing.assert_array_equal(ring.allreduce_async(x).wait(),
                                              np.full(1000, float(SIZE)))
                if RANK == 1:
                    assert world.recv(source=0) == "first done"
                np.testing.assert_array_equal(ring.allreduce_async(x).wait(),
                                              np.full(1000, float(SIZE)))


def test_a_wait_with_a_timeout_leaves_the_calls_to_the_worker(comm):
    # A wait with a timeout must return by then, which running a call of the ring
    # would not promise.
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float32), 100)
    expected = comm.allreduce(x)
    with worker_held(comm) as calls:
        before = calls.run_by_callers
        handle = comm.allreduce_async(x)
        with pytest.raises(TimeoutError, match="still running") as info:
            handle.wait(0.05)
        # The built-in one: the call goes on (a CollectiveTimeoutError would say that
        # the Communicator is unusable).
        assert type(info.value) is TimeoutError
        assert not handle.done() and calls.run_by_callers == before
    assert bitwise_equal(handle.wait(), expected)


def test_a_call_waited_for_with_a_timeout_is_not_in_flight_once_its_wait_returns(comm):
    # The worker takes a call off its queue only after the call's waiter has been told
    # it is done; sharing a core with that waiter, it may do so a time slice later. A
    # blocking call made meanwhile must still run at once in this thread (the FastPath)
    # rather than queue behind a call that is over (25-33 us instead of 1 us on 2 ranks
    # here). Counted: how often the finished call was still on the queue.
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float32), 1024)
    y = rank_data(np.dtype(np.float64), 2, salt=1)
    expected_x, expected_y = comm.allreduce(x), comm.allreduce(y)
    executor = comm._executor
    still_queued = 0
    for attempt in range(300):
        handle = comm.allreduce_async(x)
        assert handle.wait(timeout=60) is not None
        queued = executor.calls.pending()
        assert not executor.in_flight and executor.calls.unfinished() == 0, attempt
        still_queued += queued > 0
        assert bitwise_equal(comm.allreduce(y), expected_y), attempt
        assert bitwise_equal(handle.wait(), expected_x), attempt
    print(f"[rank {RANK}] finished calls still on the queue after their wait: "
          f"{still_queued} of 300")


def test_a_wait_with_a_timeout_returns_once_the_worker_has_let_go(comm):
    # A call's waiters are told it is over only once the worker has let go of the
    # running lock: woken while the worker still held it (which, sharing a core with the
    # worker, the waiter usually was), a blocking call made next (the loss after the
    # gradients) slept until the worker let go, two context switches more. Counted: how
    # often the worker held it still, which must be never.
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float32), 2)
    expected = comm.allreduce(x)
    running = comm._executor.running
    held = 0
    for attempt in range(300):
        handle = comm.allreduce_async(x)
        assert bitwise_equal(handle.wait(timeout=60), expected), attempt
        if running.acquire(blocking=False):
            running.release()
        else:
            held += 1
    assert held == 0, f"the worker still held the running lock after {held} of 300 waits"


def test_a_call_queued_without_waking_the_worker_still_runs_unwaited(comm):
    # A worker kept out by a caller that runs calls waits out its turn (200 us) without
    # being woken by the calls queued meanwhile that a caller may run: the caller that
    # queues one usually waits for it next. One that nobody waits for must still run,
    # on every rank (the others wait in it), and a wait with a timeout, which leaves it
    # to the worker, must get it. Many tries: the turn is short and not every call
    # meets it (counted by turns_unwoken; the test holds either way).
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float64), 64)
    expected = comm.allreduce(x)
    calls = comm._executor.calls
    before = calls.turns_unwoken
    for attempt in range(300):
        for _ in range(4):  # (each run here, as the worker looks on)
            assert bitwise_equal(comm.allreduce_async(x).wait(), expected)
        unwaited = comm.allreduce_async(x)
        if attempt % 2:
            assert bitwise_equal(unwaited.wait(timeout=60), expected), attempt
            continue
        # Polled with sleeps, no wait and no ringreduce call: a loop that spun instead
        # kept the cores from the ranks' workers, which on 3 ranks of a loaded 2-core
        # machine once took more than 10 s to get this call done. A call never started
        # would never be done: the deadline only keeps such a failure from hanging.
        deadline = time.monotonic() + 60
        while not unwaited.done() and time.monotonic() < deadline:
            time.sleep(0.0002)
        assert unwaited.done(), attempt
        assert bitwise_equal(unwaited.wait(), expected)
    print(f"[rank {RANK}] calls queued while the worker took its turn: "
          f"{calls.turns_unwoken - before} of 1500")


def test_a_wait_runs_the_python_layers_calls_on_host_arrays_too(comm):
    # The Python layer's calls on host arrays (strided inputs, here) run in a waiting
    # thread as the FastPath's do: handed to the worker, each cost two
    # context switches and two handovers of the GIL (some 150 us a step of eight 8-byte
    # reduce_scatter_async calls on 2 ranks that share a core with their workers,
    # against some 100 us).
    needs_a_worker(comm)
    a = rank_data(np.dtype(np.float64), 4000)
    b = rank_data(np.dtype(np.float32), 50, salt=1)
    expected = [comm.allreduce(a[::2]), comm.allgather(a[::3]), comm.allreduce(b)]
    with worker_held(comm) as calls:
        before = calls.run_by_callers
        handles = [comm.allreduce_async(a[::2]), comm.allgather_async(a[::3]),
                   comm.allreduce_async(b)]
        assert [on_the_worker_without_python(h) for h in handles] == [False, False, True]
        assert bitwise_equal(handles[2].wait(), expected[2])
        assert calls.run_by_callers - before == 3
    for h, want in zip(handles, expected):
        assert bitwise_equal(h.wait(), want)


def test_a_wait_behind_work_that_needs_the_worker_leaves_the_calls_to_it(comm):
    # Work that needs the worker's thread (a call on a GPU, whose current device and
    # streams are the worker's) stops a wait from running the calls behind it.
    needs_a_worker(comm)
    b = rank_data(np.dtype(np.float32), 50, salt=1)
    expected = comm.allreduce(b)
    with worker_held(comm) as calls:
        before = calls.run_by_callers
        needs_the_worker = comm._run("test", lambda: "ran", wait=False, at_once=False)
        handle = comm.allreduce_async(b)
        assert on_the_worker_without_python(handle)
        release = threading.Timer(0.2, calls.hold_worker, (False,))
        release.start()
        try:
            assert bitwise_equal(handle.wait(), expected)
        finally:
            release.join()
        assert calls.run_by_callers == before
    assert needs_the_worker.wait() == "ran"


def test_bad_arguments_raise_at_the_call(comm):
    pending = comm.allreduce_async(np.ones(1000))
    with pytest.raises(ValueError, match=rf"^ringreduce\.allreduce_async \(rank {RANK} of "
                                         rf"{SIZE}\): op 'nope' is not one of"):
        comm.allreduce_async(np.ones(3), op="nope")
    with pytest.raises(TypeError, match=r"^ringreduce\.allreduce_async .*which is not supported"):
        comm.allreduce_async(np.ones(3, np.longdouble))
    np.testing.assert_array_equal(pending.wait(), np.full(1000, float(SIZE)))


def test_wait_with_timeout_and_done(comm):
    h = comm.allreduce_async(np.ones(10))
    np.testing.assert_array_equal(h.wait(timeout=60), np.full(10, float(SIZE)))
    assert h.done()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (np.float16 compared with threading's limit warned)
        for forever in (float("inf"), 1e300, 2 ** 2000, np.float16(60000)):  # (beyond what
            # threading can wait: forever)
            np.testing.assert_array_equal(h.wait(timeout=forever), np.full(10, float(SIZE)))
    for bad, error in [(-1, ValueError), (float("nan"), ValueError), ("1", TypeError),
                       (True, TypeError)]:
        with pytest.raises(error, match=rf"ringreduce\.allreduce_async \(rank {RANK} of "
                                        rf"{SIZE}\): Handle\.wait: timeout must be"):
            h.wait(bad)  # checked even when the call is done


def test_wait_takes_any_real_number_of_seconds(comm):
    # As threading's own waits take only int and float: numpy's and Fraction's seconds
    # must reach them as floats, on the FastPath's handles and the Python layer's alike.
    if SIZE == 1:
        pytest.skip("needs a rank to wait for")
    comm.allreduce(np.ones(3))
    for x in (np.ones(1000), np.ones(2000)[::2]):  # the FastPath's call, then a _Work
        if RANK == SIZE - 1:
            time.sleep(0.5)  # the others' calls wait for this rank's
        h = comm.allreduce_async(x)
        try:
            h.wait(timeout=np.float32(0.01))
            assert RANK == SIZE - 1, "done before the last rank started it"
        except TimeoutError as error:
            assert f"ringreduce.allreduce_async (rank {RANK} of {SIZE}): still running" \
                in str(error)
        np.testing.assert_array_equal(h.wait(timeout=Fraction(60)), np.full(1000, float(SIZE)))


@pytest.mark.parametrize("collective", ["allreduce", "allreduce_async", "reduce_scatter",
                                        "allgather", "broadcast"])
@pytest.mark.parametrize("layout", ["strided", "other byte order"])
def test_a_queued_call_reads_its_input_after_the_calls_before_it(collective, layout, comm):
    # Calls run in order, and each reads x as it runs: also an x that must be copied
    # first (strided, or not in native byte order), which was once copied when the call
    # was made, before the call queued ahead of it had written the memory x views.
    needs_a_worker(comm)
    if layout == "other byte order" and collective == "broadcast":
        pytest.skip("broadcast works in place and takes native byte order only")
    dtype = np.dtype(np.int32)
    a = rank_data(dtype, 100_000)
    reduced = comm.allreduce(a)  # (int32 sums: the FastPath queues the next one)

    def view(b):
        return b[::2] if layout == "strided" else b.view(dtype.newbyteorder())

    def run(x):
        if collective == "allreduce_async":
            return comm.allreduce_async(x).wait()
        if collective == "broadcast":
            return comm.broadcast(x, root=0).copy()
        return getattr(comm, collective)(x)

    want = run(view(reduced.copy()))  # with nothing in flight
    b = a.copy()
    if RANK == SIZE - 1:
        time.sleep(0.3)  # so that on the other ranks the first call is still waiting
    first = comm.allreduce_async(b, out=b)
    assert on_the_worker_without_python(first)
    got = run(view(b))
    assert first.wait() is b
    assert bitwise_equal(got, want)
    if collective == "broadcast":
        assert bitwise_equal(b, reduced)  # root's, which is this rank's


def test_a_strided_x_is_copied_only_once_the_call_before_it_is_over(comm, world):
    # (From a review.) The FastPath copied a strided x before it looked for calls in
    # flight: a call queued before, whose out= x views, that ended during the copy left
    # it stale, and the blocking call ran on it (10 of 10 wrong with these sizes). The
    # last rank joins the first call a little late, so that it ends mid-copy.
    needs_a_worker(comm)
    count = 1 << 22  # (a copy of 16 MiB: some milliseconds)
    wrong = 0
    for _ in range(5):
        m = np.ones(2 * count, np.float32)
        a = m[:1024]  # the first call's x and out; the second reads it, strided
        world.Barrier()
        if RANK == SIZE - 1:
            time.sleep(0.002)
        first = comm.allreduce_async(a, out=a)
        got = comm.allreduce(m[::2])
        first.wait()
        wrong += not np.all(got[:512] == SIZE * SIZE)
        assert np.all(got[512:] == SIZE)
    assert wrong == 0, f"{wrong} of 5 read a before the first call had written it"


def test_close_refuses_calls_other_threads_make_meanwhile(world):
    # close() lets the calls in flight finish; another thread that goes on making calls
    # meanwhile must not keep it from ever getting its turn (it once did).
    if SIZE == 1:
        pytest.skip("one rank runs host calls at once: nothing stays in flight")
    ring = rr.Communicator(timeout=20)
    ring.allreduce(np.ones(8))
    refused = []
    give_up_at = time.monotonic() + 60  # (so that a failure does not hang the job)

    def make_calls():
        # At most 64 in flight: the calls queued before the close runs on every rank
        # before it, and an unbounded queue (one started every few microseconds, each
        # run in tens) made the close take 44-83 s on a loaded machine. Still, without
        # the refusal this thread would go on adding calls for good.
        x = np.ones(8)
        in_flight = collections.deque()
        while time.monotonic() < give_up_at:
            try:
                in_flight.append(ring.allreduce_async(x))
            except ValueError as error:
                refused.append(error)
                for handle in in_flight:  # (not dropped unwaited: see DroppedErrorWarning)
                    try:
                        handle.wait()
                    except (rr.MismatchError, rr.CollectiveTimeoutError, ValueError):
                        pass
                return
            if len(in_flight) > 64:
                try:
                    in_flight.popleft().wait()
                except (rr.MismatchError, rr.CollectiveTimeoutError):
                    pass  # (see the close below)

    caller = threading.Thread(target=make_calls)
    caller.start()
    time.sleep(0.2)
    start = time.monotonic()
    try:
        ring.close()
    except (rr.MismatchError, rr.CollectiveTimeoutError):
        pass  # the ranks' threads made different numbers of calls before the close
    took = time.monotonic() - start
    caller.join()
    assert ring.closed
    # Milliseconds here; not until the caller gave up (60 s), nor by the timeout (20 s).
    assert took < 10, took
    assert refused and re.search("being closed|has been closed", str(refused[0])), refused
    world.Barrier()


def test_a_call_past_the_closed_check_when_close_begins_is_refused_at_the_call(world):
    # A thread may read ring._fast, or pass _call()'s check of _closing, just before
    # another thread's close() begins. Its call must then raise at once: not be queued
    # after the drain (to run into the close's exchange, or on a freed communicator,
    # raising only at its wait), nor run in its own thread before the close. Staged here
    # by holding the running lock, which keeps the close from going past its drain, and
    # making those calls as such a thread would have.
    if SIZE == 1:
        pytest.skip("one rank runs host calls at once: nothing stays in flight")
    ring = rr.Communicator(timeout=20)
    x = np.ones(8)
    ring.allreduce(x)
    stale_fast = ring._fast
    assert stale_fast is not None
    context = ring._contexts["allreduce"]
    errors = []

    def close():
        try:
            ring.close()
        except BaseException as error:  # (asserted below, on the main thread)
            errors.append(error)

    closer = threading.Thread(target=close)
    with ring._executor.running:
        closer.start()
        deadline = time.monotonic() + 20
        while not ring._executor.calls.refusing() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ring._executor.calls.refusing()
        pending_before = ring._executor.calls.pending()
        assert stale_fast.allreduce_async(x, "sum", None, 0) is None
        assert stale_fast.allreduce(x, "sum", None, 0) is None
        assert ring._executor.calls.pending() == pending_before
        for wait, at_once in [(False, False), (True, True)]:
            with pytest.raises(ValueError, match=r"being closed \(by another thread\)"):
                ring._run(context, lambda: None, wait=wait, at_once=at_once)
        with pytest.raises(ValueError, match="being closed"):
            ring.allreduce_async(x)
    closer.join(30)
    assert not closer.is_alive() and not errors, errors
    assert ring.closed
    with pytest.raises(ValueError, match="has been closed"):
        ring.allreduce(x)
    world.Barrier()


def test_python_keeps_running_while_the_ring_works(comm):
    # The core releases the GIL: a Python loop on this thread runs while a large
    # allreduce is in flight on the worker thread.
    x = rank_data(np.dtype(np.float64), 4_000_000)
    h = comm.allreduce_async(x)
    spins = 0
    while not h.done():
        spins += 1
    assert h.wait().shape == x.shape
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE and SIZE > 1:
        assert spins > 0


def test_close_finishes_work_in_flight(world):
    ring = rr.Communicator()
    handles = [ring.allreduce_async(np.full(1000, float(i))) for i in range(5)]
    others = [ring.reduce_scatter_async(np.full(1000, 1.0)), ring.allgather_async(np.ones(3)),
              ring.broadcast_async(np.full(4, float(RANK)), root=SIZE - 1)]
    ring.close()
    for i, h in enumerate(handles):
        assert h.done()
        np.testing.assert_array_equal(h.wait(), np.full(1000, float(i * SIZE)))
    assert all(h.done() for h in others)
    assert (others[0].wait() == SIZE).all() and others[1].wait().shape == (3 * SIZE,)
    np.testing.assert_array_equal(others[2].wait(), np.full(4, SIZE - 1.0))


def test_one_rank_async_calls_are_done_when_they_return():
    # One rank waits for no one: no worker thread, no handoff (some 7 us a call).
    if SIZE > 1:
        pytest.skip("one rank only")
    with rr.Communicator(MPI.COMM_WORLD) as comm:
        x = rank_data(np.dtype(np.float64), 100)
        x[3] = np.nan  # (x / 1 keeps a NaN's bits, as the blocking call does)
        handles = [comm.allreduce_async(x, op=op) for op in ("sum", "avg", "max")]
        # Once a dtype and op were seen, the FastPath does it (a copy), without Python.
        handles += [comm.allreduce_async(x, op=op) for op in ("sum", "avg", "max")]
        assert [on_the_worker_without_python(h) for h in handles[3:]] == [True] * 3
        out = np.empty_like(x)
        handles.append(comm.allreduce_async(x, out=out))
        in_place = x.copy()
        handles.append(comm.allreduce_async(in_place, out=in_place))
        handles.append(comm.allreduce_async(x[::2]))  # (strided: the general path)
        assert all(h.done() for h in handles)
        assert all(bitwise_equal(h.wait(), x) for h in handles[:-1])
        assert handles[-3].wait() is out and handles[-2].wait() is in_place
        assert bitwise_equal(handles[-1].wait(), x[::2])
        assert handles[0].wait() is not x  # (a new array, as on any number of ranks)
        with pytest.raises(ValueError, match="op"):
            comm.allreduce_async(x, op="mean")
        assert not comm._executor.started
    with pytest.raises(ValueError, match="closed"):
        comm.allreduce_async(x)


def test_a_finished_call_keeps_no_arrays_but_its_result_in_its_handle():
    # Neither a Handle kept for its result nor the worker thread, once it is done,
    # keeps the call's input alive, nor its result once the Handle is dropped.
    with rr.Communicator(MPI.COMM_WORLD) as comm:
        for size in (10, 1 << 16):  # in the header exchange, and the ring
            x = rank_data(np.dtype(np.float64), size)
            x_alive = weakref.ref(x)
            handle = comm.allreduce_async(x)
            result = handle.wait()
            del x
            assert x_alive() is None
            result_alive = weakref.ref(result)
            del result, handle
            comm._executor.drain()  # (the worker is done with it once the queue is empty)
            assert result_alive() is None


def test_close_lets_a_call_another_thread_runs_end_first(world):
    # Rank 0 closes while a thread of its own waits in a call the others join later:
    # the close waits for that call, instead of sending its part of the close into the
    # call's exchange (before, both ranks timed out).
    if SIZE == 1:
        pytest.skip("needs another rank to wait for")
    comm = rr.Communicator(MPI.COMM_WORLD, timeout=10)
    x = np.full(1000, RANK + 1.0)
    expected = np.full(1000, SIZE * (SIZE + 1) / 2)
    if RANK == 0:
        results = []
        caller = threading.Thread(target=lambda: results.append(comm.allreduce(x)))
        caller.start()
        time.sleep(0.2)
        start = time.monotonic()
        comm.close()
        assert time.monotonic() - start < 5
        caller.join()
        assert bitwise_equal(results[0], expected)
    else:
        time.sleep(0.6)
        assert bitwise_equal(comm.allreduce(x), expected)
        comm.close()
    assert comm.closed
    world.Barrier()


def test_close_from_a_signal_handler_in_the_middle_of_a_call_does_not_hang():
    # A SIGALRM handler closes the Communicator while the main thread is in a call,
    # holding the lock close() takes (after a lock that was not reentrant, this hung
    # for good whenever the signal came while the core ran). A few tries, as the
    # signal may also come between calls.
    if SIZE > 1:
        pytest.skip("one rank: closing is collective")
    x = np.ones(1 << 22)[::2]  # strided: the general path, with a copy in the core call
    previous = signal.getsignal(signal.SIGALRM)
    try:
        for _ in range(5):
            comm = rr.Communicator(MPI.COMM_WORLD)
            signal.signal(signal.SIGALRM, lambda signum, frame: comm.close())
            signal.setitimer(signal.ITIMER_REAL, 0.01)
            with pytest.raises(ValueError, match="closed"):
                for _ in range(10_000):
                    comm.allreduce(x)
            assert comm.closed
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _signalling_after_its_call(comm, signum):
    """comm's next allreduce of the general path (only that one) raises signum in the
    middle of its call (once the core is done), where Python runs that signal's handler."""
    prepare = comm._prepare_allreduce

    def signalling(*args):
        del comm._prepare_allreduce  # (the class's again)
        run = prepare(*args)

        def run_then_signal():
            result = run()
            signal.raise_signal(signum)  # (its handler runs here, in this call)
            return result

        return run_then_signal

    comm._prepare_allreduce = signalling


def test_what_a_signal_handler_raises_in_a_call_a_wait_runs_for_a_later_one_is_raised_there(
        world):
    # Python runs the main thread's signal handlers in the middle of the Python layer's
    # calls that a wait() runs. What one raised there (SystemExit, from a SIGTERM
    # handler say) was kept as that call's error, and the wait of a later call went on
    # as if nothing had happened (the program did not exit). The wait raises it, and
    # runs no more calls (as a wait the worker's calls keep waiting raises it at once).
    comm = rr.Communicator(timeout=60)
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float64), 4000)
    expected = comm.allreduce(x)
    comm.allreduce(x[::2])  # (the dtype and op seen: the second goes on from the FastPath)

    def exiting(signum, frame):
        raise SystemExit(3)

    previous = signal.signal(signal.SIGUSR1, exiting)
    try:
        with worker_held(comm) as calls:
            _signalling_after_its_call(comm, signal.SIGUSR1)
            first = comm.allreduce_async(x[::2])
            second = comm.allreduce_async(x)
            assert [on_the_worker_without_python(h) for h in (first, second)] == [False, True]
            with pytest.raises(SystemExit, match="3"):
                second.wait()
            assert calls.run_by_callers == 1
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert bitwise_equal(second.wait(), expected)  # (the worker's)
    with pytest.raises(SystemExit, match="3"):
        first.wait()
    comm.close()


class _Hung(Exception):
    pass


def test_close_from_a_signal_handler_in_a_call_that_a_wait_runs_does_not_hang(world):
    # A wait() runs the Python layer's calls on host arrays in its own thread; Python
    # runs the main thread's signal handlers in the middle of such a call, as in a
    # blocking call. A handler that closes the Communicator there waited for good for
    # the queue to empty, the call it waited for being its own thread's (and the
    # worker waiting for that thread); it must close as from a blocking call: the call
    # goes on and ends, and the calls queued after it raise at their wait.
    comm = rr.Communicator(timeout=60)
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float64), 4000)
    expected = comm.allreduce(x[::2])

    def hung(signum, frame):
        raise _Hung("close() from the signal handler did not return within 10 s")

    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: comm.close())
    previous_usr2 = signal.signal(signal.SIGUSR2, hung)
    watchdog = threading.Timer(10, signal.pthread_kill,
                               (threading.main_thread().ident, signal.SIGUSR2))
    try:
        with worker_held(comm) as calls:
            _signalling_after_its_call(comm, signal.SIGUSR1)
            handle = comm.allreduce_async(x[::2])
            later = comm.allreduce_async(x)
            assert [on_the_worker_without_python(h) for h in (handle, later)] == [False, True]
            watchdog.start()
            assert bitwise_equal(handle.wait(), expected)
            assert calls.run_by_callers == 1
        assert comm.closed
        with pytest.raises(ValueError, match="closed"):
            later.wait(10)
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGUSR2, previous_usr2)
        comm.close()


@pytest.mark.parametrize("call", ["allreduce, FastPath", "allreduce, Python", "allgather"])
def test_a_blocking_call_from_a_signal_handler_in_a_call_that_a_wait_runs_does_not_hang(
        call, world):
    # As close() above: a handler that makes a blocking call on the Communicator in
    # the middle of a call that a wait() runs (to agree on a checkpoint at SIGTERM,
    # say, every rank's handler coming at the same point) queued it behind that call
    # and waited for the worker, which waited for this thread. It runs there and then,
    # as from a blocking call.
    comm = rr.Communicator(timeout=60)
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float64), 4000)
    expected = comm.allreduce(x[::2])
    y = np.full(3, float(RANK + 1))
    made = {"allreduce, FastPath": lambda: comm.allreduce(y),
            "allreduce, Python": lambda: comm.allreduce(y[::-1]),
            "allgather": lambda: comm.allgather(y)}[call]
    in_handler = []

    def hung(signum, frame):
        raise _Hung("the blocking call from the signal handler did not return within 10 s")

    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: in_handler.append(made()))
    previous_usr2 = signal.signal(signal.SIGUSR2, hung)
    watchdog = threading.Timer(10, signal.pthread_kill,
                               (threading.main_thread().ident, signal.SIGUSR2))
    try:
        with worker_held(comm):
            _signalling_after_its_call(comm, signal.SIGUSR1)
            handle = comm.allreduce_async(x[::2])
            later = comm.allreduce_async(x)
            watchdog.start()
            assert bitwise_equal(handle.wait(), expected)
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGUSR2, previous_usr2)
    total = SIZE * (SIZE + 1) / 2
    want = np.full(3, total) if call != "allgather" else np.repeat(np.arange(1.0, SIZE + 1), 3)
    assert len(in_handler) == 1 and (in_handler[0] == want).all()
    assert bitwise_equal(later.wait(), comm.allreduce(x))
    comm.close()


@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
def test_threads_each_with_a_communicator_of_their_own_run_at_once(wire, world, monkeypatch):
    # What api.md tells threads to do: a Communicator each. Each thread's calls pair
    # with the same thread's on the other ranks, whatever order the threads run in on
    # each rank (a pause drawn per rank and thread shuffles them differently), and each
    # call's result is its own thread's data: small calls done in the header exchange,
    # ring calls, queued ones, every collective.
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:  # (see api.md: they would wait for
        pytest.skip("MPI below MPI_THREAD_MULTIPLE: one thread at a time")  # each other)
    monkeypatch.setenv("RINGREDUCE_SHM", "1" if wire == "shared memory" else "0")
    threads, calls = 3, 12
    rings = [rr.Communicator(timeout=60) for _ in range(threads)]  # (made in one order)
    monkeypatch.delenv("RINGREDUCE_SHM")
    if any(ring.transport != wire for ring in rings):
        for ring in rings:
            ring.close()
        pytest.skip(f"no {wire}: {rings[0].transport_reason}")  # (one rank, or not one machine)
    failures = []

    def data(rank, t, i, n):  # (exact in float64: every sum below is of integers)
        return np.arange(n, dtype=np.float64) + 1000.0 * rank + 100_000.0 * t + i

    def expected_sum(t, i, n):
        return sum(data(r, t, i, n) for r in range(SIZE))

    def work(t):
        ring, pause = rings[t], np.random.default_rng([RANK, t])
        try:
            for i in range(calls):
                time.sleep(pause.uniform(0, 0.003))
                n = (5, 3000, 70_001)[i % 3]  # header, one chunk, many chunks
                kind = i % 4
                if kind == 0:
                    got, want = ring.allreduce(data(RANK, t, i, n)), expected_sum(t, i, n)
                elif kind == 1:
                    handles = [ring.allreduce_async(data(RANK, t, i + j, n)) for j in range(3)]
                    got = np.concatenate([h.wait() for h in reversed(handles)])
                    want = np.concatenate([expected_sum(t, i + j, n) for j in (2, 1, 0)])
                elif kind == 2:
                    got = ring.allgather(data(RANK, t, i, n))
                    want = np.concatenate([data(r, t, i, n) for r in range(SIZE)])
                else:
                    root = (t + i) % SIZE
                    got = ring.broadcast(data(RANK, t, i, n), root=root)
                    want = data(root, t, i, n)
                if not np.array_equal(got, want):
                    failures.append(f"thread {t}, call {i} (kind {kind}, {n} elements): "
                                    f"wrong result")
            block = ring.reduce_scatter(data(RANK, t, calls, 10 * SIZE + 1))
            mine = np.array_split(expected_sum(t, calls, 10 * SIZE + 1), SIZE)[RANK]
            if not np.array_equal(block, mine):
                failures.append(f"thread {t}: reduce_scatter's block is wrong")
        except Exception as error:  # (a timeout: calls that paired with another thread's)
            failures.append(f"thread {t}: {type(error).__name__}: {error}")

    running = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in running), "a thread never finished"
    for ring in rings:
        ring.close()
    assert not failures, failures


@pytest.mark.skipif(SIZE == 1, reason="one rank gathers at once")
@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt])
def test_what_is_raised_remaking_an_allgather_async_result_in_a_wait_is_raised_there(
        raised, world, monkeypatch):
    # allgather_async remakes its result with Python (_Results.empty) where the ranks'
    # rows add up to other than its guess, with the GIL, where Python may run a signal
    # handler. Run by the wait of a later call, what a handler raised there is that
    # wait's to raise, as for the Python layer's calls (above); the call's own wait
    # raises it too (KeyboardInterrupt: what the worker's would, once).
    from ringreduce import communicator

    empty, armed = communicator._Results.empty, [True]

    def refused(self, shape, dtype):  # (for the gathered rows only, until disarmed)
        if armed and len(shape) == 2:
            raise raised("test: a signal handler raised")
        return empty(self, shape, dtype)

    monkeypatch.setattr(communicator._Results, "empty", refused)  # (before the FastPath)
    comm = rr.Communicator(timeout=60)
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float32), 6, salt=2).reshape(2, 3)[: 1 if RANK == 0 else 2]
    y = rank_data(np.dtype(np.float64), 4000)
    expected = comm.allreduce(y)
    with worker_held(comm) as calls:
        first = comm.allgather_async(x)  # (every rank guesses wrong: 1 row or 2)
        second = comm.allreduce_async(y)
        assert on_the_worker_without_python(first) and on_the_worker_without_python(second)
        with pytest.raises(raised, match="test: a signal handler raised"):
            second.wait()
        assert calls.run_by_callers == 1
    assert bitwise_equal(second.wait(), expected)  # (the worker's)
    for _ in range(2):  # (each wait raises it anew: pybind11 restores an error once)
        if raised is KeyboardInterrupt:
            with pytest.raises(RuntimeError, match=r"^ringreduce\.allgather_async .*interrupted"):
                first.wait()
        else:
            with pytest.raises(raised, match="test: a signal handler raised"):
                first.wait()
    armed.clear()
    assert bitwise_equal(comm.allgather_async(x).wait(), np.concatenate(world.allgather(x)))
    comm.close()


def test_allgather_async_of_contiguous_arrays_runs_without_python(comm, world):
    # The FastPath queues it with a guess at the result (this rank's rows times the
    # ranks), which the worker remakes (with the GIL) only where the ranks' rows add up
    # to something else; out= is taken as the result from the start.
    for rows in (4, 1 + RANK % 2, 5000):
        x = rank_data(np.dtype(np.int32), rows * 3, salt=rows).reshape(rows, 3)
        want = np.concatenate(world.allgather(x))
        for out in (None, np.empty_like(want)):
            handle = comm.allgather_async(x, out=out)
            assert on_the_worker_without_python(handle) == (comm._executor.threaded
                                                             and SIZE > 1), rows
            got = handle.wait()
            assert out is None or got is out
            assert bitwise_equal(got, want), (rows, out is None)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("runner", ["worker", "wait"])
def test_what_escapes_a_queued_calls_execute_is_raised_not_a_hang(runner, when, world,
                                                                   monkeypatch):
    # _Work.execute() keeps every error of its call, inside its try; but Python runs a
    # signal handler between any two lines, so Ctrl-C can raise just outside it, in a
    # call that a wait() runs in the main thread. Before the call ran (here on every
    # rank, so the calls after go on as usual), it was never marked finished, and its
    # waits waited for good: what escaped is the call's error. After it finished, the
    # Ctrl-C was lost: the wait that ran the call raises it, and the call keeps its
    # result. (On the worker, whose Python runs no signal handler, what escapes after
    # the call is written as unraisable, as before.)
    from ringreduce.communicator import _Work

    comm = rr.Communicator(timeout=60)
    needs_a_worker(comm)
    x = rank_data(np.dtype(np.float64), 4000)
    expected = comm.allreduce(x[::2])
    execute = _Work.execute

    def interrupted(self, *args, **kwargs):
        monkeypatch.setattr(_Work, "execute", execute)  # (once)
        if when == "after":
            execute(self, *args, **kwargs)
        raise KeyboardInterrupt("test: Ctrl-C between two lines")

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(_Work, "execute", interrupted)
    with worker_held(comm, held=runner == "wait"):
        handle = comm.allreduce_async(x[::2])  # (strided: the Python layer's call)
        assert not on_the_worker_without_python(handle)
        # (A wait that hangs fails the test instead: the watchdog finishes the call.)
        watchdog = threading.Timer(20, handle._work.finished.set)
        watchdog.start()
        try:
            if runner == "worker" and when == "after":
                assert bitwise_equal(handle.wait(timeout=30), expected)
            else:
                with pytest.raises(KeyboardInterrupt, match="between two lines"):
                    handle.wait(timeout=None if runner == "wait" else 30)
        finally:
            watchdog.cancel()
    if when == "after":
        assert bitwise_equal(handle.wait(), expected)
    seen = [type(u.exc_value) for u in unraisable]
    assert seen == ([KeyboardInterrupt] if (runner, when) == ("worker", "after") else []), seen
    assert bitwise_equal(comm.allreduce_async(x).wait(), comm.allreduce(x))
    comm.close()


def test_an_error_escaping_queued_work_without_keep_escaped_is_written_as_unraisable(
        comm, monkeypatch):
    # Work the Python layer queues that is not a _Work (a dropped Communicator's
    # _BeginDroppedClose) has no keep_escaped(): what its execute() raised is written
    # as unraisable, not replaced by the AttributeError of looking for it.
    class Failing:
        def execute(self):
            raise RuntimeError("test: failed in execute")

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    calls = comm._executor.calls
    assert calls.push(Failing())
    calls.drain()
    assert [(type(u.exc_value), str(u.exc_value)) for u in unraisable] == \
        [(RuntimeError, "test: failed in execute")]


def test_a_handle_says_what_it_is_and_whether_it_is_done(comm):
    x = rank_data(np.dtype(np.float64), 100)
    if SIZE > 1 and comm._executor.threaded:
        with worker_held(comm):  # (its call waits in the queue meanwhile)
            handle = comm.reduce_scatter_async(x)
            assert repr(handle) == (f"<ringreduce.Handle: ringreduce.reduce_scatter_async "
                                    f"(rank {RANK} of {SIZE}), in flight>")
            handle.wait()
    else:
        handle = comm.reduce_scatter_async(x)
    assert repr(handle).endswith(f"(rank {RANK} of {SIZE}), done>")


def _mismatched(strided: bool) -> np.ndarray:
    """An input whose size differs on rank 0 (every rank's call raises MismatchError);
    strided: a view the FastPath leaves to the Python layer's queue."""
    n = 3000 + (RANK == 0)
    return np.ones(2 * n)[::2] if strided else np.ones(n)


def _needs_ranks_whose_calls_can_differ():
    if SIZE == 1:
        pytest.skip("needs ranks whose calls can differ")


def _drop_a_failed_call(comm, strided=False):
    """An allreduce_async that fails (MismatchError) on every rank, its Handle dropped
    unwaited, and over."""
    handle = comm.allreduce_async(_mismatched(strided))
    del handle
    comm._executor.drain()


@pytest.mark.parametrize("strided", [False, True], ids=["FastPath", "Python"])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "broadcast"])
def test_an_error_lost_with_a_dropped_handle_is_warned_of_at_the_next_call(collective,
                                                                           strided, world):
    # A MismatchError leaves the Communicator usable: a Handle dropped unwaited took it
    # along without a word, its result holding whatever it held.
    _needs_ranks_whose_calls_can_differ()
    x = _mismatched(strided)
    with rr.Communicator(timeout=60) as comm:
        start = getattr(comm, f"{collective}_async")
        handle = start(x) if collective == "broadcast" else start(x, "sum")
        del handle
        comm._executor.drain()  # (its call is over, and let go of)
        y = np.arange(8.0)
        with pytest.warns(rr.DroppedErrorWarning) as caught:
            result = comm.allreduce(y)
        assert bitwise_equal(result, SIZE * y)  # (and the call itself is served)
        message = str(caught[0].message)
        assert message.startswith("ringreduce: an asynchronous call failed, and its Handle "
                                  "was dropped without wait()"), message
        assert "The error: MismatchError: " in message, message
        assert caught[0].filename == __file__, caught[0].filename  # (the caller's line)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            assert bitwise_equal(comm.allreduce(y), SIZE * y)
    world.Barrier()


def test_a_dropped_call_still_in_flight_is_warned_of_after_the_next_blocking_call(world):
    # (From a review.) The next call waits for the one dropped (queued before it), which
    # fails meanwhile: the warning came only after the call after that.
    _needs_ranks_whose_calls_can_differ()
    with rr.Communicator(timeout=60) as comm:
        if RANK == 1:
            # Rank 0's call is still waiting for this rank's when its next call begins.
            # (Were rank 0 held up longer, its call would have failed before that one
            # began, which then warned under the old code too: the test would pass
            # without testing this, never fail for it.)
            time.sleep(0.5)
        handle = comm.allreduce_async(_mismatched(False))
        del handle
        y = np.arange(8.0)
        with pytest.warns(rr.DroppedErrorWarning, match="The error: MismatchError: "):
            result = comm.allreduce(y)
        assert bitwise_equal(result, SIZE * y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            assert bitwise_equal(comm.allreduce(y), SIZE * y)
    world.Barrier()


def test_no_warning_for_an_error_raised_by_wait_or_for_the_librarys_own_calls(world):
    _needs_ranks_whose_calls_can_differ()
    with rr.Communicator(timeout=60) as comm:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for strided in (False, True):
                handle = comm.allreduce_async(_mismatched(strided))
                with pytest.raises(rr.MismatchError):
                    handle.wait()
                del handle
                # A call of the library's own that fails, its handle dropped: it
                # raised its error where it waited (here, inside allreduce_gradients).
                with pytest.raises(rr.MismatchError):
                    rr.allreduce_gradients([_mismatched(False)], comm=comm)
                comm._executor.drain()
                assert bitwise_equal(comm.allreduce(np.ones(4)), np.full(4, float(SIZE)))
        handles = [comm.allreduce_async(_mismatched(False)) for _ in range(4)]
        del handles  # (four lost: one warning, at the close, counting them)
        with pytest.warns(rr.DroppedErrorWarning, match=r"^ringreduce: 4 asynchronous calls "
                                                        r"failed.*The first: MismatchError"):
            comm.close()
    world.Barrier()


def test_the_warning_raised_as_an_error_comes_after_the_ranks_call(world):
    # (From a review.) Under -W error, the warning raised before this rank joined its
    # call: the others' call then paired with this rank's next one, summing other data
    # without a word.
    _needs_ranks_whose_calls_can_differ()
    with rr.Communicator(timeout=60) as comm:
        handle = comm.allreduce_async(_mismatched(False))
        if RANK == 0:
            del handle
        else:
            with pytest.raises(rr.MismatchError):
                handle.wait()
        comm._executor.drain()
        y, z = np.full(4, 1.0), np.full(4, 100.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", rr.DroppedErrorWarning)
            if RANK == 0:
                with pytest.raises(rr.DroppedErrorWarning):
                    comm.allreduce(y)  # (done, then warned)
            else:
                assert bitwise_equal(comm.allreduce(y), SIZE * y)
            assert bitwise_equal(comm.allreduce(z), SIZE * z)
    world.Barrier()


@pytest.mark.parametrize("strided", [False, True], ids=["FastPath", "Python"])
def test_no_warning_for_an_error_wait_raised_even_once_its_cycle_is_collected(strided, world):
    # The error wait() raised holds, in its traceback, the frame that holds the Handle's
    # call: that call goes only at a garbage collection, and must note nothing then.
    _needs_ranks_whose_calls_can_differ()
    with rr.Communicator(timeout=60) as comm:
        handle = comm.allreduce_async(_mismatched(strided))
        with pytest.raises(rr.MismatchError):
            handle.wait()
        del handle
        comm._executor.drain()
        gc.collect()
        assert not _core.dropped_errors_pending()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert bitwise_equal(comm.allreduce(np.ones(4)), np.full(4, float(SIZE)))
    world.Barrier()


@pytest.mark.parametrize("strided", [False, True], ids=["FastPath", "Python"])
def test_a_forked_child_neither_inherits_nor_notes_its_parents_dropped_errors(strided, world):
    # One error noted before the fork (the parent's to warn of), and a failed Handle the
    # child drops (its parent's call: not the child's to note).
    _needs_ranks_whose_calls_can_differ()
    with rr.Communicator(timeout=60) as comm:
        dropped = comm.allreduce_async(_mismatched(strided))
        kept = comm.allreduce_async(_mismatched(strided))
        del dropped
        comm._executor.drain()
        assert _core.dropped_errors_pending()
        child = os.fork()
        if child == 0:
            code = 1 if _core.dropped_errors_pending() else 0
            del kept
            gc.collect()
            code |= 2 if _core.dropped_errors_pending() else 0
            os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # 1: inherited; 2: noted
        with pytest.raises(rr.MismatchError):
            kept.wait()
        with pytest.warns(rr.DroppedErrorWarning):  # (the parent still warns of its own)
            comm.allreduce(np.ones(4))
    world.Barrier()


def test_a_child_forked_while_another_thread_notes_a_dropped_error_does_not_hang():
    # (helper 243, from reading) The child forgets its parent's dropped errors, under
    # their lock; where another thread (the worker, noting one) held that lock at the
    # fork, it stayed held in the child, where no thread would release it: the child
    # hung at fork. The forking thread holds it across the fork now. (The other thread
    # holds it here half a second, as a worker would for a moment.)
    holding, release = threading.Event(), threading.Event()

    def note_slowly():
        _core.hold_dropped_errors()
        holding.set()
        release.wait(10)
        _core.release_dropped_errors()

    noter = threading.Thread(target=note_slowly)
    noter.start()
    holding.wait(10)
    threading.Timer(0.5, release.set).start()
    child = os.fork()
    if child == 0:
        os._exit(0)  # (after the fork's handlers, in which it hung)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    noter.join(10)
    if done[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert done[0] == child, "the child hung at fork"
    assert os.waitstatus_to_exitcode(done[1]) == 0


@pytest.mark.parametrize("strided", [False, True], ids=["FastPath", "Python"])
def test_a_dropped_allgather_that_ran_out_of_memory_is_warned_of(strided, world, monkeypatch):
    # Rank 1 cannot make its result (np.empty fails there); every rank's call raises
    # MemoryError, and every rank dropped its Handle.
    _needs_ranks_whose_calls_can_differ()
    with rr.Communicator(timeout=60) as comm:
        rows = 1024 + (RANK == 1)
        x = np.full((rows, 256), RANK, np.float32)  # 1 MiB: the result is confirmed
        if strided:
            x = np.repeat(x, 2, axis=0)[::2]
        if RANK == 1:
            monkeypatch.setattr(communicator, "np", NumpyWithoutMemory())
        handle = comm.allgather_async(x)
        del handle
        comm._executor.drain()
        monkeypatch.undo()
        # (No garbage collection: on rank 1 np.empty's MemoryError is the error's
        # __context__, whose traceback held the _Work until one, and no warning came.)
        with pytest.warns(rr.DroppedErrorWarning, match="The error: MemoryError: "):
            comm.allreduce(np.ones(4))
    world.Barrier()


def test_no_warning_for_the_librarys_own_async_call_dropped_unwaited(world):
    # The library's own *_async calls (check given: an optimizer's buckets) answer for
    # their errors themselves: none is noted, even dropped unwaited.
    _needs_ranks_whose_calls_can_differ()
    with rr.Communicator(timeout=60) as comm:
        comm.allreduce(np.ones(4))  # (float64 "sum" validated: the FastPath serves it)
        handle = comm._allreduce_checked(_mismatched(False), "sum", 0, wait=False)
        assert not isinstance(handle._work, communicator._Work)  # (the core's AsyncCall)
        del handle
        comm._executor.drain()
        gc.collect()
        assert not _core.dropped_errors_pending()
    world.Barrier()


def test_the_next_async_call_warns_of_a_dropped_error_as_it_is_made(world):
    # A FastPath-eligible allreduce_async made while an error is pending goes by the
    # general path, which warns at the call (not only at a later blocking one).
    _needs_ranks_whose_calls_can_differ()
    with rr.Communicator(timeout=60) as comm:
        _drop_a_failed_call(comm)
        y = np.arange(8.0)
        with pytest.warns(rr.DroppedErrorWarning, match="The error: MismatchError: "):
            next_one = comm.allreduce_async(y)
        assert bitwise_equal(next_one.wait(), SIZE * y)
        assert not _core.dropped_errors_pending()
    world.Barrier()
