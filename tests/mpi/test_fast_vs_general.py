"""Differential fuzz: the core's FastPath against the Python general path.

Every collective has two routes: the binding's FastPath (csrc/bindings.cc), which
serves the common case without Python's checks and returns None for anything else,
and the general path (Communicator._call and _prepare_*), which serves or rejects the
rest. The FastPath must decide nothing the general path would not. So every case here
runs twice, once on a Communicator as it is and once on one whose `_fast` is None
(every call then takes the general path), on inputs built alike, and the two must
agree: the result's bytes (NaNs included), dtype, shape, type and flags, whether it
is `out` or `x`, what `x` and `out` hold afterwards, and for a call that raises the
exception's type and message (and whether it came from the call or from `wait()`).

The cases come from a generator seeded alike on every rank (every rank makes the same
calls; only data differ): every collective; every supported dtype, unsupported ones
(object, longdouble, datetime64, str) and dtypes equal to a supported one but
another object (long long, float64 with metadata); good and bad ops (case variants,
MPI's ops, unhashable ones); 0-d, empty, 1-d and n-d shapes, sizes that ride in the
header exchange, sizes that go round the ring, allgather results past the 1 MiB that
is confirmed; C and F order, strided, reversed, byte-swapped, read-only, masked,
matrix and other subclass inputs, lists and scalars; out= fresh, x itself, a view of
x, overlapping x, read-only, of the wrong dtype, shape, ndim or byte order, F-order, a
subclass, a list; allgather rows that differ per rank (the FastPath's guess at the
result then misses); calls queued behind an asynchronous one, also one whose out= is
the memory x lies in (x must be read once it is done); Handle.wait() with and without
a timeout, after polling done(), and twice; chunk sizes. The FastPath serves a
dtype/op pair only once the general path validated it in this process
(ringreduce._types.validated_pairs), so the tables are also emptied now and then, and
either route may go first. Some cases run a third time with some ranks on the FastPath
and the others on the general path (as where ranks validated different pairs before),
which must give the same outcome. Every rank must also succeed or fail alike (or, where
out= fits one rank's reduce_scatter block and not another's, fail as docs/api.md says a
one-rank bad argument does), and the FastPath must have served a fair share of cases.

RINGREDUCE_FUZZ_SEED and RINGREDUCE_FUZZ_CASES (per block) change what runs, to hunt
beyond the committed seed.
"""
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import _core
from ringreduce import _types as t

from helpers import BFLOAT16

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
SIZE = WORLD.Get_size()

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")

SEED = int(os.environ.get("RINGREDUCE_FUZZ_SEED", "0"))
CASES = int(os.environ.get("RINGREDUCE_FUZZ_CASES", "80"))
BLOCKS = 5

COLLECTIVES = ("allreduce", "allreduce_async", "reduce_scatter", "allgather", "broadcast")
SUPPORTED = [np.dtype(name) for name in ("int8", "int16", "int32", "int64", "uint8", "uint16",
                                         "uint32", "uint64", "float16", "float32", "float64",
                                         "complex64", "complex128", "bool")]
if BFLOAT16 is not None:
    SUPPORTED.append(BFLOAT16)
# Dtypes equal to a supported one but not the same object numpy makes for its name:
# long long (numpy's other int64 and uint64 on Linux), float64 with metadata.
ALIASES = {np.dtype("int64"): np.dtype("q"), np.dtype("uint64"): np.dtype("Q"),
           np.dtype("float64"): np.dtype("float64", metadata={"unit": "m"})}
UNSUPPORTED = [np.dtype(object), np.dtype(np.longdouble),
               np.dtype("datetime64[s]"), np.dtype("U3"), np.dtype("S2")]
GOOD_OPS = ("sum", "prod", "min", "max", "avg")
OTHER_OPS = ("SUM", "Max", "avg", MPI.SUM, MPI.MIN, MPI.PROD, "mean", None, 3, ["sum"],
             MPI.BAND, MPI.LOR, MPI.LXOR, MPI.Op.f2py(MPI.SUM.py2f()), b"sum")
LAYOUTS = ("F", "strided", "reversed", "swapped", "readonly", "subclass",
           "masked", "masked hole", "matrix", "list", "scalar", "python scalar")
COMMON_OUTS = (None, None, "fresh", "x", "x view")
OUTS = ("alias", "overlap", "readonly", "wrong dtype",
        "wrong shape", "wrong ndim", "swapped", "fortran", "subclass", "masked", "list")
ROOTS = (0, 0, 0, "last", "last", "middle", "middle", -1, "size", True, "int64", 1.0, "0")


class Sub(np.ndarray):
    """An ndarray subclass of no meaning to ringreduce."""


def pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def values(dtype, shape, drng, op):
    """Rank-dependent data of dtype, shaped `shape`; floats with now and then a NaN, an
    infinity or a negative zero (their bits must come out alike too)."""
    n = int(np.prod(shape, dtype=np.int64))
    kind = dtype.kind
    if dtype == object:
        v = np.array([int(i) for i in drng.integers(-5, 5, n)] + [None], dtype=object)[:n]
    elif kind == "M":
        v = drng.integers(0, 10**6, n).astype(dtype)
    elif kind in "US":
        v = np.array(["ab", "c", "xyz"] * n)[:n].astype(dtype)
    elif kind == "b":
        v = drng.integers(0, 2, n).astype(bool)
    elif kind in "iu":
        info = np.iinfo(dtype)
        v = drng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    else:
        if op == "prod":
            real = drng.uniform(0.5, 1.5, n) * drng.choice([-1.0, 1.0], n)
        else:
            real = drng.standard_normal(n) * 10.0
        if n and drng.random() < 0.3:
            real[drng.integers(n)] = drng.choice([np.nan, -np.nan, np.inf, -np.inf, -0.0])
        if kind == "c":
            v = (real + 1j * drng.standard_normal(n)).astype(dtype)
        else:
            v = real.astype(dtype)
    return v.reshape(shape)


class Case:
    """One call, drawn from the plan generator (alike on every rank)."""

    def __init__(self, rng, index, ring):
        self.index = index
        self.collective = pick(rng, COLLECTIVES)
        reducing = self.collective in ("allreduce", "allreduce_async", "reduce_scatter")
        # Half the cases are of the kind the FastPath serves (a C-contiguous plain array
        # of a supported dtype, an op valid for it, a simple out=, a valid root), so that
        # it takes part; the other half anything.
        self.common = rng.random() < 0.6
        if self.common:
            self.dtype = pick(rng, SUPPORTED)
            ops = [op for op in GOOD_OPS if not (
                self.dtype.kind == "c" and op in ("min", "max")
                or self.dtype.kind in "iub" and op == "avg")]
            self.op = pick(rng, ops) if reducing else None
            self.layout = "C"
            outs = {"allreduce": ("x", "x view"), "allreduce_async": ("x", "x view"),
                    "allgather": ("overlap",)}.get(self.collective, ())
            self.out = pick(rng, (None, None, "fresh") + outs) \
                if self.collective != "broadcast" else None
        else:
            self.dtype = pick(rng, UNSUPPORTED) if rng.random() < 0.15 else pick(rng, SUPPORTED)
            if rng.random() < 0.3:
                self.dtype = ALIASES.get(self.dtype, self.dtype)
            self.op = (pick(rng, GOOD_OPS) if rng.random() < 0.7 else pick(rng, OTHER_OPS)) \
                if reducing else None
            self.layout = pick(rng, LAYOUTS)
            self.out = pick(rng, OUTS + COMMON_OUTS) if self.collective != "broadcast" else None
        if self.out == "overlap" and self.collective != "allgather":
            self.layout = "offset"  # x a view into a bigger buffer that out overlaps
        item = self.dtype.itemsize
        edge = max(ring._core.inline_capacity // item, 1)
        shapes = [(), (0,), (1,), (int(rng.integers(2, 40)),), (edge,), (edge + 1,),
                  (edge + 3 * SIZE + 1,), (3, 4), (2, 3, 2), (0, 3), (4, 0),
                  (int(rng.integers(1, 9)), 5), (int(rng.integers(300, 3000)),)]
        if self.collective == "allgather":  # results past the size that is confirmed
            shapes.append(((1 << 20) // (item * SIZE) + 1,))
        self.shape = pick(rng, shapes)
        self.uneven = self.collective == "allgather" and rng.random() < 0.3
        # allgather's overlap: x elsewhere in out than its own block
        self.elsewhere = not self.common and rng.random() < 0.5
        self.root = pick(rng, ROOTS[:7] if self.common else ROOTS)
        self.chunk = pick(rng, (None, None, 64, 333))
        # An asynchronous call in flight before this one (the FastPath then queues, or
        # hands the call on); "chain": one whose out= is the memory x lies in, which the
        # call must read only once that one is done.
        self.in_flight = pick(rng, (None,) * 12 + ("before", "chain", "chain"))
        self.wait_mode = pick(rng, ("plain", "plain", "timeout", "poll"))
        # A third run in which some ranks take the FastPath and the others the general
        # path (as where ranks validated different pairs before): the same outcome.
        self.mixed = rng.integers(0, 2, SIZE).astype(bool) if rng.random() < 0.3 else None
        self.forget = rng.random() < 0.07  # the tables forget what the general path validated
        self.fast_first = rng.random() < 0.35
        self.mask_at = int(rng.integers(1 << 30))

    def __repr__(self):
        return (f"case {self.index}{' (common)' if self.common else ''}: {self.collective} {self.dtype} op={t._op_text(self.op)} "
                f"shape={self.shape} layout={self.layout} out={self.out} "
                f"uneven={self.uneven} elsewhere={self.elsewhere} root={self.root!r} "
                f"chunk={self.chunk} in_flight={self.in_flight} wait={self.wait_mode} "
                f"mixed={None if self.mixed is None else self.mixed.astype(int).tolist()} "
                f"forget={self.forget} "
                f"fast_first={self.fast_first}")

    # -- the arguments, built anew for each route ------------------------------------

    def build(self, seed):
        """(x, out, root) for this rank, the same objects' worth for either route."""
        drng = np.random.default_rng([seed, self.index, RANK])
        shape = self.shape
        if self.collective == "allgather" and self.uneven:
            shape = (shape[0] + RANK,) + shape[1:] if shape else (RANK + 1,)
        v = values(self.dtype, shape, drng, self.op)
        if self.collective == "allgather" and self.out == "overlap":
            return self.build_gather_overlap(v), None, None
        x, base = self.layout_of(v)
        out = self.make_out(x, base)
        return x, out, self.root_value()

    def layout_of(self, v):
        """x holding v's values in self.layout; and for "offset" the buffer it is in."""
        layout = self.layout
        if layout == "C":
            return v.copy(), None
        if layout == "F":
            return np.asfortranarray(v), None
        if layout == "strided":
            if v.ndim == 0:
                return v.copy(), None
            big = np.zeros(v.shape[:-1] + (2 * v.shape[-1],), v.dtype)
            x = big[..., ::2]
            x[...] = v
            return x, None
        if layout == "reversed":
            if v.ndim == 0:
                return v.copy(), None
            return np.ascontiguousarray(v[::-1])[::-1], None
        if layout == "swapped":
            return v.astype(v.dtype.newbyteorder("S")), None
        if layout == "readonly":
            x = v.copy()
            x.flags.writeable = False
            return x, None
        if layout == "subclass":
            return v.copy().view(Sub), None
        if layout == "masked":
            return np.ma.masked_array(v.copy()), None
        if layout == "masked hole":
            mask = np.zeros(v.shape, bool)
            if v.size:
                mask.reshape(-1)[self.mask_at % v.size] = True
            return np.ma.masked_array(v.copy(), mask=mask), None
        if layout == "matrix":
            return (np.matrix(v) if v.ndim == 2 else v.copy()), None
        if layout == "list":
            return v.tolist(), None
        if layout == "scalar":
            return (v.reshape(-1)[0] if v.size else v.copy()), None
        if layout == "python scalar":
            first = v.reshape(-1)[0] if v.size else None
            return (getattr(first, "item", lambda: first)() if v.size else v.copy()), None
        if layout == "offset":
            n = v.size
            base = np.zeros(max(n, self.result_size(v.shape, n)) + 2, v.dtype)
            x = base[1:n + 1].reshape(v.shape)
            x[...] = v
            return x, base
        raise AssertionError(layout)

    def result_size(self, shape, n):
        if self.collective == "reduce_scatter":
            return _core.segment_of(RANK, SIZE, n)[1]
        return n

    def result_layout(self, x):
        """The shape and dtype the result has for this x (as the general path would see
        it), on every rank alike but for reduce_scatter's block and uneven rows."""
        try:
            a = np.asarray(x)
        except Exception:
            a = np.zeros(0)
        dtype = t.native(a.dtype)
        if self.collective == "reduce_scatter":
            return (_core.segment_of(RANK, SIZE, a.size)[1],), dtype
        if self.collective == "allgather":
            rows = self.shape[0] if self.shape else 1
            total = SIZE * rows + (SIZE * (SIZE - 1) // 2 if self.uneven else 0)
            return (total,) + tuple(a.shape[1:]), dtype
        return a.shape, dtype

    def make_out(self, x, base):
        kind = self.out
        if kind is None:
            return None
        shape, dtype = self.result_layout(x)
        fresh = np.zeros(shape, dtype)
        if kind == "fresh":
            return fresh
        if kind == "x":
            return x
        if kind == "x view":
            return x.view() if isinstance(x, np.ndarray) else x
        if kind == "overlap":  # (x is base[1:n+1])
            m = int(np.prod(shape, dtype=np.int64))
            start = 0 if self.mask_at % 2 else 2
            return base[start:start + m].reshape(shape)
        if kind == "alias":  # of a dtype equal to x's, but another object
            alias = ALIASES.get(dtype) or {v: k for k, v in ALIASES.items()}.get(dtype, dtype)
            return fresh.view(alias)
        if kind == "readonly":
            fresh.flags.writeable = False
            return fresh
        if kind == "wrong dtype":
            return np.zeros(shape, np.float32 if dtype != np.float32 else np.float64)
        if kind == "wrong shape":
            return np.zeros((shape[0] + 1,) + shape[1:] if shape else (1,), dtype)
        if kind == "wrong ndim":
            return fresh.reshape((1,) + shape)
        if kind == "swapped":
            return fresh.astype(dtype.newbyteorder("S"))
        if kind == "fortran":
            if len(shape) >= 2:
                return np.asfortranarray(fresh)
            big = np.zeros((2 * shape[0],) if shape else (2,), dtype)
            return big[::2] if shape else big[:1].reshape(())
        if kind == "subclass":
            return fresh.view(Sub)
        if kind == "masked":
            return np.ma.masked_array(fresh)
        if kind == "list":
            return fresh.tolist()
        raise AssertionError(kind)

    def build_gather_overlap(self, v):
        """allgather whose x lies in its out=: its own block of rows, or elsewhere (rank
        0's block: every rank's own on one rank). Returns x; self.gather_out is out."""
        rows_before = (self.shape[0] if self.shape else 1) * RANK + (
            RANK * (RANK - 1) // 2 if self.uneven else 0)
        v1 = v.reshape((1,) + v.shape) if v.ndim == 0 else v
        shape, dtype = self.result_layout(v)
        out = np.zeros(shape, dtype)
        start = 0 if self.elsewhere else rows_before
        x = out[start:start + v1.shape[0]]
        if x.shape != v1.shape:  # (never: rows are the same on every rank but uneven)
            x = out[:0]
        x[...] = v1[:x.shape[0]]
        self.gather_out = out
        return x.reshape(()) if v.ndim == 0 else x

    def root_value(self):
        root = self.root
        return {"last": SIZE - 1, "middle": SIZE // 2, "size": SIZE,
                "int64": np.int64(SIZE - 1)}.get(root, root) if isinstance(root, str) \
            and root != "0" else root

    # -- running it --------------------------------------------------------------------

    def run(self, ring, seed):
        x, out, root = self.build(seed)
        if self.collective == "allgather" and self.out == "overlap":
            out = self.gather_out
        before = None
        if self.in_flight == "before":
            before = ring.allreduce_async(np.arange(5.0) + RANK)
        elif self.in_flight == "chain" and not self.uneven:  # (x's size is every rank's)
            before = chain(ring, x)
        counting = ring._fast if isinstance(ring._fast, Counting) else None
        served = counting.served if counting is not None else 0
        try:
            stage = "call"
            if self.collective == "allreduce":
                result = ring.allreduce(x, self.op, out)
            elif self.collective == "allreduce_async":
                handle = ring.allreduce_async(x, self.op, out)
                stage = "wait"
                if self.wait_mode == "timeout":
                    result = handle.wait(timeout=120)
                elif self.wait_mode == "poll":
                    while not handle.done():
                        time.sleep(0)
                    result = handle.wait()
                else:
                    result = handle.wait()
                stage = "second wait"
                assert handle.done() and handle.wait() is result
            elif self.collective == "reduce_scatter":
                result = ring.reduce_scatter(x, self.op, out)
            elif self.collective == "allgather":
                result = ring.allgather(x, out)
            else:
                result = ring.broadcast(x, root)
            outcome = ("result", snapshot(result), result is out and out is not None,
                       result is x)
        except Exception as error:
            outcome = ("raised at " + stage, type(error).__name__, str(error))
            if stage == "wait":  # raised again, the same
                try:
                    handle.wait()
                except Exception as again:
                    outcome += (again is error,)
        if counting is not None:
            self.served = counting.served > served
        try:
            earlier = snapshot(before.wait()) if before is not None else None
        except Exception as error:
            earlier = ("raised", type(error).__name__, str(error))
        return outcome, snapshot(x), snapshot(out), earlier


def chain(ring, x):
    """An allreduce_async (max, or sum for complex) whose out= is the buffer x lies in
    (where that is a plain writeable C-contiguous array of a supported dtype): x then
    holds that call's result, which the next call must read."""
    if not isinstance(x, np.ndarray):
        return None
    owner = x
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    if (type(owner) is not np.ndarray or not owner.flags.c_contiguous
            or not owner.flags.writeable or owner.dtype not in SUPPORTED):
        return None
    op = "sum" if owner.dtype.kind == "c" else "max"
    return ring.allreduce_async(owner.copy(), op, out=owner)


def snapshot(a):
    """What a result, x or out holds, comparable bit for bit."""
    if a is None:
        return None
    if not isinstance(a, np.ndarray):
        return ("not an array", type(a).__name__, repr(a))
    d = a.view(np.ndarray)
    if d.dtype.kind == "O":
        data = repr(d.tolist())
    elif d.dtype.kind == "f" and d.dtype.itemsize > 8:  # (long double's padding is junk)
        data = np.ascontiguousarray(d, dtype=np.float64).tobytes()
    else:
        data = np.ascontiguousarray(d).tobytes()
    mask = repr(np.ma.getmaskarray(a).tolist()) if isinstance(a, np.ma.MaskedArray) else None
    return (type(a).__name__, d.dtype.str, repr(d.dtype), d.shape, d.flags.c_contiguous,
            d.flags.writeable, data, mask)


def describe(a, b):
    """Where two outcomes first differ, briefly."""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        for i, (p, q) in enumerate(zip(a, b)):
            if p != q:
                return f"[{i}] {describe(p, q)}"
    text = lambda v: (v[:64].hex() + ("..." if len(v) > 64 else "")) if isinstance(v, bytes) \
        else repr(v)[:300]
    return f"fast route: {text(a)}; general path: {text(b)}"


class Counting:
    """The Communicator's FastPath, counting the calls it served (not None) and those it
    handed to the general path, so that a test can tell it took part."""

    def __init__(self, fast):
        self.fast = fast
        self.served = self.declined = 0

    @property
    def chunk_bytes(self):
        return self.fast.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value):
        self.fast.chunk_bytes = value

    def count(self, result):
        if result is None:
            self.declined += 1
        else:
            self.served += 1
        return result

    def allreduce(self, *args):
        return self.count(self.fast.allreduce(*args))

    def allreduce_async(self, *args):
        return self.count(self.fast.allreduce_async(*args))

    def reduce_scatter(self, *args):
        return self.count(self.fast.reduce_scatter(*args))

    def allgather(self, *args):
        return self.count(self.fast.allgather(*args))

    def broadcast(self, *args):
        return self.count(self.fast.broadcast(*args))


@pytest.fixture(scope="module")
def rings():
    fast = rr.Communicator(WORLD, timeout=60)
    fast._fast = Counting(fast._fast)
    general = rr.Communicator(WORLD, timeout=60)
    general._fast = None
    mixed = rr.Communicator(WORLD, timeout=60)
    yield fast, general, mixed, mixed._fast
    mixed.close()
    general.close()
    fast.close()


def run_cases(rings, seed, count, first_index=0):
    fast, general, mixed, mixed_fast = rings
    default_chunk = fast.chunk_bytes
    plan = np.random.default_rng([seed, first_index, 4242])
    divergences, outcomes = [], []
    served = 0
    for index in range(first_index, first_index + count):
        case = Case(plan, index, fast)
        assert fast._fast is not None and general._fast is None
        mixed._fast = mixed_fast
        for ring in (fast, general, mixed):
            ring.chunk_bytes = case.chunk or default_chunk
        if case.forget:
            t.validated_pairs.clear()
            if BFLOAT16 is not None:
                t.dtype_codes.pop(BFLOAT16, None)
        routes = (fast, general) if case.fast_first else (general, fast)
        got = {id(ring): case.run(ring, seed) for ring in routes}
        on_fast, on_general = got[id(fast)], got[id(general)]
        served += case.served
        compared = [("", on_fast)]
        if case.mixed is not None:
            mixed._fast = mixed_fast if case.mixed[RANK] else None
            compared.append(("ranks on mixed routes: ", case.run(mixed, seed)))
        for route, outcome in compared:
            for what, a, b in zip(("outcome", "x after", "out after", "the call in flight"),
                                  outcome, on_general):
                if a != b:
                    divergences.append(f"{case}: {route}{what} differs: {describe(a, b)}")
        outcomes.append((repr(case), on_fast[0][0],
                         on_fast[0][1] if on_fast[0][0] != "result" else "",
                         on_fast[0][2] if on_fast[0][0] != "result" else ""))
    mixed._fast = mixed_fast
    for ring in (fast, general, mixed):
        ring.chunk_bytes = default_chunk
    return divergences, outcomes, served


def one_rank_rejected(cases):
    """Where the arguments are bad on some ranks only (reduce_scatter's out= fits one
    rank's block but not another's), those ranks raise their error and the others
    MismatchError, naming them (see docs/api.md, Errors)."""
    return all(kind[1].startswith("raised") for kind in cases) and all(
        kind[2] != "MismatchError" or "rejected" in kind[3] for kind in cases)


def check(divergences, outcomes):
    """Fails on every rank alike, with every rank's divergences (and fails where ranks
    did not all succeed or all fail alike)."""
    everyone = WORLD.allgather((divergences, outcomes))
    problems = [f"rank {r}: {d}" for r, (ds, _) in enumerate(everyone) for d in ds]
    for cases in zip(*[o for _, o in everyone]):
        if len({kind[1:3] for kind in cases}) > 1 and not one_rank_rejected(cases):
            problems.append(f"{cases[0][0]}: ranks differ: "
                            + "; ".join(f"rank {r}: {kind[1:]}" for r, kind in enumerate(cases)))
    assert not problems, f"{len(problems)} divergence(s):\n" + "\n".join(problems[:40])


@pytest.mark.parametrize("block", range(BLOCKS))
def test_fast_path_agrees_with_the_general_path(rings, block):
    divergences, outcomes, served = run_cases(rings, SEED, CASES, first_index=block * CASES)
    check(divergences, outcomes)
    # Not a vacuous comparison: the FastPath served a good share of the cases.
    print(f"\nthe FastPath served {served} of {CASES} cases")
    assert served >= 0.15 * CASES, f"the FastPath served only {served} of {CASES} cases"
