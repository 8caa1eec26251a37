"""The CUDA part: it is compiled wherever nvcc is (CI included), says truthfully whether
a GPU is usable, and a GPU array without one gets a clear error, not a crash. The kernel
tests run only where cupy and a GPU are."""
import os
import re
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
    if _core.cuda_built() and count == 0:  # which CUDA it needs, and what the driver is
        assert re.search(r"^no usable GPU: .* \(built with CUDA \d+\.\d+; driver: "
                         r"(none|CUDA \d+\.\d+)\)$", status), status


def test_a_gpu_array_without_a_gpu_gets_a_clear_error():
    if rr.cuda_available():
        pytest.skip("this machine has a GPU")

    class DeviceArray:  # what cupy arrays present; no cupy or GPU needed to test it
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                    "version": 3}

    with pytest.raises(TypeError, match="no usable GPU"):
        rr.allreduce(DeviceArray())


def storage(name):
    # bfloat16 (which cupy lacks, and numpy without ml_dtypes) travels as its bits in
    # uint16: the upper half of a float32's bits is a bfloat16.
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


# Each float type's awkward values, as bits: +0, -0, the smallest subnormal, the
# largest negative subnormal, the smallest normal, 1, -1, 2, the largest finite of
# each sign, +inf, -inf, a quiet NaN, a negative NaN with a payload, a signalling NaN.
SPECIAL_BITS = {
    "float16": (np.uint16, [0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x3C00, 0xBC00, 0x4000,
                            0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01]),
    "bfloat16": (np.uint16, [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x3F80, 0xBF80, 0x4000,
                             0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81]),
    "float32": (np.uint32, [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000,
                            0x3F800000, 0xBF800000, 0x40000000, 0x7F7FFFFF, 0xFF7FFFFF,
                            0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001]),
    "float64": (np.uint64, [0x0000000000000000, 0x8000000000000000, 0x0000000000000001,
                            0x800FFFFFFFFFFFFF, 0x0010000000000000, 0x3FF0000000000000,
                            0xBFF0000000000000, 0x4000000000000000, 0x7FEFFFFFFFFFFFFF,
                            0xFFEFFFFFFFFFFFFF, 0x7FF0000000000000, 0xFFF0000000000000,
                            0x7FF8000000000000, 0xFFF8000000000001, 0x7FF0000000000001]),
}

PART = {"complex64": "float32", "complex128": "float64"}  # a complex number's parts


def cpu_kernels(a, b, code, op_code):
    """(a OP b, and for avg that / 3) by the CPU kernels (the division numpy's, but
    bfloat16's, which numpy lacks)."""
    out = np.empty_like(a)
    _core.reduce(out, a, b, code, op_code)
    if _core.OPS[op_code] != "avg":
        return out, None
    divided = out.copy()
    if _core.DTYPES[code] == "bfloat16":
        _core.divide(divided, code, 3)
    else:
        reference._divide(divided, 3)
    return out, divided


def misaligned(a, shift):
    """a's elements from `shift` bytes in (one fewer): see gpu_kernels."""
    return a.view(np.uint8)[shift:shift + (a.size - 1) * a.itemsize].view(a.dtype)


def gpu_kernels(a, b, code, op_code, shift=0):
    """cpu_kernels' results by the GPU kernels. With a shift, every pointer is `shift`
    bytes into its buffer, and the arrays are misaligned(a, shift) and misaligned(b,
    shift): where shift is no multiple of 16 the kernel takes its element-by-element
    path (a 16-byte complex128 one element in would still be aligned: shift it by 8).
    The result's buffer starts as all ones bits (a NaN in every float type), so that
    an element the kernel leaves out shows."""
    da, db = cupy.asarray(a), cupy.asarray(b)
    dout = cupy.full(a.nbytes, 0xFF, dtype=cupy.uint8)
    n = a.size - (1 if shift else 0)
    out = dout.data.ptr + shift
    stream = cupy.cuda.get_current_stream().ptr

    def result():
        return cupy.asnumpy(dout)[shift:shift + n * a.itemsize].view(a.dtype)

    _core.cuda_reduce(out, da.data.ptr + shift, db.data.ptr + shift, n, code, op_code, stream)
    reduced = result()
    if _core.OPS[op_code] != "avg":
        return reduced, None
    _core.cuda_divide(out, n, code, 3, stream)
    return reduced, result()


def float_parts(x, name):
    """(bits, is NaN) of x's floats: a complex number's two parts, bfloat16's bits."""
    if name == "bfloat16":
        bits = x.view(np.uint16)
        return bits, (bits & 0x7FFF) > 0x7F80
    floats = x.view(PART.get(name, name))
    return floats.view(f"u{floats.itemsize}"), np.isnan(floats)


def assert_same_bits(got, expected, name, what, nan_bits=True):
    """Bit for bit; with nan_bits=False, a NaN need only meet a NaN: the GPU's float
    arithmetic makes one canonical NaN where the CPU's passes an operand's on (min and
    max pass the operand itself on, so there every NaN's bits count)."""
    if name not in SPECIAL_BITS and name not in PART:  # integers
        assert got.tobytes() == expected.tobytes(), what
        return
    got_bits, got_nan = float_parts(got, name)
    bits, nan = float_parts(expected, name)
    differ = got_bits != bits
    if not nan_bits:
        differ = (got_nan != nan) | (differ & ~nan)
    wrong = np.flatnonzero(differ)
    assert wrong.size == 0, (f"{what}: {wrong.size} of {bits.size} differ, first at "
                             f"{wrong[:6]}: {got_bits[wrong[:6]]} against the CPU's "
                             f"{bits[wrong[:6]]}")


@needs_gpu
@pytest.mark.parametrize("name", list(_core.DTYPES))
@pytest.mark.parametrize("op", list(_core.OPS))
def test_gpu_kernels_match_the_cpu_kernels_bit_for_bit(name, op):
    code, op_code = _core.DTYPES.index(name), _core.OPS.index(op)
    if not _core.op_supported(code, op_code):
        pytest.skip(f"{op} is not defined for {name}")
    rng = np.random.default_rng(3)
    n = 10_007  # not a multiple of the vector width: exercises the tail
    dtype = storage(name)
    if name == "bfloat16":
        a, b = (((rng.standard_normal(n).astype(np.float32) * 100).view(np.uint32) >> 16)
                .astype(np.uint16) for _ in "ab")
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        a, b = (rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True) for _ in "ab")
    elif dtype.kind == "b":  # bytes 2 and 3 too: True, written back as 1
        a, b = (rng.integers(0, 4, n, dtype=np.uint8).view(bool) for _ in "ab")
    elif dtype.kind == "c":
        a, b = ((rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
                for _ in "ab")
    else:
        a, b = ((rng.standard_normal(n) * 100).astype(dtype) for _ in "ab")
    check_against_the_cpu(name, op, a, b)


def check_against_the_cpu(name, op, a, b):
    code, op_code = _core.DTYPES.index(name), _core.OPS.index(op)
    arithmetic = op not in ("min", "max")
    for shift in (0, a.itemsize % 16 or 8):
        expected = cpu_kernels(misaligned(a, shift) if shift else a,
                               misaligned(b, shift) if shift else b, code, op_code)
        got = gpu_kernels(a, b, code, op_code, shift)
        assert_same_bits(got[0], expected[0], name, f"{name} {op}, {shift} bytes in",
                         nan_bits=not arithmetic)
        if op == "avg":
            assert_same_bits(got[1], expected[1], name, f"{name} avg's division, {shift} "
                             "bytes in", nan_bits=False)


def test_the_cpu_half_of_the_comparison_reads_misaligned_views():
    # check_against_the_cpu hands the CPU kernels views `shift` bytes into their
    # buffers, which only the GPU tests do: here, without a GPU, that they take them,
    # and give what they give for aligned copies of the same elements.
    rng = np.random.default_rng(4)
    for name in _core.DTYPES:
        a, b = (rng.integers(0, 256, 16 * 101, dtype=np.uint8).view(storage(name))
                for _ in "ab")
        shift = a.itemsize % 16 or 8
        code = _core.DTYPES.index(name)
        for op in _core.OPS:
            op_code = _core.OPS.index(op)
            if not _core.op_supported(code, op_code):
                continue
            views = misaligned(a, shift), misaligned(b, shift)
            got = cpu_kernels(*views, code, op_code)
            copies = cpu_kernels(*(v.copy() for v in views), code, op_code)
            for g, c in zip(got, copies):
                if c is not None:
                    assert g.tobytes() == c.tobytes(), f"{name} {op}, {shift} bytes in"


def special_operands(name):
    """(a, b): every pair of the awkward values, in both orders (for complex numbers,
    every pair of (re, im) pairs of the part's awkward values)."""
    bits_type, bits = SPECIAL_BITS[PART.get(name, name)]
    values = np.array(bits, dtype=bits_type)
    if name in PART:
        values = np.stack([np.repeat(values, len(bits)), np.tile(values, len(bits))], axis=1)
    a = np.repeat(values, len(values), axis=0)
    b = np.concatenate([values] * len(values))
    return tuple(np.ascontiguousarray(v).view(storage(name)).reshape(-1) for v in (a, b))


def widened(x, name):
    """x's values in a type numpy compares exactly (bfloat16 from its bits)."""
    if name == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x


def test_the_cpu_kernels_keep_the_rules_on_awkward_values():
    # What the GPU test below holds the GPU kernels to, held to the rules themselves:
    # min and max keep a NaN (a's first) and, of two equal values (+0 and -0), a; x + 0
    # is x for every x but NaN and -0 (no subnormal flushed to zero).
    for name in SPECIAL_BITS:
        code = _core.DTYPES.index(name)
        a, b = special_operands(name)
        x, y = widened(a, name), widened(b, name)
        for op, keeps_a in (("min", (x <= y) | (x != x)), ("max", (x >= y) | (x != x))):
            got, _ = cpu_kernels(a, b, code, _core.OPS.index(op))
            assert_same_bits(got, np.where(keeps_a, a, b), name, f"{name} {op}")
        got, _ = cpu_kernels(a, b, code, _core.OPS.index("sum"))
        plus_zero = (float_parts(b, name)[0] == 0) & (x == x) & ~((x == 0) & np.signbit(x))
        assert_same_bits(got[plus_zero], a[plus_zero], name, f"{name} x + 0")


@needs_gpu
@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64", "complex64",
                                  "complex128"])
@pytest.mark.parametrize("op", list(_core.OPS))
def test_gpu_kernels_match_the_cpu_kernels_on_awkward_values(name, op):
    # NaNs of both signs with payloads, signalling NaNs, infinities, subnormals, +0
    # against -0: a build that flushes subnormals to zero (fast math), or another NaN
    # or tie rule in the GPU's min and max, shows here and not on random data.
    if not _core.op_supported(_core.DTYPES.index(name), _core.OPS.index(op)):
        pytest.skip(f"{op} is not defined for {name}")
    check_against_the_cpu(name, op, *special_operands(name))


@needs_gpu
@pytest.mark.parametrize("name", ["float16", "float64"])
def test_gpu_kernels_past_one_pass_of_the_grid(name):
    # The kernels launch at most 65,535 blocks of 256 threads (16,776,960) and loop for
    # the rest. Here the loop takes a second turn in the misaligned (element by element)
    # path of both types, and in float64's aligned path too (two elements a thread: 2^24
    # + 2,049 pairs; float16's, eight a thread, stays in one). An element that a turn
    # leaves out keeps the result buffer's NaN.
    n = (1 << 25) + 4099
    dtype = np.dtype(name)
    # (periods of two primes: the pair (a, b) repeats only every 8,345,627 elements)
    a = np.resize(np.arange(-1019, 1020, dtype=dtype), n)
    b = np.resize((np.arange(4093) * 0.25).astype(dtype), n)
    try:
        check_against_the_cpu(name, "sum", a, b)
    finally:
        cupy.get_default_memory_pool().free_all_blocks()
