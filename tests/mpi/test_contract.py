"""Independent black-box contract check for ``ringreduce``.

Written from the contract text only.  Every rank runs the same tests in the
same order; expected values are computed from every rank's input gathered with
mpi4py's lowercase ``allgather`` and reduced with numpy (float64/complex128 for
floats, exact wrapping integer arithmetic for ints).

Run e.g.:
    mpiexec -n 3 python -m mpi4py -m pytest -q -x test_contract.py
"""
import functools
import math
import zlib

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    ml_dtypes = None
    BF16 = None

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
SIZE = WORLD.Get_size()

OPS = ("sum", "prod", "min", "max", "avg")
FLOATS = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]
if BF16 is not None:
    FLOATS.append(BF16)
INTS = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64,
                              np.uint8, np.uint16, np.uint32, np.uint64)]
COMPLEX = [np.dtype(np.complex64), np.dtype(np.complex128)]
ALL_DTYPES = FLOATS + INTS + COMPLEX + [np.dtype(bool)]

needs2 = pytest.mark.skipif(SIZE < 2, reason="needs at least 2 ranks")


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def comm():
    return rr.Communicator(WORLD)


def is_int(dt):
    """Exact dtypes: integers, and bool (sum and max an or, prod and min an and)."""
    return np.issubdtype(dt, np.integer) or np.dtype(dt) == np.bool_


def is_complex(dt):
    return dt.kind == "c"


def finfo(dt):
    if BF16 is not None and dt == BF16:
        return ml_dtypes.finfo(ml_dtypes.bfloat16)
    return np.finfo(dt)


def valid(op, dt):
    if is_complex(dt) and op in ("min", "max"):
        return False
    if is_int(dt) and op == "avg":
        return False
    return True


def rng_for(*key):
    seed = zlib.crc32(repr(key).encode()) + 7919 * (RANK + 1)
    return np.random.default_rng(seed)


def make_data(dt, shape, op="sum", key=()):
    """Rank-dependent random data (never all ones)."""
    dt = np.dtype(dt)
    rng = rng_for(str(dt), shape, op, *key)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if is_int(dt):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if op == "prod":
        mag = rng.uniform(0.6, 1.6, size=shape)
        sign = np.where(rng.random(size=shape) < 0.5, -1.0, 1.0)
        re = mag * sign
        im = rng.uniform(-0.5, 0.5, size=shape)
    else:
        re = rng.uniform(-4.0, 4.0, size=shape)
        im = rng.uniform(-4.0, 4.0, size=shape)
    if is_complex(dt):
        return np.asarray(re + 1j * im).astype(dt)
    return np.asarray(re).astype(dt)


def gather(x):
    """Every rank's array (same dtype on every rank assumed)."""
    x = np.asarray(x)
    items = WORLD.allgather((np.ascontiguousarray(x).tobytes(), x.shape))
    return [np.frombuffer(b, dtype=x.dtype).reshape(s).copy() for b, s in items]


def assert_same_bits_on_all_ranks(y):
    y = np.ascontiguousarray(y)
    allb = WORLD.allgather((y.tobytes(), y.shape, str(y.dtype)))
    assert all(b == allb[0] for b in allb), \
        "result is not bitwise identical on every rank"


def int_reduce(arrs, op, dt):
    f = {"sum": np.add, "prod": np.multiply,
         "min": np.minimum, "max": np.maximum}[op]
    acc = np.array(arrs[0], dtype=dt, copy=True)
    with np.errstate(all="ignore"):
        for a in arrs[1:]:
            f(acc, a, out=acc)
    return acc


def check_reduction(y, arrs, op, dt, shape):
    """y: library result (already reshaped to ``shape``); arrs: all inputs."""
    assert y.dtype == dt, f"dtype {y.dtype} != {dt}"
    assert y.shape == shape, f"shape {y.shape} != {shape}"
    if is_int(dt):
        ref = int_reduce(arrs, op, dt)
        np.testing.assert_array_equal(y, ref)
        return
    wide = np.complex128 if is_complex(dt) else np.float64
    A = [np.asarray(a).astype(wide) for a in arrs]
    yw = np.asarray(y).astype(wide)
    assert np.all(np.isfinite(yw)), "non-finite result"
    if op in ("min", "max"):
        f = np.minimum if op == "min" else np.maximum
        ref = functools.reduce(f, A)
        np.testing.assert_array_equal(yw, ref)
        return
    fi = finfo(dt)
    eps = float(fi.eps)
    tiny = float(fi.tiny) * SIZE
    absx = functools.reduce(np.add, [np.abs(a) for a in A])
    if op == "sum":
        ref = functools.reduce(np.add, A)
        tol = (SIZE + 2) * eps * absx + tiny
    elif op == "avg":
        ref = functools.reduce(np.add, A) / SIZE
        tol = (SIZE + 3) * eps * absx / SIZE + tiny
    else:  # prod
        ref = functools.reduce(np.multiply, A)
        absp = functools.reduce(np.multiply, [np.abs(a) for a in A])
        tol = 4 * (SIZE + 2) * eps * absp + tiny
    err = np.abs(yw - ref)
    bad = err > tol
    assert not np.any(bad), (
        f"{op}/{dt}: max err {err.max()} exceeds rounding tolerance; "
        f"first bad y={yw[bad][:3]} ref={ref[bad][:3]}")


def run_and_check_allreduce(comm, x, op, out=None):
    dt = x.dtype
    x_before = x.copy()
    arrs = gather(x)
    y = comm.allreduce(x, op=op) if out is None else comm.allreduce(x, op=op, out=out)
    if out is not None:
        assert y is out, "allreduce(out=...) must return out"
    else:
        assert y is not x
        assert not np.shares_memory(y, x), "result must be a new array"
        np.testing.assert_array_equal(x, x_before, err_msg="x was modified")
        assert x.tobytes() == x_before.tobytes()
    check_reduction(np.asarray(y), arrs, op, dt, x.shape)
    assert_same_bits_on_all_ranks(y)
    return y


# --------------------------------------------------------------------------
# Communicator basics
# --------------------------------------------------------------------------
def test_communicator_rank_size(comm):
    assert comm.rank == RANK
    assert comm.size == SIZE


def test_the_op_names_and_the_default_chunk_size_are_the_documented_ones():
    assert rr.OPS == ("sum", "prod", "min", "max", "avg")
    with rr.Communicator(WORLD, chunk_bytes=None) as c:
        assert c.chunk_bytes == 256 * 1024
        x = make_data(np.float32, (5000,), "sum", ("chunks",))
        y = c.allreduce(x)
        c.chunk_bytes = 64  # settable at any time
        assert c.chunk_bytes == 64
        assert c.allreduce(x).tobytes() == y.tobytes()


def test_default_communicator_is_comm_world():
    with rr.Communicator() as c:
        assert c.rank == RANK and c.size == SIZE
        x = make_data(np.float64, (6,), "sum", ("defcomm",))
        arrs = gather(x)
        y = c.allreduce(x, op="sum")
        check_reduction(y, arrs, "sum", x.dtype, x.shape)


# --------------------------------------------------------------------------
# allreduce: full op x dtype matrix
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_op_dtype_matrix(comm, op, dt):
    x = make_data(dt, (5, 7), op, ("matrix",))
    if not valid(op, dt):
        before = x.copy()
        with pytest.raises((ValueError, TypeError)):
            comm.allreduce(x, op=op)
        assert x.tobytes() == before.tobytes()
        return
    run_and_check_allreduce(comm, x, op)


SHAPES = [(), (0,), (3, 0), (1,), (2,), (3,), (SIZE - 1,) if SIZE > 1 else (1,),
          (SIZE + 1,), (13,), (4, 5, 3), (2, 1, 1, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dt", [np.dtype(np.float32), np.dtype(np.int32),
                                np.dtype(np.float16), np.dtype(np.complex128)],
                         ids=str)
@pytest.mark.parametrize("op", ["sum", "max", "avg"])
def test_allreduce_shapes(comm, op, dt, shape):
    x = make_data(dt, shape, op, ("shapes",))
    if not valid(op, dt):
        with pytest.raises((ValueError, TypeError)):
            comm.allreduce(x, op=op)
        return
    run_and_check_allreduce(comm, x, op)


def _noncontig(kind, dt, op):
    base = make_data(dt, (6, 10), op, ("nc", kind))
    if kind == "stride":
        return base[::2, 1::3]
    if kind == "transpose":
        return base.T
    if kind == "fortran":
        return np.asfortranarray(base)
    if kind == "column":
        return base[:, 3]
    if kind == "negstride":
        return base[::-1, ::-2]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["stride", "transpose", "fortran", "column", "negstride"])
@pytest.mark.parametrize("dt", [np.dtype(np.float64), np.dtype(np.int16)], ids=str)
@pytest.mark.parametrize("op", ["sum", "min"])
def test_allreduce_noncontiguous_input(comm, op, dt, kind):
    x = _noncontig(kind, dt, op)
    y = run_and_check_allreduce(comm, x, op)
    assert y.shape == x.shape


def test_allreduce_noncontiguous_input_with_out(comm):
    x = _noncontig("stride", np.dtype(np.float32), "sum")
    out = np.empty(x.shape, dtype=x.dtype)
    run_and_check_allreduce(comm, x, "sum", out=out)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_allreduce_out_in_place_returns_out(comm, dt):
    op = "avg" if not is_int(dt) else "sum"
    x = make_data(dt, (3, 5), op, ("inplace",))
    arrs = gather(x)
    r = comm.allreduce(x, op=op, out=x)
    assert r is x, "allreduce(x, out=x) must return out"
    check_reduction(x, arrs, op, dt, (3, 5))
    assert_same_bits_on_all_ranks(x)


@pytest.mark.parametrize("op", ["sum", "prod", "max"])
def test_allreduce_out_separate_array(comm, op):
    x = make_data(np.float32, (4, 6), op, ("outsep",))
    out = np.full((4, 6), -123.0, dtype=np.float32)
    before = x.copy()
    arrs = gather(x)
    r = comm.allreduce(x, op=op, out=out)
    assert r is out
    assert x.tobytes() == before.tobytes()
    check_reduction(out, arrs, op, x.dtype, x.shape)


# --------------------------------------------------------------------------
# integer wrap-around
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dt", INTS, ids=str)
def test_integer_overflow_wraps(comm, dt):
    info = np.iinfo(dt)
    # values near the top of the range -> sum and prod overflow
    x = np.array([info.max - RANK, info.max // 2 + 3 + RANK, info.min + RANK,
                  100 + RANK, 7 + RANK], dtype=dt)
    arrs = gather(x)
    for op in ("sum", "prod"):
        y = comm.allreduce(x, op=op)
        np.testing.assert_array_equal(y, int_reduce(arrs, op, dt))
        assert y.dtype == dt


def test_int8_sum_wraps_explicit(comm):
    x = np.full(4, 100 + RANK, dtype=np.int8)
    y = comm.allreduce(x, op="sum")
    total = sum(100 + r for r in range(SIZE))
    wrapped = ((total + 128) % 256) - 128
    np.testing.assert_array_equal(y, np.full(4, wrapped, dtype=np.int8))


# --------------------------------------------------------------------------
# float16 / bfloat16: reduce through float32, round once per step
# --------------------------------------------------------------------------
def _all_trees(vals, idx, comb, memo):
    """All results of combining vals[idx] with a commutative binary op,
    rounding after each combination (every full binary tree)."""
    if idx in memo:
        return memo[idx]
    if len(idx) == 1:
        res = [vals[idx[0]]]
    else:
        first, rest = idx[0], idx[1:]
        res = []
        for mask in range(2 ** len(rest) - 1):  # right side non-empty
            left = (first,) + tuple(r for i, r in enumerate(rest) if mask >> i & 1)
            right = tuple(r for i, r in enumerate(rest) if not mask >> i & 1)
            for a in _all_trees(vals, left, comb, memo):
                for b in _all_trees(vals, right, comb, memo):
                    res.append(comb(a, b))
    memo[idx] = res
    return res


LOWP = [np.dtype(np.float16)] + ([BF16] if BF16 is not None else [])

# p ranks have (2p - 3)!! such trees: 15 on 4, 945 on 6, 10395 on 7, 135135 on 8, where
# holding them all took 3 GB on each rank (8 ranks ran a 24 GB machine out of memory).
_MOST_TREES = 1000


def _check_within_per_step_rounding(y, arrs, op, dt):
    """Past _MOST_TREES: y within what p - 1 steps that each round once allow. Each step
    rounds (float32, then dt) its result r by at most u |r| (u: dt's unit roundoff, a
    little more for the float32 rounding first), so a sum of p terms ends within
    ((1 + u) ** (p - 1) - 1) * sum |x| of the exact sum, and a product within
    ((1 + u) ** (p - 1) - 1) * |product| (plus half a subnormal per step, near 0)."""
    u = 2.0 ** -(finfo(dt).nmant + 1) * (1 + 2.0 ** -10)
    tiny = float(finfo(dt).smallest_subnormal)
    wide = [a.astype(np.float64) for a in arrs]
    grows = (1 + u) ** (SIZE - 1) - 1
    if op == "sum":
        exact = functools.reduce(np.add, wide)
        bound = grows * functools.reduce(np.add, [np.abs(a) for a in wide])
    else:
        exact = functools.reduce(np.multiply, wide)
        bound = grows * np.abs(exact)
    bound = bound + (SIZE - 1) * tiny / 2
    error = np.abs(y.astype(np.float64) - exact)
    assert np.all(error <= bound), (
        f"{op} {dt} on {SIZE} ranks: error {error.max()} at {np.argmax(error)}, beyond the "
        f"{bound.ravel()[np.argmax(error)]} that p - 1 steps rounding once each allow")


@pytest.mark.parametrize("dt", LOWP, ids=str)
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_lowprecision_rounds_once_per_step(comm, op, dt):
    rng = rng_for("lowp", op, str(dt))
    n = 4099
    if op == "sum":
        x = (rng.uniform(-1, 1, n) * 10.0 ** rng.uniform(-2, 2, n)).astype(dt)
    else:
        x = (rng.uniform(0.5, 2.0, n) * np.where(rng.random(n) < .5, -1, 1)).astype(dt)
    arrs = gather(x)
    y = comm.allreduce(x, op=op)
    assert y.dtype == dt and y.shape == x.shape
    assert_same_bits_on_all_ranks(y)
    f = np.add if op == "sum" else np.multiply

    def comb(a, b):
        return f(a.astype(np.float32), b.astype(np.float32)).astype(dt)

    if math.prod(range(1, 2 * SIZE - 2, 2)) > _MOST_TREES:
        _check_within_per_step_rounding(y, arrs, op, dt)
        return
    trees = _all_trees(arrs, tuple(range(SIZE)), comb, {})
    cand = np.stack([t.astype(np.float32) for t in trees])
    ok = np.any(cand == y.astype(np.float32)[None, :], axis=0)
    assert ok.all(), (
        f"{np.count_nonzero(~ok)} of {n} elements are not the result of any "
        f"float32-compute / round-to-{dt}-per-step reduction order; e.g. idx "
        f"{np.flatnonzero(~ok)[:3]} got {y[~ok][:3]} candidates "
        f"{cand[:, ~ok][:, :1].ravel()}")


@pytest.mark.parametrize("dt", [np.dtype(np.float32), np.dtype(np.float16)]
                         + ([BF16] if BF16 is not None else []), ids=str)
def test_large_array_bitwise_identical_on_all_ranks(comm, dt):
    n = (1 << 19) + 37
    x = make_data(dt, (n,), "sum", ("large",))
    arrs = gather(x)
    y = comm.allreduce(x, op="sum")
    assert_same_bits_on_all_ranks(y)
    check_reduction(y, arrs, "sum", dt, (n,))


# --------------------------------------------------------------------------
# async
# --------------------------------------------------------------------------
def test_allreduce_async_many_in_flight(comm):
    specs = []
    for i, (dt, op) in enumerate([(np.float32, "sum"), (np.int64, "prod"),
                                  (np.float64, "avg"), (np.uint8, "max"),
                                  (np.complex64, "sum"), (np.float16, "min"),
                                  (np.int32, "sum"), (np.float64, "sum"),
                                  (np.float32, "max"), (np.int16, "min")]):
        shape = [(17,), (3, 4), (), (0,), (1000,), (5, 2)][i % 6]
        x = make_data(dt, shape, op, ("async", i))
        specs.append((x, x.copy(), op, gather(x)))
    handles = []
    outs = []
    for i, (x, _, op, _) in enumerate(specs):
        if i % 3 == 0:
            out = np.empty(x.shape, x.dtype)
            handles.append(comm.allreduce_async(x, op=op, out=out))
            outs.append(out)
        else:
            handles.append(comm.allreduce_async(x, op=op))
            outs.append(None)
    # wait in reverse order: all must be in flight independently
    results = [None] * len(handles)
    for i in reversed(range(len(handles))):
        results[i] = handles[i].wait()
    for (x, before, op, arrs), y, out in zip(specs, results, outs):
        if out is not None:
            assert y is out
        assert x.tobytes() == before.tobytes(), "x modified by allreduce_async"
        check_reduction(np.asarray(y), arrs, op, x.dtype, x.shape)
        assert_same_bits_on_all_ranks(y)


def test_allreduce_async_in_place(comm):
    x = make_data(np.float64, (9,), "avg", ("async_inplace",))
    arrs = gather(x)
    h = comm.allreduce_async(x, op="avg", out=x)
    r = h.wait()
    assert r is x
    check_reduction(x, arrs, "avg", x.dtype, x.shape)


# --------------------------------------------------------------------------
# reduce_scatter
# --------------------------------------------------------------------------
RS_SHAPES = [(), (0,), (1,), (2,), (3,), (7,), (3, 5), (4, 6, 2), (SIZE,), (2 * SIZE + 1,)]


@pytest.mark.parametrize("shape", RS_SHAPES, ids=str)
@pytest.mark.parametrize("dt", [np.dtype(np.float64), np.dtype(np.int32),
                                np.dtype(np.float16)] + ([BF16] if BF16 is not None else []),
                         ids=str)
@pytest.mark.parametrize("op", ["sum", "min", "avg"])
def test_reduce_scatter(comm, op, dt, shape):
    x = make_data(dt, shape, op, ("rs",))
    if not valid(op, dt):
        with pytest.raises((ValueError, TypeError)):
            comm.reduce_scatter(x, op=op)
        return
    before = x.copy()
    arrs = gather(x)
    part = comm.reduce_scatter(x, op=op)
    assert x.tobytes() == before.tobytes(), "x modified by reduce_scatter"
    assert part.ndim == 1, f"reduce_scatter must return 1-D, got {part.shape}"
    flat = [a.ravel() for a in arrs]
    idx = np.array_split(np.arange(x.size), SIZE)[RANK]
    blocks = [a[idx] for a in flat]
    check_reduction(np.asarray(part), blocks, op, dt, (idx.size,))


@pytest.mark.parametrize("op", ["sum", "prod", "max"])
def test_reduce_scatter_noncontiguous_and_all_dtypes(comm, op):
    for dt in ALL_DTYPES:
        if not valid(op, dt):
            continue
        x = make_data(dt, (5, 6), op, ("rsnc", str(dt)))[:, ::2].T  # (3, 5) non-contig
        arrs = gather(x)
        part = comm.reduce_scatter(x, op=op)
        idx = np.array_split(np.arange(x.size), SIZE)[RANK]
        check_reduction(np.asarray(part), [a.ravel()[idx] for a in arrs], op, dt,
                        (idx.size,))
        # consistent with allreduce's bits
        full = comm.allreduce(x, op=op)
        assert part.tobytes() == np.ascontiguousarray(full.ravel()[idx]).tobytes(), \
            f"reduce_scatter block differs from allreduce for {dt}"


# --------------------------------------------------------------------------
# allgather
# --------------------------------------------------------------------------
AG_DTYPES = [np.dtype(t) for t in (np.float32, np.int16, np.uint64, np.complex64,
                                   np.float16, np.int8)] + ([BF16] if BF16 is not None else [])


@pytest.mark.parametrize("shape", [(5,), (1,), (2, 3), (0, 3), (0,), (3, 2, 2)], ids=str)
@pytest.mark.parametrize("dt", AG_DTYPES, ids=str)
def test_allgather(comm, dt, shape):
    x = make_data(dt, shape, "sum", ("ag",))
    before = x.copy()
    arrs = gather(x)
    g = comm.allgather(x)
    assert x.tobytes() == before.tobytes()
    exp = np.concatenate(arrs, axis=0)
    assert g.dtype == dt
    assert g.shape == exp.shape, f"{g.shape} != {exp.shape}"
    assert np.ascontiguousarray(g).tobytes() == exp.tobytes()


def test_allgather_noncontiguous(comm):
    x = make_data(np.float64, (4, 6), "sum", ("agnc",))[:, ::2]
    arrs = gather(x)
    g = comm.allgather(x)
    np.testing.assert_array_equal(g, np.concatenate(arrs, axis=0))


# --------------------------------------------------------------------------
# broadcast
# --------------------------------------------------------------------------
@pytest.mark.parametrize("root", sorted({0, SIZE - 1}))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4)], ids=str)
@pytest.mark.parametrize("dt", [np.dtype(t) for t in (np.float64, np.int32, np.complex128,
                                                      np.float16, np.uint8)]
                         + ([BF16] if BF16 is not None else []), ids=str)
def test_broadcast(comm, dt, shape, root):
    x = make_data(dt, shape, "sum", ("bc",))
    arrs = gather(x)
    r = comm.broadcast(x, root=root)
    assert r is x, "broadcast must return x"
    assert x.shape == shape and x.dtype == dt
    assert x.tobytes() == arrs[root].tobytes()


# --------------------------------------------------------------------------
# module-level shortcuts
# --------------------------------------------------------------------------
def test_module_allreduce_defaults(comm):
    x = make_data(np.float64, (4, 3), "sum", ("mod",))
    before = x.copy()
    arrs = gather(x)
    y = rr.allreduce(x)  # op="sum", out=None, comm=None
    assert x.tobytes() == before.tobytes()
    check_reduction(y, arrs, "sum", x.dtype, x.shape)


def test_module_allreduce_keywords(comm):
    x = make_data(np.int64, (7,), "max", ("mod2",))
    arrs = gather(x)
    y = rr.allreduce(x, op="max", out=None, comm=None)
    check_reduction(y, arrs, "max", x.dtype, x.shape)
    out = np.empty_like(x)
    r = rr.allreduce(x, op="min", out=out, comm=comm)
    assert r is out
    check_reduction(out, arrs, "min", x.dtype, x.shape)
    xf = make_data(np.float32, (5,), "avg", ("mod3",))
    arrsf = gather(xf)
    r = rr.allreduce(xf, op="avg", out=xf)
    assert r is xf
    check_reduction(xf, arrsf, "avg", xf.dtype, xf.shape)


def test_module_other_shortcuts(comm):
    x = make_data(np.float64, (2 * SIZE + 1,), "sum", ("modo",))
    arrs = gather(x)
    h = rr.allreduce_async(x, op="sum")
    check_reduction(np.asarray(h.wait()), arrs, "sum", x.dtype, x.shape)
    part = rr.reduce_scatter(x, op="sum")
    idx = np.array_split(np.arange(x.size), SIZE)[RANK]
    check_reduction(np.asarray(part), [a[idx] for a in arrs], "sum", x.dtype, (idx.size,))
    g = rr.allgather(x)
    np.testing.assert_array_equal(g, np.concatenate(arrs))
    b = x.copy()
    r = rr.broadcast(b, root=0)
    assert r is b
    assert b.tobytes() == arrs[0].tobytes()


# --------------------------------------------------------------------------
# errors: bad input, identical on every rank
# --------------------------------------------------------------------------
def _assert_usable(comm):
    x = make_data(np.float64, (5,), "sum", ("usable",))
    arrs = gather(x)
    y = comm.allreduce(x, op="sum")
    check_reduction(y, arrs, "sum", x.dtype, x.shape)


@pytest.mark.parametrize("call", ["allreduce", "allreduce_async", "reduce_scatter",
                                  "module"])
def test_unknown_op(comm, call):
    x = make_data(np.float32, (6,), "sum", ("badop",))
    before = x.copy()
    with pytest.raises(ValueError) as ei:
        if call == "allreduce":
            comm.allreduce(x, op="median")
        elif call == "allreduce_async":
            comm.allreduce_async(x, op="median").wait()
        elif call == "reduce_scatter":
            comm.reduce_scatter(x, op="median")
        else:
            rr.allreduce(x, op="median")
    msg = str(ei.value)
    assert "median" in msg, msg
    for o in OPS:
        assert o in msg, f"valid op {o!r} not named: {msg}"
    assert "op" in msg.replace("median", ""), msg
    assert x.tobytes() == before.tobytes()
    _assert_usable(comm)


def _unsupported_arrays():
    out = [("object", lambda: np.array([1.5, 2.5, 3.5], dtype=object)),
           ("str", lambda: np.array(["ab", "cd"])),
           ("datetime64", lambda: np.array(["2020-01-01", "2021-01-01"], dtype="datetime64[D]"))]
    if np.dtype(np.longdouble) != np.dtype(np.float64):
        out.append(("longdouble", lambda: np.arange(4, dtype=np.longdouble) + RANK))
    return out


@pytest.mark.parametrize("name,factory", _unsupported_arrays(), ids=lambda v: v if isinstance(v, str) else "")
def test_unsupported_dtype(comm, name, factory):
    x = factory()
    before = x.copy()
    with pytest.raises(TypeError) as ei:
        comm.allreduce(x, op="sum")
    msg = str(ei.value)
    assert str(x.dtype) in msg or x.dtype.name in msg, f"dtype not named: {msg}"
    for s in ("float32", "int64", "uint8", "complex128"):
        assert s in msg, f"supported dtype {s} not named: {msg}"
    np.testing.assert_array_equal(x, before)
    _assert_usable(comm)


@pytest.mark.parametrize("op,dt", [("min", np.complex64), ("max", np.complex128),
                                   ("avg", np.int32), ("avg", np.uint8)])
def test_invalid_op_dtype_combination(comm, op, dt):
    x = make_data(dt, (5,), "sum", ("opdt",))
    before = x.copy()
    with pytest.raises((ValueError, TypeError)) as ei:
        comm.allreduce(x, op=op)
    msg = str(ei.value)
    assert op in msg and np.dtype(dt).name in msg, msg
    assert x.tobytes() == before.tobytes()
    _assert_usable(comm)


def _bad_out(kind):
    x = make_data(np.float32, (6,), "sum", ("badout",))
    if kind == "shape":
        out = np.zeros((7,), np.float32)
    elif kind == "shape_same_size":
        out = np.zeros((2, 3), np.float32)
    elif kind == "dtype":
        out = np.zeros((6,), np.float64)
    elif kind == "noncontig":
        out = np.zeros((6, 2), np.float32)[:, 0]
    elif kind == "readonly":
        out = np.zeros((6,), np.float32)
        out.flags.writeable = False
    else:
        raise AssertionError(kind)
    return x, out


OUT_KW = {"shape": ("shape",), "shape_same_size": ("shape",), "dtype": ("dtype",),
          "noncontig": ("contiguous",),
          "readonly": ("read-only", "readonly", "writeable", "writable", "read only")}


@pytest.mark.parametrize("kind", list(OUT_KW))
@pytest.mark.parametrize("call", ["allreduce", "allreduce_async"])
def test_bad_out(comm, kind, call):
    x, out = _bad_out(kind)
    xb, ob = x.copy(), out.copy()
    with pytest.raises((ValueError, TypeError)) as ei:
        if call == "allreduce":
            comm.allreduce(x, op="sum", out=out)
        else:
            comm.allreduce_async(x, op="sum", out=out).wait()
    msg = str(ei.value)
    assert "out" in msg, f"argument 'out' not named: {msg}"
    assert any(k in msg.lower() for k in OUT_KW[kind]), f"does not say which: {msg}"
    if kind == "shape":
        assert "6" in msg and "7" in msg, f"shapes not named: {msg}"
    if kind == "shape_same_size":
        assert "2" in msg and "3" in msg and "6" in msg, f"shapes not named: {msg}"
    if kind == "dtype":
        assert "float64" in msg and "float32" in msg, f"dtypes not named: {msg}"
    assert x.tobytes() == xb.tobytes() and out.tobytes() == ob.tobytes()
    _assert_usable(comm)


def _rank_named(msg):
    return "rank" in msg.lower() and str(RANK) in msg


@pytest.mark.parametrize("kind", ["op", "dtype", "out_shape", "out_dtype",
                                  "out_readonly", "out_noncontig"])
def test_error_messages_name_the_rank(comm, kind):
    x = make_data(np.float32, (6,), "sum", ("rankmsg",))
    with pytest.raises((ValueError, TypeError)) as ei:
        if kind == "op":
            comm.allreduce(x, op="median")
        elif kind == "dtype":
            comm.allreduce(np.array([1, 2], dtype=object), op="sum")
        else:
            _, out = _bad_out({"out_shape": "shape", "out_dtype": "dtype",
                               "out_readonly": "readonly",
                               "out_noncontig": "noncontig"}[kind])
            comm.allreduce(x, op="sum", out=out)
    assert _rank_named(str(ei.value)), f"rank {RANK} not named: {ei.value}"
    _assert_usable(comm)


# --------------------------------------------------------------------------
# mismatches across ranks
# --------------------------------------------------------------------------
LAST = SIZE - 1
COUNT_WORDS = ("count", "size", "shape", "length", "element", "numel")


def _check_mismatch_msg(msg, what):
    low = msg.lower()
    assert "rank" in low, f"ranks not named: {msg}"
    assert str(LAST) in msg, f"differing rank {LAST} not named: {msg}"
    if what == "count":
        assert any(w in low for w in COUNT_WORDS), f"count not named: {msg}"
        assert "10" in msg and "11" in msg, f"counts not named: {msg}"
    elif what == "dtype":
        assert "dtype" in low, msg
        assert "float32" in msg and "float64" in msg, msg
    elif what == "op":
        assert "op" in low, msg
        assert "sum" in msg and "max" in msg, msg


def _mismatch_input(what):
    dt = np.float64 if (what == "dtype" and RANK == LAST) else np.float32
    n = 11 if (what == "count" and RANK == LAST) else 10
    op = "max" if (what == "op" and RANK == LAST) else "sum"
    x = make_data(dt, (n,), "sum", ("mm", what))
    return x, op


@needs2
@pytest.mark.parametrize("what", ["count", "dtype", "op"])
def test_mismatch_allreduce(comm, what):
    x, op = _mismatch_input(what)
    before = x.copy()
    with pytest.raises(rr.MismatchError) as ei:
        comm.allreduce(x, op=op)
    _check_mismatch_msg(str(ei.value), what)
    assert x.tobytes() == before.tobytes()
    _assert_usable(comm)


@needs2
@pytest.mark.parametrize("what", ["count", "dtype", "op"])
def test_mismatch_allreduce_in_place_loses_nothing(comm, what):
    x, op = _mismatch_input(what)
    before = x.copy()
    with pytest.raises(rr.MismatchError):
        comm.allreduce(x, op=op, out=x)
    assert x.tobytes() == before.tobytes(), "in-place buffer clobbered on mismatch"
    _assert_usable(comm)


@needs2
@pytest.mark.parametrize("what", ["count", "dtype", "op"])
def test_mismatch_allreduce_async(comm, what):
    x, op = _mismatch_input(what)
    before = x.copy()
    with pytest.raises(rr.MismatchError) as ei:
        h = comm.allreduce_async(x, op=op)
        h.wait()
    _check_mismatch_msg(str(ei.value), what)
    assert x.tobytes() == before.tobytes()
    _assert_usable(comm)


@needs2
@pytest.mark.parametrize("what", ["count", "dtype", "op"])
def test_mismatch_reduce_scatter(comm, what):
    x, op = _mismatch_input(what)
    with pytest.raises(rr.MismatchError) as ei:
        comm.reduce_scatter(x, op=op)
    _check_mismatch_msg(str(ei.value), what)
    _assert_usable(comm)


@needs2
@pytest.mark.parametrize("what", ["count", "dtype"])
def test_mismatch_broadcast(comm, what):
    x, _ = _mismatch_input(what)
    before = x.copy()
    with pytest.raises(rr.MismatchError) as ei:
        comm.broadcast(x, root=0)
    _check_mismatch_msg(str(ei.value), what)
    assert x.tobytes() == before.tobytes()
    _assert_usable(comm)


@needs2
def test_mismatch_allgather_dtype(comm):
    x, _ = _mismatch_input("dtype")
    with pytest.raises(rr.MismatchError) as ei:
        comm.allgather(x)
    _check_mismatch_msg(str(ei.value), "dtype")
    _assert_usable(comm)


@needs2
def test_repeated_mismatches_then_usable(comm):
    for what in ("count", "op", "dtype", "count"):
        x, op = _mismatch_input(what)
        with pytest.raises(rr.MismatchError):
            comm.allreduce(x, op=op)
        _assert_usable(comm)
    # async still fine afterwards, several in flight
    xs = [make_data(np.float32, (33,), "sum", ("after", i)) for i in range(4)]
    arrs = [gather(x) for x in xs]
    hs = [comm.allreduce_async(x, op="sum") for x in xs]
    for h, a, x in zip(hs, arrs, xs):
        check_reduction(np.asarray(h.wait()), a, "sum", x.dtype, x.shape)


@needs2
def test_mismatch_only_first_rank_differs(comm):
    n = 11 if RANK == 0 else 10
    x = make_data(np.float32, (n,), "sum", ("mm0",))
    with pytest.raises(rr.MismatchError) as ei:
        comm.allreduce(x, op="sum")
    msg = str(ei.value)
    assert "rank" in msg.lower() and "0" in msg, msg
    _assert_usable(comm)
