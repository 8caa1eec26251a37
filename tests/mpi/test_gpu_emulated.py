"""test_gpu.py's own tests on machines without a GPU: fake_cupy.py stands in for cupy
(its arrays compute in numpy, on the host) and the core emulates the GPU on the host.

test_gpu.py runs only where there is a GPU, which most sessions never see; here its
tests run everywhere, the same code, so that a test that is wrong, or a path for cupy
arrays that calls what cupy lacks or converts one to numpy implicitly (as in the
optimizers, compression and the digits example), fails in CI rather than on the GPU.
What only a GPU can show is left to test_gpu.py there: kernels that spin on a stream
(does the ring wait for them?), and which block cupy's memory pool hands out."""
import sys

import fake_cupy

sys.modules["cupy"] = fake_cupy  # (before test_gpu imports it; this process only)

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
