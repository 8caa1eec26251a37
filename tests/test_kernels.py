"""The core's reduction kernels against numpy, one process, every dtype x op, with
the special values (NaN, inf, signed zeros, subnormals, overflow) that break them."""
import platform

import numpy as np
import pytest

from ringreduce import _core, reference

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BFLOAT16 = None

NAMES = [n for n in _core.DTYPES if n != "bfloat16" or BFLOAT16 is not None]


def dtype_of(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


@pytest.fixture(autouse=True, params=["cpu", "baseline"])
def kernels(request):
    """Every test runs with each build of the loops: those chosen for this CPU (AVX2,
    float16 with F16C) and the baseline, which a CPU without them runs."""
    if not _core.use_cpu_kernels(request.param == "cpu") and request.param == "cpu":
        pytest.skip("this CPU has neither AVX2 nor F16C")
    yield request.param
    _core.use_cpu_kernels(True)


def core_reduce(a, b, op):
    out = np.empty_like(a)
    _core.reduce(out, a, b, _core.DTYPES.index(a.dtype.name), _core.OPS.index(op))
    return out


def numpy_reduce(a, b, op):
    if op == "prod" and a.dtype.kind == "c" or op in ("min", "max"):
        # (numpy's own min and max keep either of +0 and -0, by dtype: see the reference)
        out = np.empty_like(a)
        reference.REDUCE[op](a, b, out=out)
        return out
    with np.errstate(all="ignore"):
        return {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
                "max": np.maximum}[op](a, b)


def samples(dtype, n, rng):
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    real = rng.standard_normal(n) * rng.choice([1e-6, 1e-3, 1.0, 1e3, 1e5], n)
    if dtype.kind == "c":
        return (real + 1j * rng.standard_normal(n)).astype(dtype)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 6e-8, -6e-8, 65504.0, 1e-40])
    with np.errstate(over="ignore"):
        return np.concatenate([real, special]).astype(dtype)


COMBOS = [(name, op) for name in NAMES for code, op in enumerate(_core.OPS)
          if _core.op_supported(_core.DTYPES.index(name), code)]


@pytest.mark.parametrize("name,op", COMBOS)
def test_kernel_matches_numpy_bit_for_bit(name, op):
    dtype = dtype_of(name)
    rng = np.random.default_rng(7)
    a, b = samples(dtype, 5000, rng), samples(dtype, 5000, rng)
    if dtype.kind == "f" or dtype == BFLOAT16:
        b = np.concatenate([b[: len(b) - 9], rng.permutation(b[len(b) - 9:])])
    got = core_reduce(a, b, op)
    want = numpy_reduce(a, b, op)
    nan = np.isnan(want.astype(np.complex128)) if dtype.kind in "fcV" else np.zeros(len(a), bool)
    # NaN payloads may differ; everything else must be the same bytes.
    assert np.array_equal(np.isnan(got.astype(np.complex128)) if dtype.kind in "fcV" else nan, nan)
    assert got[~nan].tobytes() == want[~nan].tobytes()


def unaligned(x, offset):
    """A copy of x that starts `offset` bytes past a 64-byte boundary."""
    raw = np.zeros(x.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    copy = raw[start:start + x.nbytes].view(x.dtype)
    copy[...] = x
    return copy


@pytest.mark.parametrize("name,op", COMBOS)
def test_kernels_take_arrays_at_any_address(name, op):
    # numpy makes arrays that start at any byte (np.frombuffer at an odd offset, a field
    # of a packed record), and the kernels take them as they are. The results match on
    # any x86 build; the UBSan build (docs/development.md) reported "store to misaligned
    # address" here until such arrays took a loop of their own (csrc/reduce.cc).
    dtype = dtype_of(name)
    rng = np.random.default_rng(11)
    a, b = samples(dtype, 1000, rng), samples(dtype, 1000, rng)
    want = core_reduce(a, b, op).tobytes()
    code, op_code = _core.DTYPES.index(name), _core.OPS.index(op)
    for offset in (1, 3, 7):
        out = unaligned(np.zeros_like(a), offset)
        _core.reduce(out, unaligned(a, offset + 1), unaligned(b, offset + 2), code, op_code)
        assert out.tobytes() == want
        in_place = unaligned(a, offset)
        _core.reduce(in_place, in_place, unaligned(b, offset), code, op_code)
        assert in_place.tobytes() == want
    if op == "avg":
        divided = core_reduce(a, b, op)
        _core.divide(divided, code, 3)
        out = unaligned(core_reduce(a, b, op), 1)
        _core.divide(out, code, 3)
        assert out.tobytes() == divided.tobytes()


@pytest.mark.parametrize("name", [n for n in NAMES if dtype_of(n).kind == "f" or n == "bfloat16"])
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_and_max_keep_the_first_of_equal_values_and_nans(name, op):
    # Every pair of special values (the permuted tail above rarely pairs +0 with -0):
    # the same bytes as the reference, NaN payloads included, as an operand is chosen.
    dtype = dtype_of(name)
    with np.errstate(over="ignore", invalid="ignore"):
        special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0]).astype(dtype)
    a, b = np.repeat(special, len(special)), np.tile(special, len(special))
    want = np.empty_like(a)
    reference.REDUCE[op](a, b, out=want)
    assert core_reduce(a, b, op).tobytes() == want.tobytes()
    zeros = np.array([0.0, -0.0]).astype(dtype)
    first = core_reduce(zeros, zeros[::-1].copy(), op)
    assert np.signbit(first.astype(np.float32)).tolist() == [False, True]
    with pytest.raises(ValueError, match="C-contiguous"):
        core_reduce(zeros, zeros[::-1], op)  # (read from before its start, once)
    wider = _core.DTYPES.index("complex128")
    with pytest.raises(ValueError, match="does not fit"):
        _core.reduce(zeros.copy(), zeros, zeros, wider, _core.OPS.index("sum"))


def test_in_place_kernel():
    a = np.arange(100, dtype=np.float32)
    b = np.full(100, 0.5, np.float32)
    expected = a + b
    _core.reduce(a, a, b, _core.DTYPES.index("float32"), _core.OPS.index("sum"))
    np.testing.assert_array_equal(a, expected)


def test_every_float16_survives_a_round_trip():
    # x + 0 widens every one of the 65536 float16 values to float32 and rounds back.
    every = np.arange(65536, dtype=np.uint16).view(np.float16)
    got = core_reduce(every, np.zeros_like(every), "sum")
    finite = ~np.isnan(every)
    assert got[finite].tobytes() == (every[finite] + np.float16(0)).tobytes()
    assert np.isnan(got[~finite]).all()


@pytest.mark.parametrize("name", ["float16", "float32", "float64", "complex64", "complex128"]
                         + (["bfloat16"] if BFLOAT16 is not None else []))
@pytest.mark.parametrize("divisor", [1, 3, 7, 1024, 2049])  # (2049: no float16)
def test_divide_matches_the_reference(name, divisor):
    dtype = dtype_of(name)
    x = samples(dtype, 3000, np.random.default_rng(divisor))
    got = x.copy()
    _core.divide(got, _core.DTYPES.index(name), divisor)
    want = x.copy()
    reference._divide(want, divisor)
    finite = ~np.isnan(want.astype(np.complex128))
    assert got[finite].tobytes() == want[finite].tobytes()


def test_segments_follow_array_split():
    for size in range(1, 9):
        for count in range(0, 30):
            split = np.array_split(np.arange(count), size)
            for rank in range(size):
                offset, n = _core.segment_of(rank, size, count)
                assert n == len(split[rank])
                assert (offset, offset + n) == reference.segment_bounds(count, size)[rank]
                if n:
                    assert offset == split[rank][0]


@pytest.mark.parametrize("op", ["sum", "prod"])
def test_float16_every_value_against_numpy(op):
    # Every float16 value meets a random partner, four times: the vectorised path
    # (F16C where the CPU has it) and the scalar tail must both round like numpy.
    every = np.arange(65536, dtype=np.uint16).view(np.float16)
    rng = np.random.default_rng(11)
    for _ in range(4):
        x, y = rng.permutation(every), rng.permutation(every)
        got = core_reduce(x, y, op)
        want = numpy_reduce(x, y, op)
        nan = np.isnan(want)
        assert got[~nan].tobytes() == want[~nan].tobytes()
        assert np.isnan(got[nan]).all()


@pytest.mark.skipif(BFLOAT16 is None, reason="needs ml_dtypes")
@pytest.mark.parametrize("op", ["sum", "prod", "avg"])
def test_bfloat16_every_value_against_numpy(op):
    # As for float16. Where the CPU rounds to bfloat16 itself (AVX512-BF16), it flushes
    # subnormal results to zero: so every subnormal also meets every other's neighbours,
    # and every small normal its neighbour's negation, whose sums are subnormal.
    every = np.arange(65536, dtype=np.uint16).view(BFLOAT16)
    rng = np.random.default_rng(12)
    pairs = [(rng.permutation(every), rng.permutation(every)) for _ in range(4)]
    subnormal = np.arange(1, 128, dtype=np.uint16)
    subnormal = np.concatenate([subnormal, subnormal | 0x8000])
    for shift in range(1, 9):  # (each subnormal with 8 others, at every place in 8 lanes)
        pairs.append((subnormal.view(BFLOAT16), np.roll(subnormal, shift).view(BFLOAT16)))
    small = np.arange(0x80, 0x200, dtype=np.uint16)
    pairs.append((small.view(BFLOAT16), (small[::-1] ^ 0x8000).view(BFLOAT16)))
    pairs.append((small.view(BFLOAT16), ((small + 1) ^ 0x8000).view(BFLOAT16)))
    for x, y in pairs:
        got = core_reduce(x, y, op)
        want = numpy_reduce(x, y, op)
        nan = np.isnan(want)
        assert got[~nan].tobytes() == want[~nan].tobytes()
        assert np.isnan(got[nan]).all()
    tiny = np.concatenate([subnormal, small]).view(BFLOAT16)
    for divisor in (2, 3, 1000):  # (quotients of small normals are subnormal)
        got = tiny.copy()
        _core.divide(got, _core.DTYPES.index("bfloat16"), divisor)
        want = tiny.copy()
        reference._divide(want, divisor)
        assert got.tobytes() == want.tobytes()


def test_undefined_combinations_raise_instead_of_crashing():
    z = np.ones(3, np.complex64)
    with pytest.raises(ValueError, match="min"):
        _core.reduce(np.empty_like(z), z, z, _core.DTYPES.index("complex64"),
                     _core.OPS.index("min"))
    with pytest.raises(ValueError, match="average"):
        _core.divide(np.ones(3, np.int32), _core.DTYPES.index("int32"), 2)


def test_float16_nan_payloads_survive_like_numpys():
    # Quiet NaNs with payloads, on the vectorised path and the scalar tail alike.
    nan = np.full(11, 0x7E01, np.uint16).view(np.float16)
    got = core_reduce(nan, np.zeros_like(nan), "sum")
    assert got.view(np.uint16).tolist() == (nan + np.float16(0)).view(np.uint16).tolist()


@pytest.mark.skipif(BFLOAT16 is None, reason="needs ml_dtypes")
def test_bfloat16_nans_keep_their_sign_and_payload_like_numpys():
    # (From a review.) The test above checks bfloat16 NaNs only as NaNs: a rounding that
    # dropped a NaN's sign (0xffc0 made 0x7fc0) passed it. 33 of each: the vectorised
    # loop and the scalar tail.
    nans = np.array([0xFFC0, 0xFF81, 0x7FC1, 0xFFFF] * 33, np.uint16).view(BFLOAT16)
    for other in (np.ones_like(nans), np.zeros_like(nans)):
        got = core_reduce(nans, other, "sum")
        with np.errstate(invalid="ignore"):  # (0xff81 is a signalling NaN)
            want = nans + other
        assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist()


def test_streaming_copies_are_copies_at_every_alignment_and_size():
    # copy_streaming() writes a shared-memory slot when the tuner picks streaming stores;
    # the slots are aligned, so the ring never tries its unaligned starts and short ends.
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, 600, dtype=np.uint8)
    for dst_offset in range(0, 80, 3):
        for src_offset in (0, 1, 8, 15):
            for n in list(range(0, 140)) + [191, 192, 193, 255, 256, 257, 300]:
                dst = np.full(n + dst_offset + 16, 0xAA, np.uint8)
                _core.copy_streaming(dst[dst_offset:dst_offset + n],
                                     source[src_offset:src_offset + n])
                assert dst[dst_offset:dst_offset + n].tobytes() == \
                    source[src_offset:src_offset + n].tobytes(), (dst_offset, src_offset, n)
                assert (dst[:dst_offset] == 0xAA).all() and (dst[dst_offset + n:] == 0xAA).all()
    with pytest.raises(ValueError, match="overlap"):
        _core.copy_streaming(source[8:108], source[:100])
    with pytest.raises(ValueError, match="as many bytes"):
        _core.copy_streaming(np.empty(4, np.uint8), source[:5])


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_bools_of_any_byte_come_out_as_numpy_writes_them(op):
    # A bool array viewed from other bytes (np.frombuffer, a uint8 view) may hold 2 or
    # 255 for True: numpy's ufuncs read any nonzero byte as True and write 1.
    raw = np.array([0, 1, 2, 255, 0, 7, 128, 0], np.uint8)
    a, b = raw.view(bool), np.roll(raw, 3).view(bool)
    got = core_reduce(a, b, op)
    expected = {"sum": np.add, "prod": np.multiply, "min": np.minimum,
                "max": np.maximum}[op](a, b)
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
    assert set(got.view(np.uint8).tolist()) <= {0, 1}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64's MXCSR")
@pytest.mark.parametrize("name", ["float32", "float64", "complex64", "complex128"])
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_subnormals_follow_ieee_in_a_thread_that_flushes_them(name, op, kernels):
    # A library built with -ffast-math turns flush-to-zero on in the thread that loads
    # it: that rank's reductions of calls done in the header exchange (each rank reduces
    # every segment itself) rounded otherwise than the other ranks', silently.
    dtype = np.dtype(name)
    if not _core.op_supported(_core.DTYPES.index(name), _core.OPS.index(op)):
        pytest.skip(f"no {op} of {name}")
    tiny = np.finfo(dtype).smallest_subnormal
    a = (np.arange(1, 301) * tiny).astype(dtype)
    b = (np.arange(300, 0, -1) * (1.5 if op == "prod" else 1) * tiny).astype(dtype)
    if op == "prod":
        b = np.full(300, 0.75, dtype)  # (a subnormal times 0.75: subnormal, not 0)
    want, want_divided = core_reduce(a, b, op), a.copy()
    _core.divide(want_divided, _core.DTYPES.index(name), 3)
    was = _core.set_flush_subnormals(True)
    try:
        assert not (a * dtype.type(1)).any()  # (numpy's own, here: flushed: the test can fail)
        got, divided = core_reduce(a, b, op), a.copy()
        _core.divide(divided, _core.DTYPES.index(name), 3)
    finally:
        _core.set_flush_subnormals(was)
    assert was is False and not _core.set_flush_subnormals(False)
    assert want.any() and got.tobytes() == want.tobytes()
    assert want_divided.any() and divided.tobytes() == want_divided.tobytes()
