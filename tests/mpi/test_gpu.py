"""cupy arrays through the real device ring, on every rank; skipped where there is no
cupy or no usable GPU. Ranks may share one GPU (rank r uses GPU r % count). Every result
is held to the host ring's (numpy) result for the same data, bit for bit where the
arithmetic is the same, and the staging path is tested whatever MPI says about CUDA."""
import threading

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import reference

from helpers import (bitwise_equal, check_gpu_argument_errors,
                     check_host_and_gpu_arrays_in_one_call_raise_everywhere, rank_data,
                     run_threads_of)

try:
    import cupy
except ImportError:
    cupy = None

pytestmark = pytest.mark.skipif(cupy is None or not rr.cuda_available(),
                                reason="needs cupy and a usable GPU")

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
SIZES = sorted({0, 1, SIZE, 2 * SIZE + 1, 517, 100_003, 3_000_001})
DTYPES = [np.dtype(n) for n in ("float16", "float32", "float64", "int32", "int64", "uint8",
                                "complex64", "bool")]
OPS = ["sum", "prod", "min", "max", "avg"]


def supported(dtype, op):
    return not (dtype.kind == "c" and op in ("min", "max") or dtype.kind in "iub" and op == "avg")


@pytest.fixture(scope="module", autouse=True)
def one_gpu_per_rank():
    if cupy is not None and rr.cuda_available():
        cupy.cuda.Device(RANK % cupy.cuda.runtime.getDeviceCount()).use()


@pytest.fixture(scope="module", params=["staged", "direct"])
def gpu_comm(request):
    """A Communicator for each way of moving device buffers; "direct" only where MPI
    says it takes device pointers (or RINGREDUCE_CUDA_AWARE=1). Allreduces take the
    device ring at every size past the header exchange (the shipped limit sends calls
    up to 1 MiB through the host ring; test_calls_up_to_the_limit_... checks those)."""
    comm = rr.Communicator()
    comm._core.device_host_reduce_bytes = 0
    if request.param == "direct" and not comm._cuda_direct():
        comm.close()
        pytest.skip("MPI is not CUDA-aware here: " + rr._core.mpi_cuda_aware_reason())
    comm._direct = request.param == "direct"
    yield comm
    comm.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_cupy_allreduce_matches_the_host_ring_bit_for_bit(dtype, op, gpu_comm):
    if not supported(dtype, op):
        pytest.skip("op not defined for dtype")
    for n in SIZES:
        for chunk in ((4096, 1 << 18) if n <= 100_003 else (1 << 18,)):
            gpu_comm.chunk_bytes = chunk
            x = rank_data(dtype, n, op, salt=2)
            got = gpu_comm.allreduce(cupy.asarray(x), op=op)
            assert isinstance(got, cupy.ndarray) and got.device.id == cupy.cuda.Device().id
            assert bitwise_equal(cupy.asnumpy(got), gpu_comm.allreduce(x, op=op)), (n, chunk)


def test_out_in_place_and_shapes(gpu_comm):
    x = rank_data(np.dtype(np.float32), 6 * 1000).reshape(6, 1000)
    expected = reference.allreduce(x, "sum")
    dx = cupy.asarray(x)
    out = cupy.empty_like(dx)
    assert gpu_comm.allreduce(dx, out=out) is out
    assert bitwise_equal(cupy.asnumpy(out), expected)
    assert gpu_comm.allreduce(dx, out=dx) is dx
    assert bitwise_equal(cupy.asnumpy(dx), expected)
    strided = cupy.asarray(x)[:, ::2]  # not contiguous: read through a copy
    assert bitwise_equal(cupy.asnumpy(gpu_comm.allreduce(strided)),
                         reference.allreduce(np.ascontiguousarray(x[:, ::2]), "sum"))


SPIN = r"""
extern "C" __global__ void late_fill(float* x, long n, float value, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += gridDim.x * (long)blockDim.x)
    x[i] = value;
}
extern "C" __global__ void late_copy(float* dst, const float* src, long n, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += gridDim.x * (long)blockDim.x)
    dst[i] = src[i];
}
"""
SPIN_CYCLES = 50_000_000  # tens of milliseconds


def late_filled(n, value, cycles=SPIN_CYCLES):
    """zeros, written with `value` on the current stream by a kernel that first spins."""
    x = cupy.zeros(n, cupy.float32)
    cupy.RawKernel(SPIN, "late_fill")((64,), (256,), (x, np.int64(n), np.float32(value),
                                                       np.int64(cycles)))
    return x


def test_waits_for_slow_kernels_on_the_callers_stream(gpu_comm):
    # x and y are written on a non-blocking stream by kernels that first spin: a call
    # that did not wait for that stream on the GPU would read zeros, the asynchronous
    # one (on the worker thread) too. (That the result is ready on the stream after the
    # call could not fail here: the core waits for its own work on the host before a
    # call returns.)
    n = 1 << 20
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = gpu_comm.allreduce(late_filled(n, RANK + 1))
        again = gpu_comm.allreduce_async(late_filled(n, 2 * (RANK + 1))).wait() + 1
    stream.synchronize()
    total = SIZE * (SIZE + 1) / 2
    assert float(out[0]) == total and float(out[-1]) == total
    assert float(again[0]) == 2 * total + 1 and float(again[-1]) == 2 * total + 1


def per_thread_stream(comm):
    ptds = getattr(cupy.cuda.Stream, "ptds", None)
    if ptds is None:
        pytest.skip("this cupy has no per-thread default stream")
    if not comm._executor.threaded:
        pytest.skip("MPI without MPI_THREAD_MULTIPLE: no worker thread")
    return ptds


def busy_call(comm, cycles=SPIN_CYCLES):
    """An allreduce_async that keeps the worker thread busy for a while: its input is
    written by a spinning kernel on the current stream, which the ring waits for."""
    return comm.allreduce_async(late_filled(1 << 16, RANK + 1, cycles))


def check_busy_call(handle):
    got = cupy.asnumpy(handle.wait())
    assert (got == SIZE * (SIZE + 1) / 2).all()


def test_a_queued_allgather_waits_for_the_per_thread_default_stream(gpu_comm, monkeypatch):
    # On cupy's per-thread default stream, the caller's stream handle names another
    # stream on the worker thread: an allgather queued behind an async call (so run
    # there) must still wait for the kernel that wrote x on the caller's thread.
    ptds = per_thread_stream(gpu_comm)
    threads = run_threads_of("prepare_allgather", monkeypatch)
    n = 1 << 18
    with ptds:
        busy = busy_call(gpu_comm)
        x = late_filled(n, RANK + 1)
        assert gpu_comm._executor.busy
        gathered = gpu_comm.allgather(x)
        check_busy_call(busy)
        ends = cupy.asnumpy(gathered.reshape(SIZE, n)[:, [0, -1]])
    assert threads[0] != threading.get_ident(), "the allgather was not queued"
    np.testing.assert_array_equal(ends, np.repeat(np.arange(1, SIZE + 1, dtype=np.float32), 2)
                                  .reshape(SIZE, 2))


def test_a_freed_result_still_read_on_a_per_thread_stream_is_not_overwritten(
        gpu_comm, monkeypatch, world):
    # An allgather queued behind an async call takes its result from cupy's pool on the
    # worker thread. An earlier one's result, freed while a kernel on this thread's
    # per-thread stream has yet to read it, goes back to the pool, and a later allgather
    # (from another thread here: an allgather blocks its caller) may be handed it: its
    # ring must wait for that kernel, which then still reads the earlier result.
    ptds = per_thread_stream(gpu_comm)
    threads = run_threads_of("prepare_allgather", monkeypatch)
    late_copy = cupy.RawKernel(SPIN, "late_copy")
    first, second = (rank_data(np.dtype(np.float32), 12_345 * 8, salt=salt).reshape(-1, 8)
                     for salt in (11, 12))
    expected_first = np.concatenate(world.allgather(first))
    expected_second = np.concatenate(world.allgather(second))
    device = cupy.cuda.Device().id
    cupy.get_default_memory_pool().free_all_blocks()  # (so that the block is reused)
    got, errors = [], []

    def second_caller():
        try:
            with cupy.cuda.Device(device), ptds:
                got.append(gpu_comm.allgather(cupy.asarray(second)))
        except BaseException as error:  # (raised again in the test's thread)
            errors.append(error)

    with ptds:
        busy = busy_call(gpu_comm)
        result = gpu_comm.allgather(cupy.asarray(first))
        check_busy_call(busy)
        seen, freed_at = cupy.empty_like(result), result.data.ptr
        busy = busy_call(gpu_comm, 2 * SPIN_CYCLES)
        # Runs after the busy call's input is written, and reads long after its ring.
        late_copy((64,), (256,), (seen, result, np.int64(result.size),
                                  np.int64(4 * SPIN_CYCLES)))
        del result
        caller = threading.Thread(target=second_caller)
        caller.start()
        caller.join(timeout=120)
        assert not caller.is_alive() and not errors, errors
        check_busy_call(busy)
        np.testing.assert_array_equal(cupy.asnumpy(seen), expected_first)
        np.testing.assert_array_equal(cupy.asnumpy(got[0]), expected_second)
    me = threading.get_ident()
    assert threads[0] != me and threads[1] not in (me, caller.ident), "not queued"
    assert got[0].data.ptr == freed_at, "the pool handed out another block: nothing tested"


def test_several_async_calls_in_flight(gpu_comm):
    arrays = [rank_data(np.dtype(np.float64), n, salt=n) for n in (10, 100_000, 7, 300_000)]
    handles = [gpu_comm.allreduce_async(cupy.asarray(a), op="avg") for a in arrays]
    for a, h in zip(arrays, handles):
        assert bitwise_equal(cupy.asnumpy(h.wait()), reference.allreduce(a, "avg"))


def test_async_collectives_wait_for_slow_kernels_on_the_callers_stream(gpu_comm):
    # As test_waits_for_slow_kernels_on_the_callers_stream, for reduce_scatter_async,
    # allgather_async and broadcast_async, in flight together on the worker thread.
    n = 1 << 20
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        part = gpu_comm.reduce_scatter_async(late_filled(n, RANK + 1))
        gathered = gpu_comm.allgather_async(late_filled(n, RANK + 1))
        sent = gpu_comm.broadcast_async(late_filled(n, RANK + 1), root=SIZE - 1)
        part, gathered, sent = part.wait() + 1, gathered.wait() + 1, sent.wait() + 1
    stream.synchronize()
    total = SIZE * (SIZE + 1) / 2
    assert (cupy.asnumpy(part) == total + 1).all()
    np.testing.assert_array_equal(cupy.asnumpy(gathered.reshape(SIZE, n)[:, [0, -1]]),
                                  np.repeat(np.arange(2, SIZE + 2, dtype=np.float32), 2)
                                  .reshape(SIZE, 2))
    assert (cupy.asnumpy(sent) == SIZE + 1).all()


def test_async_reduce_scatter_allgather_broadcast(gpu_comm, world):
    # In flight together, with an allreduce_async among them: each as the reference.
    x = rank_data(np.dtype(np.float32), 100_003, "sum", salt=4)
    rows = (RANK * 2 + 1) % 4
    y = np.arange(rows * 6, dtype=np.int64).reshape(rows, 2, 3) + 100 * RANK
    z = rank_data(np.dtype(np.float64), 300_001, salt=9)
    dz = cupy.asarray(z)
    handles = [gpu_comm.reduce_scatter_async(cupy.asarray(x)),
               gpu_comm.allreduce_async(cupy.asarray(x)),
               gpu_comm.allgather_async(cupy.asarray(y)),
               gpu_comm.broadcast_async(dz, root=SIZE - 1)]
    assert handles[3].wait() is dz
    assert bitwise_equal(cupy.asnumpy(handles[0].wait()), reference.reduce_scatter(x, "sum"))
    assert bitwise_equal(cupy.asnumpy(handles[1].wait()), reference.allreduce(x, "sum"))
    np.testing.assert_array_equal(cupy.asnumpy(handles[2].wait()),
                                  np.concatenate(world.allgather(y)))
    assert bitwise_equal(cupy.asnumpy(dz), world.bcast(z, root=SIZE - 1))


def test_reduce_scatter_allgather_broadcast(gpu_comm, world):
    for n in (0, 5, 517, 100_003):
        x = rank_data(np.dtype(np.float32), n, "sum", salt=4)
        part = gpu_comm.reduce_scatter(cupy.asarray(x))
        assert bitwise_equal(cupy.asnumpy(part), reference.reduce_scatter(x, "sum"))
    rows = (RANK * 2 + 1) % 4
    x = np.arange(rows * 6, dtype=np.int64).reshape(rows, 2, 3) + 100 * RANK
    gathered = gpu_comm.allgather(cupy.asarray(x))
    np.testing.assert_array_equal(cupy.asnumpy(gathered), np.concatenate(world.allgather(x)))
    for root in range(SIZE):
        y = rank_data(np.dtype(np.float64), 300_001, salt=root)
        dy = cupy.asarray(y)
        assert gpu_comm.broadcast(dy, root=root) is dy
        assert bitwise_equal(cupy.asnumpy(dy), world.bcast(y, root=root))
    z = cupy.asarray(rank_data(np.dtype(np.float32), 40).reshape(4, 10))
    view = z[:, ::2]  # broadcast into a strided view writes through to z
    gpu_comm.broadcast(view, root=0)
    expected = world.bcast(cupy.asnumpy(z)[:, ::2], root=0)
    np.testing.assert_array_equal(cupy.asnumpy(z[:, ::2]), expected)


def test_calls_up_to_the_limit_go_through_the_host(comm):
    core = comm._core
    limit = core.device_host_reduce_bytes
    for dtype in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.int64)):
        for n, on_host in ((limit // dtype.itemsize, True), (limit // dtype.itemsize + 1, False)):
            for op in ("sum", "max"):
                x = rank_data(dtype, n, op, salt=n)
                before = core.device_calls_on_host
                got = cupy.asnumpy(comm.allreduce(cupy.asarray(x), op=op))
                assert core.device_calls_on_host - before == int(on_host and SIZE > 1)
                assert bitwise_equal(got, comm.allreduce(x, op=op)), f"{dtype} n={n} {op}"
            before = core.device_calls_on_host
            part = cupy.asnumpy(comm.reduce_scatter(cupy.asarray(x), op="sum"))
            assert core.device_calls_on_host - before == int(on_host and SIZE > 1)
            assert bitwise_equal(part, comm.reduce_scatter(x, op="sum")), f"{dtype} n={n}"
            for root in range(SIZE):
                y = rank_data(dtype, n, salt=root)
                dy = cupy.asarray(y)
                assert comm.broadcast(dy, root=root) is dy
                assert bitwise_equal(cupy.asnumpy(dy), MPI.COMM_WORLD.bcast(y, root=root))
            # allgather's limit is on the whole result: just under it, and just over
            rows = limit // (dtype.itemsize * SIZE) + (0 if on_host else 1)
            z = rank_data(dtype, rows, salt=RANK)
            before = core.device_calls_on_host
            gathered = cupy.asnumpy(comm.allgather(cupy.asarray(z)))
            assert core.device_calls_on_host - before == int(on_host and SIZE > 1)
            assert bitwise_equal(gathered, np.concatenate(MPI.COMM_WORLD.allgather(z)))


def test_host_and_gpu_buffers_in_one_call_raise_on_every_rank(comm):
    if SIZE == 1:
        pytest.skip("needs two ranks")
    check_host_and_gpu_arrays_in_one_call_raise_everywhere(comm, cupy)


def test_bad_gpu_arguments_raise_clear_errors(comm):
    check_gpu_argument_errors(comm, cupy)


def test_a_call_on_a_stream_capturing_a_cuda_graph_raises_on_every_rank(comm):
    # Captured, its event and waits would pull ringreduce's own streams into the graph
    # (and CUDA would end the capture with an error that seems ringreduce's). One rank
    # captures: it raises RuntimeError, the others MismatchError naming it; then every
    # rank's next call works. Without out= too, whose allocation CUDA may refuse while
    # capturing: the check comes first.
    x, out = cupy.ones(1 << 18, cupy.float32), cupy.empty(1 << 18, cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    for capturing, given in [(rank, o) for rank in sorted({0, SIZE - 1}) for o in (out, None)]:
        with stream:
            if RANK == capturing:
                stream.begin_capture()
            try:
                if RANK == capturing:
                    with pytest.raises(RuntimeError, match=r"^ringreduce\.allreduce \(rank "
                                       r".*: the current stream is capturing a CUDA graph"):
                        comm.allreduce(x, out=given)
                elif SIZE > 1:
                    with pytest.raises(rr.MismatchError, match=f"rank {capturing}"):
                        comm.allreduce(x, out=given)
            finally:
                if RANK == capturing:
                    stream.end_capture()
        assert float(comm.allreduce(x, out=out)[0]) == SIZE


def test_calls_after_this_rank_left_name_the_call_and_the_rank():
    # (From a review.) After a Communicator broke or gave up, the GPU allreduce,
    # reduce_scatter and broadcast said "this ringreduce Communicator ..." alone.
    ring = rr.Communicator()
    ring._core.leave()  # (every rank: none waits for another)
    for name, call in [("allreduce", lambda: ring.allreduce(cupy.ones(4))),
                       ("reduce_scatter", lambda: ring.reduce_scatter(cupy.ones(4))),
                       ("broadcast", lambda: ring.broadcast(cupy.ones(4))),
                       ("allgather", lambda: ring.allgather(cupy.ones(4)))]:
        with pytest.raises(ValueError, match=rf"^ringreduce\.{name} \(rank {RANK} of {SIZE}\): "
                                             "this ringreduce Communicator has been closed"):
            call()


def test_allreduce_gradients_and_the_distributed_optimizer_on_cupy(world):
    from ringreduce.optim import SGD, Adam, DistributedOptimizer

    rng = np.random.default_rng(5)
    shapes = [(30, 20), (20,), (20, 10), (10,)]
    start = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rank_data(np.dtype(np.float32), int(np.prod(s)), salt=10 * k + i).reshape(s)
              for i, s in enumerate(shapes)] for k in range(3)]

    host = [g.copy() for g in grads[0]]
    device = [cupy.asarray(g) for g in grads[0]]
    rr.allreduce_gradients(host, bucket_mb=0.001)
    rr.allreduce_gradients(device, bucket_mb=0.001)
    for h, d in zip(host, device):
        assert bitwise_equal(cupy.asnumpy(d), h)

    for make in (lambda p: SGD(p, lr=0.1, momentum=0.9), lambda p: Adam(p, lr=0.01)):
        host_params = [p.copy() for p in start]
        gpu_params = [cupy.asarray(p) for p in start]
        host_opt = DistributedOptimizer(make(host_params), bucket_mb=0.001)
        gpu_opt = DistributedOptimizer(make(gpu_params), bucket_mb=0.001)
        for step_grads in grads:
            host_opt.step([g.copy() for g in step_grads])
            for i in reversed(range(len(shapes))):  # overlap: grads reported as backward goes
                gpu_opt.grad_ready(i, cupy.asarray(step_grads[i]))
            gpu_opt.step()
        for h, d in zip(host_params, gpu_params):
            np.testing.assert_allclose(cupy.asnumpy(d), h, rtol=1e-5, atol=1e-6)

    # float16 parameters: Adam keeps float32 moments on the GPU too (in float16, 1e-4
    # gradients sent the parameters to -inf at the first step).
    host_params = [p.astype(np.float16) for p in start]
    gpu_params = [cupy.asarray(p) for p in host_params]
    host_opt = DistributedOptimizer(Adam(host_params, lr=0.01), bucket_mb=0.001)
    gpu_opt = DistributedOptimizer(Adam(gpu_params, lr=0.01), bucket_mb=0.001)
    for step_grads in grads:
        small = [(1e-5 * g).astype(np.float16) for g in step_grads]
        host_opt.step(small)
        gpu_opt.step([cupy.asarray(g) for g in small])
    assert all(m.dtype == np.float32 for m in gpu_opt.optimizer.m + gpu_opt.optimizer.v)
    for h, d in zip(host_params, gpu_params):
        d = cupy.asnumpy(d)
        assert d.dtype == np.float16 and np.all(np.isfinite(d))
        # (the GPU's float32 sqrt and division may round a step to the next float16)
        np.testing.assert_allclose(d.astype(np.float64), h.astype(np.float64),
                                   rtol=2.0 ** -10, atol=2.0 ** -24)


def test_fp16_and_powersgd_compression_on_cupy_as_on_the_host(world):
    # fp16: gradients of 1e-9, which arrive only through the bucket's scale, as on the
    # host to float16's precision; then 0s, and 1e-21 (0 at that scale: found through
    # the count of ranks with gradients, resent alike). PowerSGD: its first all-reduce
    # starts in grad_ready on the GPU too; cuSOLVER's QR is not LAPACK's, so close
    # rather than bit for bit.
    from ringreduce.compression import PowerSGD
    from ringreduce.optim import SGD, DistributedOptimizer

    shapes = [(30, 20), (20,), (20, 10), (10,)]
    for make, magnitudes, rtol in ((lambda: "fp16", [1e-9, 0.0, 0.0, 1e-21], 2e-3),
                                   (lambda: PowerSGD(rank=2), [1.0] * 3, 1e-4)):
        host_params = [np.zeros(s, np.float32) for s in shapes]
        gpu_params = [cupy.zeros(s, np.float32) for s in shapes]
        host_opt = DistributedOptimizer(SGD(host_params, lr=1.0), bucket_mb=0.001,
                                        compression=make())
        gpu_opt = DistributedOptimizer(SGD(gpu_params, lr=1.0), bucket_mb=0.001,
                                       compression=make())
        for k, magnitude in enumerate(magnitudes):
            for p in host_params + gpu_params:
                p[...] = 0  # (so that the update is exactly what arrived)
            step_grads = [magnitude * rank_data(np.dtype(np.float32), int(np.prod(s)),
                                                salt=20 * k + i).reshape(s)
                          for i, s in enumerate(shapes)]
            host_opt.step([g.copy() for g in step_grads])
            for i in reversed(range(len(shapes))):
                gpu_opt.grad_ready(i, cupy.asarray(step_grads[i]))
            gpu_opt.step()
            assert gpu_opt.bytes_sent == host_opt.bytes_sent, k
            for h, d in zip(host_params, gpu_params):
                assert (np.abs(h).max() > 0) == (magnitude > 0)
                np.testing.assert_allclose(cupy.asnumpy(d), h, rtol=rtol,
                                           atol=rtol * magnitude)


def test_the_digits_example_trains_the_same_on_the_gpu():
    # float64 on both sides; cuBLAS and OpenBLAS sum in different orders, so the curves
    # agree closely rather than bit for bit.
    import os
    import sys

    pytest.importorskip("sklearn")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from train_digits import train

    cpu = train(epochs=3, global_batch=48, quiet=True)
    gpu = train(epochs=3, global_batch=48, quiet=True, gpu=True)
    assert gpu["device"] == "GPU (cupy)"
    np.testing.assert_allclose(gpu["loss"], cpu["loss"], rtol=1e-6)
    np.testing.assert_allclose(gpu["test_accuracy"], cpu["test_accuracy"], atol=0.01)
    fp16 = train(epochs=3, global_batch=48, quiet=True, gpu=True, compression="fp16")
    assert abs(fp16["test_accuracy"][-1] - cpu["test_accuracy"][-1]) < 0.03
