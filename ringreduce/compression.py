"""Gradient compression for DistributedOptimizer.

- ``"fp16"`` / ``"bf16"`` (strings): gradients travel as 16-bit floats. Each rank divides
  by the number of ranks *before* the sum, so the sum on the wire stays in range; fp16
  buckets are also multiplied by a power of two that keeps small gradients from rounding
  to 0 (see DistributedOptimizer, ringreduce/optim.py).
- ``PowerSGD(rank=r)``: low-rank compression of matrix-shaped gradients (Vogels et al.,
  2019). A gradient M (n x m, after error feedback) is approximated by P Q^T with
  P = M Q (n x r) and Q = M^T P (m x r), so (n + m) r numbers travel instead of n m.
  What the approximation misses is kept locally and added to the next step's gradient
  (error feedback), and Q is reused as the next step's starting point (warm start).
  What every rank computes from the averaged P and Q itself (P's orthonormal columns, and
  P Q^T) gives the same bits on every CPU for numpy arrays; see _SAME_BITS_EVERYWHERE.
"""
from __future__ import annotations

import numpy as np

from . import _core
from ._arrays import array_module, copy_where_it_is, on_gpu_of, plain


class PowerSGD:
    """Rank-``rank`` PowerSGD for gradients with 2 or more dimensions.

    Gradients with fewer dimensions, or too small to gain (n * m <= (n + m) * rank;
    for 16-bit ones, whose factors travel as float32, n * m <= 2 (n + m) * rank), go
    uncompressed. ``seed`` must be the same on every rank: the first Q is random.
    16-bit gradients are compressed in float32 (P and Q travel as float32; numpy has no
    16-bit linear algebra), and the approximation comes back in their own dtype.
    """

    def __init__(self, rank: int = 4, seed: int = 0):
        # (A numpy integer too, as for seed: a rank read from a config with numpy, or
        # swept with np.arange, was refused as "not a positive int".)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"PowerSGD: rank must be a positive int, got {rank!r}")
        # (Each parameter's first Q comes from default_rng(seed + its index).)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"PowerSGD: seed must be an int >= 0, got {seed!r}")
        self.rank = int(rank)  # (a plain int in repr(), which the ranks compare)
        self.seed = int(seed)
        self._q: dict[int, object] = {}      # parameter index -> Q (m x r), warm start
        self._error: dict[int, object] = {}  # parameter index -> what was not sent yet

    # Whether a DistributedOptimizer has taken it: one may (the state above is keyed
    # by its parameter indices), for good, so that every rank decides alike, whenever
    # its garbage collector runs.
    _taken = False

    def __getstate__(self):
        # A copy (copy, deepcopy, pickle) is free to be taken, with the state as it is
        # now in dicts of its own.
        return {**self.__dict__, "_taken": False, "_q": dict(self._q),
                "_error": dict(self._error)}

    def __repr__(self):  # (ranks compare it when a DistributedOptimizer is made)
        return f"PowerSGD(rank={self.rank}, seed={self.seed})"

    def compresses(self, shape: tuple, dtype=None) -> bool:
        """Whether a gradient of this shape (and dtype: None, as if float32) is sent as
        P and Q, which is where they are fewer bytes than the gradient itself."""
        if len(shape) < 2:
            return False
        n, m = shape[0], int(np.prod(shape[1:]))
        # P and Q travel in the computing dtype: for 16-bit gradients float32, twice
        # their bytes a number. Counted in numbers, a float16 (16, 12) at rank 4 was
        # compressed, and sent 448 bytes a step instead of 384, approximated.
        widening = 1 if dtype is None else \
            _computing_dtype(dtype).itemsize // np.dtype(dtype).itemsize
        return n * m > widening * (n + m) * self.rank

    def reduce(self, index: int, grad, comm) -> tuple[object, int]:
        """The rank-averaged low-rank approximation of grad, and the bytes this rank sent."""
        call = self.start(index, grad, comm)
        self.project(call, comm)
        return self.finish(call)

    # reduce() in three steps, so that a caller can overlap them with other work: start()
    # hands P's all-reduce to the ring, project() waits for it and hands over Q's, and
    # finish() waits for that. Every rank must make the same calls in the same order.

    def start(self, index: int, grad, comm, op: str = "avg", check: int = 0, dtype=None
              ) -> "_LowRankCall":
        """P = M Q (M: grad plus what earlier steps missed), averaged asynchronously.
        (op: DistributedOptimizer.abandon_step sends an abandoned step's with another,
        so that a rank that steps cannot take them for its own step's; check: what its
        all-reduces carry, or 0 for nothing, see Communicator._allreduce_checked;
        dtype: the approximation's, where not grad's own: DistributedOptimizer's float32
        sums of 16-bit micro-batches.)"""
        with on_gpu_of(grad):  # (cupy's arrays and kernels: on the current GPU)
            return self._start(index, grad, comm, op, check, dtype)

    def _start(self, index, grad, comm, op, check, dtype) -> "_LowRankCall":
        xp = array_module(grad)
        n = grad.shape[0]
        matrix = grad.reshape(n, -1)
        matrix = matrix.astype(_computing_dtype(matrix.dtype), copy=False)
        m = matrix.shape[1]
        r = min(self.rank, n, m)
        if index in self._error:
            matrix = matrix + self._error[index]
        q = self._q.get(index)
        if q is not None:
            # A column of 0s (Q = M^T P of a step of 0s) stays 0 in P = M Q, whose
            # orthonormal columns QR then makes the first unit vectors: Q held only M's
            # first rows from then on, and gradients elsewhere were never sent again.
            # Such a column is drawn from the seed again (Q is the same on every rank,
            # and so is the choice).
            empty = ~q.any(axis=0)
            if bool(empty.any()):
                q = xp.where(empty, _first_q(self.seed + index, m, r, xp, q.dtype), q)
        if q is None:
            q = _first_q(self.seed + index, m, r, xp, matrix.dtype)
        p = matrix @ _columns_at_most(q, m * comm.size, xp)
        return _LowRankCall(index, grad, matrix, p,
                            comm._allreduce_checked(p, op, check, wait=False),
                            grad.dtype if dtype is None else np.dtype(dtype))

    def project(self, call: "_LowRankCall", comm, op: str = "avg", check: int = 0) -> None:
        """Once P is averaged: Q = M^T P, with P's columns made orthonormal, averaged
        asynchronously."""
        call.handle.wait()
        with on_gpu_of(call.p):
            xp = array_module(call.p)
            call.p = _orthonormal_columns(call.p, xp)
            # P's columns are unit vectors, whose entries add up to sqrt(n) at most: P
            # divided by 2^shift >= sqrt(n) p keeps each rank's M^T P below M's
            # largest / p, and so the ring's sum of them below M's largest, where
            # Q = M^T P was up to sqrt(n) p times that (float32 gradients of 1e36 made
            # an inf). _finish multiplies it back, exactly.
            n = call.p.shape[0]
            call.shift = (n - 1).bit_length() // 2 + 1 + (comm.size - 1).bit_length()
            call.q = call.matrix.T @ xp.ldexp(call.p, -call.shift).astype(call.p.dtype,
                                                                         copy=False)
        call.handle = comm._allreduce_checked(call.q, op, check, wait=False)

    def finish(self, call: "_LowRankCall") -> tuple[object, int]:
        """Once Q is averaged: the approximation P Q^T, and the bytes this rank sent."""
        call.handle.wait()
        with on_gpu_of(call.q):
            return self._finish(call)

    def _finish(self, call: "_LowRankCall") -> tuple[object, int]:
        xp = array_module(call.q)
        # (P times 2^shift against Q divided by it: every product as P Q^T's, exactly,
        # and P is only n x r.)
        approximation = _low_rank_product(
            xp.ldexp(call.p, call.shift).astype(call.p.dtype, copy=False), call.q, xp)
        finite = bool(xp.isfinite(call.q).all())
        if finite and approximation.dtype != call.dtype:
            # Into the 16-bit dtype's range: an approximation overshoots the gradient
            # here and there (rank 1 of [[1, 1], [1, 0]] has 1.17), and of float16
            # gradients up to 50000 came back inf, with the gradient minus inf fed
            # back (the next step all NaN). What clipping misses is fed back below.
            top = float(np.finfo(call.dtype).max)
            approximation = xp.clip(approximation, -top, top)
        result = approximation.reshape(call.grad.shape).astype(call.dtype, copy=False)
        if finite:
            # What the update gets is the result, in the gradient's own dtype: what
            # rounding a 16-bit one loses is missed too, and fed back with the rest.
            used = approximation if result.dtype == approximation.dtype else \
                result.reshape(approximation.shape).astype(approximation.dtype)
            self._error[call.index] = call.matrix - used
            self._q[call.index] = call.q
        else:
            # An inf or NaN on any rank reaches every rank's Q, the same on all. It is
            # passed on, as it came; kept (in Q or the error fed back), it would spoil
            # every step after. So the next step starts afresh, on every rank alike: Q
            # from the seed again, nothing fed back.
            self._q.pop(call.index, None)
            self._error.pop(call.index, None)
        return result, call.p.nbytes + call.q.nbytes

    def state_dict(self) -> dict:
        # Copies, as SGD's and Adam's are: a state to keep, not a way into this one.
        return {"rank": self.rank, "seed": self.seed,
                "q": {i: copy_where_it_is(q) for i, q in self._q.items()},
                "error": {i: copy_where_it_is(e) for i, e in self._error.items()}}

    def load_state_dict(self, state: dict) -> None:
        if self._taken:
            # Its state is keyed by the optimizer's parameters, and its rank and seed
            # are what the ranks agreed on: loaded here, none of that is checked.
            raise RuntimeError("PowerSGD.load_state_dict: this PowerSGD belongs to a "
                               "DistributedOptimizer; load its state with that optimizer's "
                               "load_state_dict(), which checks it against the model and "
                               "the other ranks")
        if not isinstance(state, dict) or not {"rank", "seed", "q", "error"} <= state.keys():
            raise KeyError("PowerSGD.load_state_dict: the state is not a PowerSGD "
                           "state_dict() (it needs 'rank', 'seed', 'q' and 'error')")
        PowerSGD(state["rank"], state["seed"])  # (the constructor's checks and errors)
        # Arrays of its own, as the optimizer's load_state_dict() takes them: writing to
        # the state after loading it leaves this one alone. (Anything without copy() is
        # left for the optimizer's checks to refuse.)
        self._load(state, lambda i, a: plain(copy_where_it_is(a)) if hasattr(a, "copy") else a)

    def _load(self, state: dict, convert=lambda i, a: a) -> None:
        """Loads a state already checked (DistributedOptimizer.load_state_dict's way),
        each array of Q and of the error as convert(parameter index, array) gives it."""
        # (Plain ints: a state's np.int64(2), or 2.0, equals the optimizer's rank 2 and
        # passes its check, but would show in repr() and reach the shapes of a Q drawn.)
        self.rank, self.seed = int(state["rank"]), int(state["seed"])
        self._q, self._error = ({i: convert(i, a) for i, a in dict(state[key]).items()}
                                for key in ("q", "error"))


class _LowRankCall:
    """One gradient's PowerSGD all-reduces in flight (see PowerSGD.start)."""

    __slots__ = ("index", "grad", "matrix", "p", "q", "handle", "dtype", "shift")

    def __init__(self, index, grad, matrix, p, handle, dtype):
        self.index, self.grad, self.matrix, self.p, self.handle = index, grad, matrix, p, handle
        self.q = None
        self.shift = 0  # (Q travels divided by 2^shift: see PowerSGD.project)
        self.dtype = dtype  # the approximation's


def _computing_dtype(dtype) -> np.dtype:
    """The dtype arithmetic on gradients of `dtype` is done in: float32 for 16-bit
    floats (numpy has no 16-bit linear algebra, and a 16-bit factor is itself rounded:
    1/3 as bfloat16 is 0.334, 2 ** -30 as float16 is 0), else their own."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def _first_q(seed: int, m: int, r: int, xp, dtype):
    """The Q a matrix's first step starts from (m x r), random from seed."""
    return xp.asarray(np.random.default_rng(seed).standard_normal((m, r))).astype(dtype)


def _columns_at_most(q, total: int, xp):
    """q with each column multiplied by the power of two that brings its largest
    magnitude into [0.5, 1) / 2^c, 2^c >= total (m p: Q's rows times the ranks). Each
    rank's P = M Q is then below M's largest / p, and the ring's sum of the ranks' below
    M's largest. The Q kept for the warm start (M^T P, P orthonormal) is as large as the
    gradient M, and P = M Q was as large as its square: float32 gradients of 1e18
    overflowed it (NaN updates), and of 1e-30 underflowed it to 0; scaled to 1 only, a
    warm Q still summed m of M's largest in each element of P (the ranks' too), and
    float32 gradients of 1e36 overflowed it on 3 ranks. Only P's direction counts (its
    columns are made orthonormal next), and a power of two scales exactly: in between,
    P's columns come out bit for bit as before."""
    top = xp.abs(q).max(axis=0) if q.size else xp.zeros(q.shape[1:], q.dtype)
    exponent = xp.frexp(top)[1]  # (0 for a column of 0s, which stays as it is)
    return xp.ldexp(q, -exponent - (total - 1).bit_length()).astype(q.dtype, copy=False)


# Each rank applies P Q^T to its own replica, and keeps its own error feedback and Q, all
# from P and Q as the all-reduces left them: the same bits on every rank. BLAS and LAPACK
# would round them differently on different CPUs (OpenBLAS picks its kernels, FMA or
# not, per CPU generation: nodes of a cluster bought in two batches), and the replicas
# would drift apart from the first step, silently; cuBLAS and cuSOLVER likewise between
# GPU models. So the core computes both in a fixed order (csrc/lowrank.h), no slower
# than BLAS at PowerSGD's ranks. For cupy arrays, P Q^T is the same sequence of
# ufuncs (each correctly rounded, each its own kernel: nothing fused into an FMA), and
# P (n x r, small) goes to the host for its QR: the same bits as numpy's, on any GPU.
# (M Q and M^T P are BLAS's, on every rank: they are averaged afterwards.)
_SAME_BITS_EVERYWHERE = (np.dtype(np.float32), np.dtype(np.float64))


def _low_rank_product(p, q, xp):
    """p @ q.T (p: n x r, q: m x r)."""
    if p.dtype not in _SAME_BITS_EVERYWHERE or q.dtype != p.dtype:
        return p @ q.T
    if xp is not np:  # (the core's order: ((p0 q0 + p1 q1) + p2 q2) + ...)
        out = p[:, :1] * q[:, 0]
        for k in range(1, p.shape[1]):
            out += p[:, k:k + 1] * q[:, k]
        return out
    out = np.empty((p.shape[0], q.shape[0]), p.dtype)
    _core.low_rank_product(out, np.ascontiguousarray(p), np.ascontiguousarray(q))
    return out


def _orthonormal_columns(p, xp):
    """The Q of p's QR (n x r, r <= n): with a column of 0s, or one that depends on the
    columns before it, still orthonormal columns (a unit vector orthogonal to those);
    all NaN where p has a NaN or an inf."""
    if p.dtype not in _SAME_BITS_EVERYWHERE:
        q, _ = xp.linalg.qr(p)
        return q.astype(p.dtype)
    out = np.empty(p.shape, p.dtype)
    _core.orthonormal_columns(out, np.ascontiguousarray(p if xp is np else xp.asnumpy(p)))
    return out if xp is np else xp.asarray(out)


def _wire_dtype(compression: str | None, like, who: str):
    """The dtype gradients travel as, for None, "fp16" or "bf16"; who: what errors begin
    with (DistributedOptimizer's, naming the rank)."""
    if compression is None:
        return like.dtype
    if isinstance(compression, str):
        compression = compression.lower()
    if compression == "fp16":
        return np.dtype(np.float16)
    if compression == "bf16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError(f"{who}: compression='bf16' needs the ml_dtypes package") from None
        if array_module(like) is not np:
            raise ValueError(f"{who}: compression='bf16' works on numpy arrays only (cupy has no "
                             "bfloat16); use 'fp16'")
        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"{who}: compression must be None, 'fp16', 'bf16' or a PowerSGD instance, "
                     f"got {compression!r}")
