"""The CUDA part: it is compiled wherever nvcc is (CI included), says truthfully whether
a GPU is usable, and a GPU array without one gets a clear error, not a crash. The kernel
tests run only where cupy and a GPU are."""
import os
import shutil

import numpy as np
import pytest

import ringreduce as rr
from ringreduce import _core, reference

try:
    import cupy
except ImportError:
    cupy = None

needs_gpu = pytest.mark.skipif(cupy is None or not rr.cuda_available(),
                               reason="needs cupy and a usable GPU")


def test_cuda_part_is_built_where_nvcc_is():
    if os.environ.get("RINGREDUCE_CUDA") == "0" or not (
            shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")):
        pytest.skip("no nvcc here, or CUDA turned off")
    assert _core.cuda_built()


def test_cuda_available_tells_the_truth():
    count = _core.cuda_device_count()
    assert rr.cuda_available() == (_core.cuda_built() and count > 0)
    status = _core.cuda_status()
    assert status  # e.g. "no usable GPU: CUDA driver version is insufficient ..."
    if not rr.cuda_available():
        assert "GPU" in status or "CUDA" in status


def test_a_gpu_array_without_a_gpu_gets_a_clear_error():
    if rr.cuda_available():
        pytest.skip("this machine has a GPU")

    class DeviceArray:  # what cupy arrays present; no cupy or GPU needed to test it
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                    "version": 3}

    with pytest.raises(TypeError, match="no usable GPU"):
        rr.allreduce(DeviceArray())


@needs_gpu
@pytest.mark.parametrize("name", list(_core.DTYPES))
@pytest.mark.parametrize("op", list(_core.OPS))
def test_gpu_kernels_match_the_cpu_kernels_bit_for_bit(name, op):
    code, op_code = _core.DTYPES.index(name), _core.OPS.index(op)
    if not _core.op_supported(code, op_code):
        pytest.skip(f"{op} is not defined for {name}")
    rng = np.random.default_rng(3)
    n = 10_007  # not a multiple of the vector width: exercises the tail
    # bfloat16 (which cupy lacks, and numpy without ml_dtypes) travels as its bits in
    # uint16: the upper half of a float32's bits is a bfloat16.
    dtype = np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)
    if name == "bfloat16":
        a, b = (((rng.standard_normal(n).astype(np.float32) * 100).view(np.uint32) >> 16)
                .astype(np.uint16) for _ in "ab")
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        a, b = (rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True) for _ in "ab")
    elif dtype.kind == "c":
        a, b = ((rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
                for _ in "ab")
    else:
        a, b = ((rng.standard_normal(n) * 100).astype(dtype) for _ in "ab")
    expected = np.empty_like(a)
    _core.reduce(expected, a, b, code, op_code)
    da, db = cupy.asarray(a), cupy.asarray(b)
    dout = cupy.empty_like(da)
    stream = cupy.cuda.get_current_stream().ptr
    _core.cuda_reduce(dout.data.ptr, da.data.ptr, db.data.ptr, n, code, op_code, stream)
    assert cupy.asnumpy(dout).tobytes() == expected.tobytes()
    # misaligned views take the element-by-element path
    _core.cuda_reduce(dout[1:].data.ptr, da[1:].data.ptr, db[1:].data.ptr, n - 1, code,
                      op_code, stream)
    assert cupy.asnumpy(dout[1:]).tobytes() == expected[1:].tobytes()
    if op == "avg":
        _core.cuda_divide(dout.data.ptr, n, code, 3, stream)
        cpu = expected.copy()
        if name == "bfloat16":
            _core.divide(cpu, code, 3)
        else:
            reference._divide(cpu, 3)
        assert cupy.asnumpy(dout).tobytes() == cpu.tobytes()
