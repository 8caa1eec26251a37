"""The Python half of the GPU path (ringreduce/_device.py) on any machine: a stand-in
for cupy (fake_cupy.py, GPU-array clothes on numpy memory) over the core's host
emulation of a GPU. Checks the plumbing: results, out=, in place, strides, async
calls, allgather's allocation, broadcast into a view, and the argument errors. cupy
and CUDA themselves are tested by test_gpu.py where there is a GPU."""
import gc
import threading
import time
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import _core, reference

import fake_cupy as cp
from helpers import (bitwise_equal, check_gpu_argument_errors,
                     check_host_and_gpu_arrays_in_one_call_raise_everywhere, rank_data,
                     run_threads_of)

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()


@pytest.fixture(scope="module", autouse=True)
def emulated_gpu():
    with pytest.MonkeyPatch.context() as patch:
        cp.emulate_gpu(patch)
        yield


@pytest.fixture(scope="module", params=["staged", "direct"])
def ring(request):
    comm = rr.Communicator(chunk_bytes=256)
    comm._direct = request.param == "direct"
    yield comm
    comm.close()


def test_allreduce_returns_a_gpu_array_with_the_host_rings_result(ring):
    for n in (0, 1, 7, 1000, 20_001):
        for op in ("sum", "max", "avg"):
            x = rank_data(np.dtype(np.float32), n, op, salt=n)
            got = ring.allreduce(cp.asarray(x), op=op)
            assert isinstance(got, cp.ndarray)
            assert bitwise_equal(cp.asnumpy(got), reference.allreduce(x, op)), (n, op)


def test_out_in_place_strided_and_overlapping(ring):
    x = rank_data(np.dtype(np.float64), 4 * 300).reshape(4, 300)
    expected = reference.allreduce(x, "sum")
    out = cp.empty(x.shape, x.dtype)
    assert ring.allreduce(cp.asarray(x), out=out) is out
    assert bitwise_equal(cp.asnumpy(out), expected)
    inplace = cp.asarray(x.copy())
    assert ring.allreduce(inplace, out=inplace) is inplace
    assert bitwise_equal(cp.asnumpy(inplace), expected)
    strided = cp.asarray(x)[:, ::3]
    assert bitwise_equal(cp.asnumpy(ring.allreduce(strided)),
                         reference.allreduce(np.ascontiguousarray(x[:, ::3]), "sum"))
    # out overlapping x without being x: x must be read before out is written
    buffer = cp.asarray(rank_data(np.dtype(np.float64), 1200))
    x_view, out_view = buffer[0:1000], buffer[200:1200]
    expected = reference.allreduce(cp.asnumpy(x_view), "sum")
    ring.allreduce(x_view, out=out_view)
    assert bitwise_equal(cp.asnumpy(out_view), expected)


def test_async_calls_complete_in_order(ring):
    arrays = [rank_data(np.dtype(np.float32), n, salt=n) for n in (10, 3000, 1, 500)]
    handles = [ring.allreduce_async(cp.asarray(a)) for a in arrays]
    for a, h in zip(arrays, handles):
        assert bitwise_equal(cp.asnumpy(h.wait()), reference.allreduce(a, "sum"))


def test_one_rank_still_hands_gpu_async_calls_to_the_worker():
    # One rank runs a host array's async call at once; a GPU array's call would wait
    # there for the work queued on the caller's stream, which the caller need not.
    if SIZE > 1:
        pytest.skip("one rank only")
    with rr.Communicator() as comm:
        if not comm._executor.threaded:
            pytest.skip("MPI without MPI_THREAD_MULTIPLE: no worker thread")
        assert comm.allreduce_async(np.ones(3)).done()
        assert not comm._executor.started
        assert bitwise_equal(cp.asnumpy(comm.allreduce_async(cp.asarray(np.ones(3))).wait()),
                             np.ones(3))
        assert comm._executor.started


def test_the_worker_thread_makes_the_arrays_gpu_current_and_keeps_it(ring):
    # A thread's current GPU is GPU 0 until it sets one, and on a real GPU switching
    # back to it (after a call on the array's GPU) made a CUDA context on GPU 0 in
    # every rank. So the worker sets the array's GPU before each call and never
    # switches back, and the caller's own thread is left as it was. (The stand-in's
    # GPUs have no contexts: this checks who sets which.)
    if not ring._executor.threaded:
        pytest.skip("MPI without MPI_THREAD_MULTIPLE: no worker thread")
    x = cp.asarray(rank_data(np.dtype(np.float32), 100))
    ring.allreduce(x)  # on this thread (nothing queued)
    assert all(thread != threading.get_ident() for thread, _ in cp.set_devices)
    before = len(cp.set_devices)
    handles = [ring.allreduce_async(x) for _ in range(3)]
    for h in handles:
        h.wait()
    calls = cp.set_devices[before:]
    assert len(calls) == len(handles), calls
    assert all(thread != threading.get_ident() and gpu == x.device.id for thread, gpu in calls)


def test_a_queued_allgather_on_the_per_thread_stream_allocates_on_the_legacy_one(
        ring, world, monkeypatch):
    # On the worker thread cupy's per-thread default stream (ptr 2) is the worker's
    # own, whose pool memory nothing orders after other threads' kernels: the result is
    # taken under the legacy default stream there (ptr 0; _Launch.allocating_stream),
    # and in the caller's own thread under the caller's stream. The stand-in records
    # which stream was current; what CUDA makes of it is for test_gpu.py.
    if not ring._executor.threaded:
        pytest.skip("MPI without MPI_THREAD_MULTIPLE: no worker thread")
    # (A call an earlier test left in flight had the first allgather queued too, which
    # under Open MPI it sometimes was.)
    ring._executor.drain()
    threads = run_threads_of("prepare_allgather", monkeypatch)
    y = rank_data(np.dtype(np.float32), 6 * (RANK + 1)).reshape(-1, 6)
    expected = np.concatenate(world.allgather(y))
    x = rank_data(np.dtype(np.float32), 20_000)
    before = len(cp.allocations)
    with cp.cuda.Stream.ptds:
        inline = ring.allgather(cp.asarray(y))
        _core.set_emulated_stall(1, 0.5)  # busy's first copy: it is still running below
        try:
            busy = ring.allreduce_async(cp.asarray(x))
            assert ring._executor.busy
            queued = ring.allgather(cp.asarray(y))
        finally:
            _core.set_emulated_stall(0, 0)
        summed = busy.wait()
    me = threading.get_ident()
    assert threads[0] == me and threads[1] != me, "the second allgather was not queued"
    made = cp.allocations[before:]
    assert [ptr for thread, ptr in made if thread == threads[1]] == [0], made
    assert (me, 2) in made  # the first one, and allreduce's out
    np.testing.assert_array_equal(cp.asnumpy(inline), expected)
    np.testing.assert_array_equal(cp.asnumpy(queued), expected)
    assert bitwise_equal(cp.asnumpy(summed), reference.allreduce(x, "sum"))


def test_reduce_scatter_allgather_broadcast(ring, world):
    x = rank_data(np.dtype(np.float32), 1001, salt=3)
    part = ring.reduce_scatter(cp.asarray(x), op="avg")
    assert bitwise_equal(cp.asnumpy(part), reference.reduce_scatter(x, "avg"))
    out = cp.empty(part.shape, part.dtype)
    assert ring.reduce_scatter(cp.asarray(x), out=out) is out
    rows = (RANK + 2) % 3
    y = np.arange(rows * 4, dtype=np.int16).reshape(rows, 2, 2) + 10 * RANK
    gathered = ring.allgather(cp.asarray(y))
    np.testing.assert_array_equal(cp.asnumpy(gathered), np.concatenate(world.allgather(y)))
    out = cp.empty(gathered.shape, gathered.dtype)
    assert ring.allgather(cp.asarray(y), out=out) is out
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(gathered))
    with pytest.raises(TypeError, match="cupy.ndarray"):
        ring.allgather(cp.asarray(y), out=cp.asnumpy(gathered))
    for root in range(SIZE):
        z = rank_data(np.dtype(np.float64), 40, salt=root).reshape(4, 10)
        expected = world.bcast(z, root=root)
        dz = cp.asarray(z.copy())
        view = dz[:, ::2]  # not contiguous: broadcast writes back through the view
        assert ring.broadcast(view, root=root) is view
        np.testing.assert_array_equal(cp.asnumpy(dz)[:, ::2], expected[:, ::2])
        np.testing.assert_array_equal(cp.asnumpy(dz)[:, 1::2], z[:, 1::2])


def test_argument_errors_name_the_problem(ring):
    check_gpu_argument_errors(ring, cp)


def test_host_and_gpu_arrays_in_one_call_raise_on_every_rank(ring):
    if SIZE == 1:
        pytest.skip("needs two ranks")
    check_host_and_gpu_arrays_in_one_call_raise_everywhere(ring, cp)

def test_a_rank_whose_gpu_fails_in_the_ring_tells_the_others_at_once():
    # An error in the ring on one rank (its emulated GPU failing a copy) makes that rank
    # leave the communicator: the others, waiting on its chunks, raise at once instead of
    # after their timeout. Every rank keeps the call's arrays alive for good, as MPI may
    # still use them, and close() frees nothing, at once.
    if SIZE == 1:
        pytest.skip("needs another rank to fail")
    comm = rr.Communicator(chunk_bytes=256, timeout=60)
    comm._core.device_host_reduce_bytes = 0  # the device ring, not the host path
    x = cp.asarray(rank_data(np.dtype(np.float32), 20_000))
    out = cp.empty(x.shape, x.dtype)
    kept = weakref.ref(out)
    start = time.monotonic()
    if RANK == 1:
        _core.set_emulated_copy_fault(20)  # well inside the reduce-scatter
        try:
            with pytest.raises(RuntimeError, match="failed a copy"):
                comm.allreduce(x, out=out)
        finally:
            _core.set_emulated_copy_fault(0)
    else:
        # (On 3 ranks or more, the news may come first from a rank that left after it,
        # which passes on who left first.)
        with pytest.raises(rr.CollectiveTimeoutError, match="rank 1 has left") as raised:
            comm.allreduce(x, out=out)
        assert "after another rank did" not in str(raised.value)
    assert time.monotonic() - start < 30
    assert comm._core.departed
    del x, out
    gc.collect()
    assert kept() is not None
    comm.close()
    with pytest.raises(ValueError, match="closed"):
        comm.allreduce(cp.asarray(np.ones(3, np.float32)))


@pytest.mark.parametrize("through", ["device ring", "host"])
def test_allreduce_gradients_of_gpu_arrays_checks_their_layout_in_the_first_call(
        ring, through, monkeypatch):
    # The check of the gradients' layout rides in the first bucket's call on the GPU
    # path too (_device.prepare_allreduce, then either of the core's two ways).
    from ringreduce import gradients
    monkeypatch.setattr(gradients, "array_module",
                        lambda a: cp if isinstance(a, cp.ndarray) else np)
    core = ring._core
    limit = core.device_host_reduce_bytes
    core.device_host_reduce_bytes = 0 if through == "device ring" else 1 << 20

    def fresh(bad=False):
        second = np.full((2, 2), 2.0 * RANK, np.float32)
        return [cp.asarray(np.full(3, float(RANK), np.float32)),
                cp.asarray(second.reshape(4) if bad else second)]
    try:
        grads = fresh()
        assert rr.allreduce_gradients(grads, comm=ring, bucket_mb=1e-5) is not None
        assert all(isinstance(g, cp.ndarray) for g in grads)
        np.testing.assert_allclose(cp.asnumpy(grads[0]), (SIZE - 1) / 2)
        np.testing.assert_allclose(cp.asnumpy(grads[1]), SIZE - 1.0)
        if SIZE > 1:
            grads = fresh(bad=RANK == SIZE - 1)
            with pytest.raises(rr.MismatchError, match="pass gradients that differ"):
                rr.allreduce_gradients(grads, comm=ring, bucket_mb=1e-5)
            np.testing.assert_array_equal(cp.asnumpy(grads[0]), float(RANK))  # untouched
    finally:
        core.device_host_reduce_bytes = limit


def test_a_gpu_gradient_listed_twice_is_reduced_once(ring, monkeypatch):
    # Larger than a bucket, each copy of it is alone in its bucket, and a GPU array
    # alone is reduced in place: twice, op="sum" gave SIZE times the sum.
    from ringreduce import gradients
    monkeypatch.setattr(gradients, "array_module",
                        lambda a: cp if isinstance(a, cp.ndarray) else np)
    x = rank_data(np.dtype(np.float64), 40, "sum", salt=3)
    tied = cp.asarray(x.copy())
    other = cp.asarray(x[:10].copy())
    rr.allreduce_gradients([tied, other, tied], op="sum", comm=ring, bucket_mb=1e-5)
    expected = reference.allreduce(x, "sum")
    np.testing.assert_allclose(cp.asnumpy(tied), expected, rtol=1e-12)
    np.testing.assert_allclose(cp.asnumpy(other), expected[:10], rtol=1e-12)
    # Overlapping views of one GPU buffer are each reduced from what they held.
    base = cp.asarray(x.copy())
    rr.allreduce_gradients([base[:30], base[10:]], op="sum", comm=ring, bucket_mb=1e-5)
    np.testing.assert_allclose(cp.asnumpy(base), expected, rtol=1e-12)
