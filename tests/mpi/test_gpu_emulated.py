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

import ringreduce as rr  # noqa: E402

import test_gpu  # noqa: E402

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

@pytest.fixture
def on_gpu_0():
    """The test's thread on GPU 0 (the digits example, run before, leaves rank 1 on 1)."""
    with fake_cupy.cuda.Device(0):
        yield


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
