"""test_gpu.py's own tests on machines without a GPU: fake_cupy.py stands in for cupy
(its arrays compute in numpy, on the host) and the core emulates the GPU on the host.

test_gpu.py runs only where there is a GPU, which most sessions never see; here its
tests run everywhere, the same code, so that a test that is wrong, or a path for cupy
arrays that calls what cupy lacks or converts one to numpy implicitly (as in the
optimizers, compression and the digits example), fails in CI rather than on the GPU.
What only a GPU can show is left to test_gpu.py there: kernels that spin on a stream
(does the ring wait for them?), and which block cupy's memory pool hands out."""
import sys
import threading

import fake_cupy

sys.modules["cupy"] = fake_cupy  # (before test_gpu imports it; this process only)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ringreduce as rr  # noqa: E402
from ringreduce import _device, reference  # noqa: E402
from ringreduce.compression import PowerSGD  # noqa: E402
from ringreduce.optim import SGD, Adam, DistributedOptimizer  # noqa: E402

import test_gpu  # noqa: E402
from helpers import rank_data  # noqa: E402

# The tests of test_gpu.py that need a real GPU: each runs a RawKernel that spins.
GPU_ONLY = {
    "test_waits_for_slow_kernels_on_the_callers_stream",
    "test_a_queued_allgather_waits_for_the_per_thread_default_stream",
    "test_a_freed_result_still_read_on_a_per_thread_stream_is_not_overwritten",
    "test_async_collectives_wait_for_slow_kernels_on_the_callers_stream",
}
assert GPU_ONLY <= set(vars(test_gpu)), "a GPU-only test was renamed: update GPU_ONLY"

for _name, _test in list(vars(test_gpu).items()):
    if _name.startswith("test_") and callable(_test) and _name not in GPU_ONLY:
        globals()[_name] = _test
del _name, _test


@pytest.fixture(scope="module", autouse=True)
def emulated_gpu():
    with pytest.MonkeyPatch.context() as patch:
        fake_cupy.emulate_gpu(patch)
        yield


@pytest.fixture(scope="module", params=["staged", "direct"])
def gpu_comm(request):
    """test_gpu.py's fixture, with "direct" (device pointers handed to MPI) emulated
    whatever MPI says about CUDA: here the "device" pointers are host memory."""
    comm = rr.Communicator()
    comm._core.device_host_reduce_bytes = 0
    comm._direct = request.param == "direct"
    yield comm
    comm.close()


def test_the_stand_in_is_the_cupy_test_gpu_uses():
    # (were it the real cupy, or none, every test above would test something else)
    assert test_gpu.cupy is fake_cupy


# -- Several GPUs ---------------------------------------------------------------------
# The stand-in has two GPUs, and raises as cupy does where a kernel reads an array on
# another GPU than the current one (see fake_cupy.py). A model made under `with
# cupy.cuda.Device(1)` is stepped, saved and loaded outside it: what ringreduce makes
# for it (buckets, optimizer state, copies) must be on GPU 1, where cupy would put it
# on GPU 0 and then raise, read across the bus, or hand the core a pointer on the wrong
# GPU; and the numbers must be those of the same run on numpy.

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
SHAPES = [(12, 8), (8,), (8, 6), ()]  # (PowerSGD compresses the matrices)


@pytest.fixture
def on_gpu_0():
    """The test's thread on GPU 0 (the digits example, run before, leaves rank 1 on 1)."""
    with fake_cupy.cuda.Device(0):
        yield


def on_gpu(gpu, arrays):
    """Copies of numpy arrays on that GPU."""
    with fake_cupy.cuda.Device(gpu):
        return [fake_cupy.array(a) for a in arrays]


def gpus_of(value) -> list:
    """The GPU of each cupy array in value (nested in dicts, lists and tuples)."""
    if isinstance(value, fake_cupy.ndarray):
        return [value.device.id]
    if isinstance(value, dict):
        value = list(value.values())
    return [g for v in value for g in gpus_of(v)] if isinstance(value, (list, tuple)) else []


def assert_on_gpu_1(*values):
    gpus = gpus_of(values)
    assert gpus and set(gpus) == {1}, gpus


def moved_to(gpu, value):
    """value (a state) with each cupy array copied to that GPU (cupy's copy() copies
    to the current GPU)."""
    if isinstance(value, fake_cupy.ndarray):
        with fake_cupy.cuda.Device(gpu):
            return value.copy()
    if isinstance(value, dict):
        return {key: moved_to(gpu, v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(moved_to(gpu, v) for v in value)
    return value


def model(dtype="float32", steps=3, shapes=SHAPES):
    rng = np.random.default_rng(7)
    start = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [[rank_data(np.dtype(dtype), int(np.prod(s)), salt=10 * k + i).reshape(s)
              for i, s in enumerate(shapes)] for k in range(steps)]
    return start, grads


def assert_same(gpu_arrays, host_arrays, rtol=0.0):
    assert len(gpu_arrays) == len(host_arrays)
    for d, h in zip(gpu_arrays, host_arrays):
        if h is None:
            assert d is None
            continue
        assert isinstance(d, fake_cupy.ndarray) and d.dtype == h.dtype
        np.testing.assert_allclose(fake_cupy.asnumpy(d), h, rtol=rtol, atol=0)


def optimizer_arrays(optimizer) -> list:
    return optimizer.m + optimizer.v if isinstance(optimizer, Adam) else \
        [b for b in optimizer.momentum_buffers if b is not None]


def test_the_stand_in_has_two_gpus_and_refuses_kernels_across_them(on_gpu_0):
    cp = fake_cupy
    assert cp.cuda.runtime.getDeviceCount() == 2 and cp.cuda.Device().id == 0
    with cp.cuda.Device(1):
        assert cp.cuda.Device().id == cp.cuda.runtime.getDevice() == 1
        a, b = cp.arange(6.0), cp.zeros(6)
        with cp.cuda.Device(0):
            assert cp.cuda.Device().id == 0
        assert cp.cuda.Device().id == 1
        assert (a + b).device.id == 1 and a.sum().device.id == 1
    assert cp.cuda.Device().id == 0 and a.device.id == b.device.id == 1
    kernels = [lambda: a + 1, lambda: a.sum(), lambda: a.astype(np.float32),
               lambda: a.fill(0), lambda: b.__setitem__(slice(None), 1),
               lambda: cp.zeros(6).__setitem__(slice(None), a), lambda: cp.concatenate([a]),
               lambda: cp.sqrt(a), lambda: np.add(a, 1), lambda: cp.array(a),
               lambda: a.__iadd__(1), lambda: a[cp.asarray([0, 1])]]
    for kernel in kernels:
        with pytest.raises(ValueError, match=r"array resides \(1\) is different from the "
                                             r"current device \(0\)"):
            kernel()
    # What runs no kernel, from any GPU: views stay where they are; copy() copies to
    # the current GPU; get() to the host.
    assert {a[2:].device.id, a.reshape(2, 3).device.id, a.reshape(2, 3).T.device.id,
            cp.ravel(a).device.id, cp.asarray(a).device.id} == {1}
    assert a.astype(a.dtype, copy=False) is a
    assert a.copy().device.id == 0 and cp.zeros_like(a).device.id == 0
    assert float(a[1]) == 1.0 and cp.asnumpy(a).tolist() == a.get().tolist() == list(range(6))
    # The current GPU is each thread's own, GPU 0 until it sets one.
    seen = []

    def elsewhere():
        seen.append(cp.cuda.Device().id)
        cp.cuda.runtime.setDevice(1)
        seen.append((cp.cuda.Device().id, cp.empty(1).device.id))
        cp.cuda.Device(0).use()
        seen.append(cp.cuda.runtime.getDevice())

    with cp.cuda.Device(1):
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        assert cp.cuda.Device().id == 1
    assert seen == [0, (1, 1), 0]
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="invalid device ordinal"):
        cp.cuda.Device(2).use()
    assert cp.cuda.Device().id == 0


def test_the_stand_ins_streams_and_flags_are_as_strict_as_cupys(on_gpu_0):
    # cupy's current stream is per thread and per GPU: a stream is entered on the GPU
    # it was made on (another one current: RuntimeError), and is current there only.
    # Its arrays' flags have no `writeable` or `aligned`, which numpy's have.
    cp = fake_cupy
    with cp.cuda.Device(1):
        made_on_1 = cp.cuda.Stream(non_blocking=True)
    with pytest.raises(RuntimeError, match=r"stream is created on \(1\) does not match "
                                           r"with the current device \(0\)"):
        made_on_1.__enter__()
    with cp.cuda.Device(1), made_on_1:
        assert cp.cuda.get_current_stream() is made_on_1
        assert cp.cuda.get_current_stream(0) is cp.cuda.Stream.null
        with cp.cuda.Device(0):
            assert cp.cuda.get_current_stream() is cp.cuda.Stream.null
            with cp.cuda.Stream.ptds:  # (cupy's built-in streams: on any GPU)
                assert cp.cuda.get_current_stream().ptr == 2
        assert cp.cuda.get_current_stream() is made_on_1
    assert cp.cuda.get_current_stream() is cp.cuda.Stream.null
    assert made_on_1.ptr not in (0, 1, 2) and made_on_1.ptr != cp.cuda.Stream().ptr
    flags = cp.zeros(4)[::2].flags
    assert (flags.c_contiguous, flags.f_contiguous, flags["OWNDATA"]) == (False, False, False)
    for numpy_only in ("writeable", "aligned", "writebackifcopy"):
        assert not hasattr(flags, numpy_only)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("make", [lambda p: SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
                                  lambda p: Adam(p, lr=0.01, weight_decay=0.01)],
                         ids=["SGD", "Adam"])
def test_sgd_and_adam_keep_a_model_on_gpu_1_there(make, dtype, on_gpu_0):
    start, grads = model(dtype)
    host, gpu = [p.copy() for p in start], on_gpu(1, start)
    host_opt, gpu_opt = make(host), make(gpu)  # (made, stepped, saved outside the `with`)
    for step_grads in grads:
        host_opt.step([g.copy() for g in step_grads])
        gpu_opt.step(on_gpu(1, step_grads))
    assert_same(gpu, host)
    assert_same(optimizer_arrays(gpu_opt), optimizer_arrays(host_opt))
    state = gpu_opt.state_dict()
    assert_on_gpu_1(gpu, optimizer_arrays(gpu_opt), state)
    # Loaded outside the `with`, a state saved on GPU 1, on GPU 0 or on the host goes
    # where the parameters are, as torch's load_state_dict() puts it.
    for saved in (state, moved_to(0, state), host_opt.state_dict()):
        again = make(gpu)
        again.load_state_dict(saved)
        assert_on_gpu_1(optimizer_arrays(again))
        assert_same(optimizer_arrays(again), optimizer_arrays(host_opt))


@pytest.mark.parametrize("make", [lambda p: SGD(p, lr=0.1, momentum=0.9),
                                  lambda p: Adam(p, lr=0.01)], ids=["SGD", "Adam"])
def test_sgd_and_adam_step_each_parameter_on_its_own_gpu(make, on_gpu_0):
    # (No ring: nothing ties one parameter's GPU to another's.)
    start, grads = model()
    host = [p.copy() for p in start]
    gpu = on_gpu(0, start[:2]) + on_gpu(1, start[2:])
    host_opt, gpu_opt = make(host), make(gpu)
    for step_grads in grads:
        host_opt.step([g.copy() for g in step_grads])
        gpu_opt.step(on_gpu(0, step_grads[:2]) + on_gpu(1, step_grads[2:]))
    assert_same(gpu, host)
    assert gpus_of(gpu) == gpus_of(optimizer_arrays(gpu_opt)[:len(gpu)]) == [0, 0, 1, 1]


def powersgd_arrays(optimizer) -> list:
    return [] if optimizer.powersgd is None else [
        optimizer.powersgd._q, optimizer.powersgd._error]


@pytest.mark.parametrize("compression", [None, "fp16", "powersgd"])
def test_the_distributed_optimizer_keeps_a_model_on_gpu_1_there(compression, on_gpu_0):
    # (PowerSGD: the stand-in's M Q is numpy's, and what follows the averages takes the
    # host's order on a GPU too, so the bits are the host's)
    rtol = {None: 1e-6, "fp16": 2e-3, "powersgd": 0.0}[compression]
    start, grads = model(steps=4)

    def make(params):
        return DistributedOptimizer(
            SGD(params, lr=0.1, momentum=0.9), bucket_mb=0.0002,
            compression=PowerSGD(rank=2) if compression == "powersgd" else compression)

    host, gpu = [p.copy() for p in start], on_gpu(1, start)
    host_opt, gpu_opt = make(host), make(gpu)
    assert len(host_opt._buckets) > 1 or compression == "powersgd"  # (takes the matrices)
    for k, step_grads in enumerate(grads):
        if k == 1:  # a micro-batch first (no_sync)
            with host_opt.no_sync():
                host_opt.step([2 * g for g in step_grads])
            with gpu_opt.no_sync():
                gpu_opt.step(on_gpu(1, [2 * g for g in step_grads]))
            state = gpu_opt.state_dict()  # (with the sums of micro-batches)
            assert_on_gpu_1(state["accumulated"]["sums"])
        host_opt.step([g.copy() for g in step_grads])
        for i, g in reversed(list(enumerate(on_gpu(1, step_grads)))):
            gpu_opt.grad_ready(i, g)
        gpu_opt.step()
        assert_same(gpu, host, rtol)
    buffers = [[b.buffer, b.wire, b.counted, b.sums] for b in gpu_opt._buckets]
    assert_on_gpu_1(gpu, buffers, optimizer_arrays(gpu_opt.optimizer), powersgd_arrays(gpu_opt))
    state = gpu_opt.state_dict()
    assert_on_gpu_1(state["optimizer"], state.get("powersgd", {}))
    # Loaded outside the `with`: a state saved on GPU 1, on GPU 0 and on the host; and
    # rank 0's alone, which broadcast_parameters() sends (SGD's momentum buffers made
    # on the others), as on the host.
    host_state = host_opt.state_dict()
    cases = [(state, host_state), (moved_to(0, state), host_state), (host_state, host_state),
             (state if RANK == 0 else None, host_state if RANK == 0 else None)]
    for saved, host_saved in cases:
        again, host_again = make(on_gpu(1, start)), make([p.copy() for p in start])
        again.load_state_dict(saved)
        host_again.load_state_dict(host_saved)
        again.broadcast_parameters(root=0)
        host_again.broadcast_parameters(root=0)
        assert_on_gpu_1(again.params, optimizer_arrays(again.optimizer))
        again.step(on_gpu(1, grads[0]))
        host_again.step([g.copy() for g in grads[0]])
        assert_same(again.params, host_again.params, rtol)
        assert_on_gpu_1(again.params, optimizer_arrays(again.optimizer),
                        powersgd_arrays(again))


def test_allreduce_gradients_of_a_model_on_gpu_1(on_gpu_0):
    _, grads = model(shapes=[(30,), (4, 5), (7,), (100,), (3, 3)], steps=1)
    host = [g.copy() for g in grads[0]]
    gpu = on_gpu(1, grads[0])
    with fake_cupy.cuda.Device(1):
        gpu[1] = gpu[1].T  # (not contiguous: through a copy)
    host[1] = host[1].T
    rr.allreduce_gradients(host, bucket_mb=0.0002)
    rr.allreduce_gradients(gpu, bucket_mb=0.0002)
    assert_same(gpu, host)
    assert_on_gpu_1(gpu)


def test_collectives_run_on_the_gpu_of_their_arrays(gpu_comm, world, monkeypatch, on_gpu_0):
    # Also the ordinal handed to the core (which the host emulation does not use).
    ordinals = []
    args = _device._Launch.args
    monkeypatch.setattr(_device._Launch, "args",
                        lambda self, *a: ordinals.append(self.device) or args(self, *a))
    data = rank_data(np.dtype(np.float32), 6 * 50).reshape(6, 50)
    x, = on_gpu(1, [data])
    with fake_cupy.cuda.Device(1):
        strided, out = x[:, ::2], fake_cupy.empty(x.shape, x.dtype)
    expected = reference.allreduce(data, "sum")
    results = [gpu_comm.allreduce(x), gpu_comm.allreduce(strided),
               gpu_comm.allreduce_async(x).wait()]
    assert gpu_comm.allreduce(x, out=out) is out
    for got, want in zip(results + [out], [expected, expected[:, ::2], expected, expected]):
        np.testing.assert_array_equal(fake_cupy.asnumpy(got), want)
    part = gpu_comm.reduce_scatter(x)
    with fake_cupy.cuda.Device(1):
        part_out = fake_cupy.empty(part.shape, part.dtype)
    assert gpu_comm.reduce_scatter(x, out=part_out) is part_out
    np.testing.assert_array_equal(fake_cupy.asnumpy(part_out),
                                  reference.reduce_scatter(data, "sum"))
    gathered = gpu_comm.allgather(x)
    with fake_cupy.cuda.Device(1):
        gathered_out = fake_cupy.empty(gathered.shape, gathered.dtype)
    assert gpu_comm.allgather(x, out=gathered_out) is gathered_out
    np.testing.assert_array_equal(fake_cupy.asnumpy(gathered_out),
                                  np.concatenate(world.allgather(data)))
    with fake_cupy.cuda.Device(1):
        mine = x[:, ::3].copy()  # (a view: broadcast into it through a copy)
    assert gpu_comm.broadcast(strided, root=0) is strided
    np.testing.assert_array_equal(fake_cupy.asnumpy(strided),
                                  world.bcast(fake_cupy.asnumpy(strided), root=0))
    assert gpu_comm.broadcast_async(mine, root=0).wait() is mine
    assert_on_gpu_1(results, out, part, part_out, gathered, gathered_out, mine)
    assert ordinals and set(ordinals) == {1}, ordinals
    assert fake_cupy.cuda.Device().id == 0  # (the caller's thread keeps its GPU)


# -- Arrays of one call on different GPUs ---------------------------------------------

@pytest.mark.parametrize("make", [lambda p: SGD(p, lr=0.1), lambda p: Adam(p)],
                         ids=["SGD", "Adam"])
def test_a_gradient_on_another_gpu_than_its_parameter_is_refused(make, on_gpu_0):
    start, grads = model()
    params = on_gpu(1, start)
    optimizer = make(params)
    given = on_gpu(1, grads[0][:1]) + on_gpu(0, grads[0][1:2]) + on_gpu(1, grads[0][2:])
    name = type(optimizer).__name__
    with pytest.raises(ValueError, match=rf"^{name}.step: grads\[1\] is on GPU 0, but "
                                         r"params\[1\] is on GPU 1"):
        optimizer.step(given)
    assert_same(params, start)  # (nothing updated)


def test_the_distributed_optimizer_refuses_parameters_on_different_gpus(on_gpu_0):
    start, grads = model()
    params = on_gpu(1, start[:2]) + on_gpu(0, start[2:])
    where = rf"ringreduce.DistributedOptimizer \(rank {RANK} of {SIZE}\)"
    with pytest.raises(ValueError, match=rf"^{where}: params\[2\] is on GPU 0, but "
                                         r"params\[0\] is on GPU 1"):
        DistributedOptimizer(SGD(params, lr=0.1))
    # One rank's refusal is every rank's.
    params = on_gpu(1, start[:2]) + on_gpu(0 if RANK == 0 else 1, start[2:])
    with pytest.raises(ValueError if RANK == 0 else rr.MismatchError,
                       match="GPU 0" if RANK == 0 else "rank 0"):
        DistributedOptimizer(SGD(params, lr=0.1))


def test_the_distributed_optimizer_refuses_a_gradient_on_another_gpu(on_gpu_0):
    start, grads = model()
    params = on_gpu(1, start)
    optimizer = DistributedOptimizer(SGD(params, lr=0.1), bucket_mb=0.0002)
    where = rf"ringreduce.DistributedOptimizer.grad_ready \(rank {RANK} of {SIZE}\)"
    given = on_gpu(1, grads[0])
    with pytest.raises(ValueError, match=rf"^{where}: grads\[3\] is on GPU 0, but "
                                         r"params\[3\] is on GPU 1"):
        optimizer.grad_ready(3, on_gpu(0, grads[0][3:])[0])
    where = where.replace("grad_ready", "step")
    with pytest.raises(ValueError, match=rf"^{where}: grads\[0\] is on GPU 0"):
        optimizer.step(on_gpu(0, grads[0][:1]) + given[1:])
    assert_same(params, start)
    optimizer.step(given)  # (the next step goes on)
    assert_on_gpu_1(params)


def test_allreduce_gradients_refuses_gradients_on_different_gpus(on_gpu_0):
    _, grads = model(steps=1)
    given = on_gpu(1, grads[0][:3]) + on_gpu(0 if RANK == 0 else 1, grads[0][3:])
    if RANK == 0:
        where = rf"ringreduce.allreduce_gradients \(rank 0 of {SIZE}\)"
        with pytest.raises(ValueError, match=rf"^{where}: grads\[3\] is on GPU 0, but "
                                             r"grads\[0\] is on GPU 1"):
            rr.allreduce_gradients(given)
    else:
        with pytest.raises(rr.MismatchError, match="rank 0"):
            rr.allreduce_gradients(given)
    assert_same(given, grads[0])  # (nothing reduced)


def test_out_on_another_gpu_than_x_is_refused(gpu_comm, on_gpu_0):
    x, = on_gpu(1, [np.ones(12, np.float32)])
    out = fake_cupy.ones(12, np.float32)
    part = len(gpu_comm.reduce_scatter(x))
    for call in (lambda: gpu_comm.allreduce(x, out=out),
                 lambda: gpu_comm.allreduce_async(x, out=out),
                 lambda: gpu_comm.reduce_scatter(x, out=out[:part]),
                 lambda: gpu_comm.allgather(x, out=fake_cupy.empty(12 * SIZE, x.dtype)),
                 lambda: gpu_comm.allgather_async(x, out=fake_cupy.empty(12 * SIZE, x.dtype))):
        with pytest.raises(ValueError, match=r"out is on GPU 0 but x is on GPU 1"):
            call()
