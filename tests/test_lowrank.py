"""The core's PowerSGD arithmetic (csrc/lowrank.h), one process: P Q^T bit for bit as a
fixed sequence of numpy ufuncs gives it (each correctly rounded, so the same on every
CPU), and P's orthonormal columns as good as LAPACK's, with its conventions for columns
of 0s and dependent ones, whatever the scale."""
import numpy as np
import pytest

from ringreduce import _core
from ringreduce.compression import PowerSGD

DTYPES = [np.float32, np.float64]


def product(p, q):
    out = np.empty((p.shape[0], q.shape[0]), p.dtype)
    _core.low_rank_product(out, p, q)
    return out


def orthonormal(p):
    out = np.empty_like(p)
    _core.orthonormal_columns(out, p)
    return out


def ufunc_product(p, q):
    out = p[:, :1] * q[:, 0]
    for k in range(1, p.shape[1]):
        out += p[:, k:k + 1] * q[:, k]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("n, m", [(1, 1), (1, 33), (37, 1), (64, 129), (300, 17)])
def test_product_is_the_ufuncs_bit_for_bit(dtype, r, n, m):
    rng = np.random.default_rng([n, m, r])
    p = rng.standard_normal((n, r)).astype(dtype)
    q = (rng.standard_normal((m, r)) * 1e3).astype(dtype)
    assert product(p, q).tobytes() == ufunc_product(p, q).tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_product_keeps_subnormals_under_flush_to_zero(dtype):
    tiny = np.finfo(dtype).smallest_normal
    p = np.full((5, 2), tiny * 4, dtype)
    q = np.full((7, 2), 0.0625, dtype)
    want = ufunc_product(p, q)
    assert want.any() and (np.abs(want) < tiny).all()
    was = _core.set_flush_subnormals(True)
    try:
        assert not ufunc_product(p, q).any()  # (numpy's own, here: flushed)
        got = product(p, q)
    finally:
        _core.set_flush_subnormals(was)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, r", [(1, 1), (5, 5), (100, 1), (257, 4), (4096, 3)])
def test_orthonormal_columns_as_good_as_lapack(dtype, n, r):
    eps = np.finfo(dtype).eps
    p = np.random.default_rng([n, r]).standard_normal((n, r)).astype(dtype)
    got, lapack = orthonormal(p), np.linalg.qr(p)[0]
    wide = got.astype(np.float64)
    assert np.abs(wide.T @ wide - np.eye(r)).max() < 4 * r * eps
    assert np.abs(got - lapack).max() < 8 * eps  # (LAPACK's signs too)
    # (P = Q R: got spans p's columns)
    assert np.abs(wide @ (wide.T @ p) - p).max() < 8 * r * eps * np.abs(p).max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_columns_of_zeros_and_dependent_columns_still_give_orthonormal_columns(dtype):
    eps = np.finfo(dtype).eps
    rng = np.random.default_rng(3)
    a = rng.standard_normal(50)
    for p in (np.zeros((50, 3)), np.stack([a, np.zeros(50), 2 * a, rng.standard_normal(50)], 1),
              np.stack([np.zeros(50), a], 1)):
        got = orthonormal(p.astype(dtype)).astype(np.float64)
        assert np.abs(got.T @ got - np.eye(p.shape[1])).max() < 16 * eps
        assert np.abs(got[:, 0] @ a) > 0.5 * np.linalg.norm(a) or not p[:, 0].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nan_or_inf_makes_every_column_nan(dtype, bad):
    p = np.ones((6, 3), dtype)
    p[4, 1] = bad
    assert np.isnan(orthonormal(p)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_scale_gives_the_same_bits(dtype):
    # (Columns scaled by powers of two: reflections of the same vectors. Near the top of
    # the dtype's range the squares would overflow; near the bottom they would flush.)
    p = np.random.default_rng(5).standard_normal((200, 4)).astype(dtype)
    want = orthonormal(p)
    info = np.finfo(dtype)
    top, bottom = info.maxexp - 3, info.minexp + info.nmant // 2
    for exponents in ([top] * 4, [bottom] * 4, [top, bottom, 0, -7]):
        scaled = np.ldexp(p, np.array(exponents)).astype(dtype)
        assert np.isfinite(scaled).all() and scaled.all()
        assert orthonormal(scaled).tobytes() == want.tobytes(), exponents


def test_a_column_near_float64s_largest_of_one_sign_stays_finite():
    # (From a review.) All of one sign, nothing cancels: without each column first
    # brought near 1 by a power of two, the sums in the reflections overflow.
    rng = np.random.default_rng(6)
    p = (np.abs(rng.standard_normal((200, 4))) + 1) * (np.finfo(np.float64).max / 8)
    assert np.isfinite(p).all()
    q = orthonormal(p)
    assert np.isfinite(q).all()
    np.testing.assert_allclose(q.T @ q, np.eye(4), atol=1e-12)


def test_powersgd_compresses_only_where_the_factors_are_smaller():
    # (From a review.) n x m sent as P (n x r) and Q (m x r): at n*m == (n+m)*r nothing
    # is saved (and the approximation loses), so the matrix goes as it is.
    assert not PowerSGD(4).compresses((8, 8))  # 64 == (8 + 8) * 4
    assert PowerSGD(4).compresses((9, 8))  # 72 > 68
    assert not PowerSGD(1).compresses((2, 2))  # 4 == (2 + 2) * 1
    assert PowerSGD(1).compresses((3, 2, 1))  # 6 > 5, the trailing axes as one
    assert not PowerSGD(1).compresses((100,))


@pytest.mark.parametrize("bad", [dict(rank=True), dict(rank=False), dict(seed=True),
                                 dict(seed=False)], ids=str)
def test_powersgd_refuses_a_bool_for_rank_or_seed(bad):
    # (From a review.) True is an int to isinstance: PowerSGD(rank=True) would quietly
    # be rank 1, as a flag passed in the wrong place.
    with pytest.raises(ValueError, match="PowerSGD: (rank|seed) must be"):
        PowerSGD(**bad)


def test_arguments_are_checked():
    p = np.ones((6, 2))
    with pytest.raises(ValueError, match="low_rank_product"):
        _core.low_rank_product(np.empty((6, 5), np.float32), p, np.ones((5, 2)))
    with pytest.raises(ValueError, match="low_rank_product"):
        _core.low_rank_product(np.empty((6, 4)), p, np.ones((5, 2)))
    with pytest.raises(ValueError, match="low_rank_product"):
        _core.low_rank_product(np.empty((6, 5)), p, np.ones((5, 2)).T.copy().T)
    with pytest.raises(ValueError, match="orthonormal_columns"):
        _core.orthonormal_columns(np.empty((2, 6)), p.T.copy())  # (more columns than rows)
    with pytest.raises(ValueError, match="orthonormal_columns"):
        _core.orthonormal_columns(p, p)
    with pytest.raises(ValueError, match="orthonormal_columns"):
        _core.orthonormal_columns(np.empty((6, 2), np.int64), p.astype(np.int64))
