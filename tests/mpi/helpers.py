"""Data and expectations shared by the tests that run on every rank."""
import contextlib
import functools
import os
import threading

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from ringreduce import _core, _device

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bfloat16 tests are skipped without ml_dtypes
    BFLOAT16 = None

DTYPES = [BFLOAT16 if name == "bfloat16" else np.dtype(name) for name in rr.supported_dtypes()]
OPS = list(rr.OPS)


def pretended_machines(size=MPI.COMM_WORLD.Get_size()):
    """The machine each rank of MPI_COMM_WORLD says it is on, under
    RINGREDUCE_TEST_MACHINE ("a,b": round-robin over two); None where it is unset."""
    names = os.environ.get("RINGREDUCE_TEST_MACHINE")
    if not names:
        return None
    names = names.split(",")
    return [names[r % len(names)] for r in range(size)]


def on_one_machine():
    """Whether the ranks may share memory: all on one machine (pretended or not), and
    RINGREDUCE_SHM not 0."""
    return (len(set(pretended_machines() or [None])) == 1
            and os.environ.get("RINGREDUCE_SHM") != "0")


def supported(dtype, op):
    if dtype.kind == "c" and op in ("min", "max"):
        return False
    if dtype.kind in "iub" and op == "avg":
        return False
    return True


COMBOS = [(d, op) for d in DTYPES for op in OPS if supported(d, op)]


def around_inline_limit(comm, itemsize, sizes=()):
    """sizes, and element counts that straddle comm's inline limit: the largest call
    that rides in the header exchange (16 KiB through shared memory, 256 bytes over MPI,
    none on one rank) and the smallest that runs the ring, plus one with uneven segments."""
    size = comm.size
    edge = max(comm._core.inline_capacity // itemsize, 1)
    return sorted(set(sizes) | {edge, edge + 1, edge + 3 * size + 1})


def combo_id(combo):
    return f"{combo[0].name}-{combo[1]}"


def rank_data(dtype, n, op="sum", salt=0, comm=MPI.COMM_WORLD):
    """Rank-dependent random data, never all ones (ones hide chunk-index bugs)."""
    rng = np.random.default_rng([comm.Get_rank(), n, salt, 12345])
    if dtype.kind == "b":  # (half True: on 4 ranks an or is 94% True, an and 6%)
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    if op == "prod":  # stay near magnitude 1 so products neither overflow nor vanish
        real = rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)
    else:
        real = rng.standard_normal(n) * 10.0
    if dtype.kind == "c":
        imag = rng.uniform(0.5, 1.5, n) if op == "prod" else rng.standard_normal(n) * 10.0
        return (real + 1j * imag).astype(dtype)
    return real.astype(dtype)


def tied_values(dtype, n, seed):
    """n values, from np.random.default_rng(seed), among +0 and -0, NaNs of either sign,
    1, -1 and inf: equal values (+0 and -0, two NaNs) of whose two operands min and max
    keep the first, so that the bits of a reduction of them tell the order of its
    operands, which random data, never tied, does not."""
    rng = np.random.default_rng(seed)
    with np.errstate(invalid="ignore"):
        return rng.choice([0.0, -0.0, 1.0, -1.0, np.inf, np.nan, -np.nan], n).astype(dtype)


def random_bits(dtype, n, seed):
    """n elements of dtype made of random bytes, from np.random.default_rng(seed): every
    bit pattern, so NaNs of either sign with any payload (signalling ones too),
    subnormals, -0 and bools of any nonzero byte. Only arithmetic changes such bits: a
    collective that only copies (allgather, broadcast) must hand them on as they are."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)


def wide(a):
    """float64/complex128 copy of a float array (bfloat16 included)."""
    return a.astype(np.complex128 if a.dtype.kind == "c" else np.float64)


def exact_integer_reduce(arrays, op):
    fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    with np.errstate(over="ignore"):
        return functools.reduce(lambda a, b: fn(a, b), arrays)  # wraps like the ring


def check_against_float64(result, arrays, op):
    """The result is within rounding of the float64 reduction of every rank's data."""
    size = len(arrays)
    w = [wide(a) for a in arrays]
    eps = float(np.finfo(np.float32 if result.dtype == BFLOAT16 else
                         (result.real.dtype if result.dtype.kind == "c" else result.dtype)).eps)
    if result.dtype == BFLOAT16:
        eps = 2.0 ** -8
    if op in ("min", "max"):
        expected = functools.reduce(np.minimum if op == "min" else np.maximum, w)
        np.testing.assert_array_equal(wide(result), expected)
        return
    if op == "prod":
        expected = functools.reduce(np.multiply, w)
        bound = 4 * size * eps * np.abs(expected) + 1e-300
    else:
        expected = functools.reduce(np.add, w)
        bound = 4 * size * eps * functools.reduce(np.add, [np.abs(a) for a in w]) + 1e-300
        if op == "avg":
            expected, bound = expected / size, bound / size
    error = np.abs(wide(result) - expected)
    assert np.all(error <= bound), (
        f"{op} {result.dtype}: worst error {error.max()} over bound "
        f"{bound.ravel()[np.argmax(error)]}")


def same_on_every_rank(array, comm=MPI.COMM_WORLD):
    """The bytes (and shape) of array, or of each array of a list (a model's parameters:
    replicas alike), are identical on every rank."""
    arrays = array if isinstance(array, list) else [array]
    blobs = comm.allgather([(a.shape, a.tobytes()) for a in arrays])
    return all(b == blobs[0] for b in blobs)


def result_and_peak_allocated(call):
    """call()'s result, and the most that Python and numpy held allocated at once while
    it ran (tracemalloc's peak, beyond what was held before: numpy reports its data
    buffers to it, the core's own buffers are not numpy's)."""
    import tracemalloc  # (here: only the memory tests trace)
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def bitwise_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_host_and_gpu_arrays_in_one_call_raise_everywhere(comm, cp):
    """Rank 0 passes numpy, the others GPU arrays (cp: cupy, or the tests' stand-in):
    MismatchError on every rank, and the communicator still works."""
    from ringreduce import reference

    x = rank_data(np.dtype(np.float32), 1000)
    rank = MPI.COMM_WORLD.Get_rank()
    import pytest

    with pytest.raises(rr.MismatchError, match="memory"):
        comm.allreduce(x if rank == 0 else cp.asarray(x))
    assert bitwise_equal(cp.asnumpy(comm.allreduce(cp.asarray(x))),
                         reference.allreduce(x, "sum"))


def check_gpu_argument_errors(comm, cp):
    """Bad out= and op for GPU arrays raise the right errors (cp: cupy or the stand-in)."""
    import pytest

    dx = cp.asarray(np.zeros(10, np.float32))
    with pytest.raises(TypeError, match="cupy.ndarray"):
        comm.allreduce(dx, out=np.zeros(10, np.float32))
    with pytest.raises(TypeError, match="dtype"):
        comm.allreduce(dx, out=cp.empty(10, np.float64))
    with pytest.raises(ValueError, match="shape"):
        comm.allreduce(dx, out=cp.empty(11, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.allreduce(dx, out=cp.empty(20, np.float32)[::2])
    with pytest.raises(rr.UnsupportedOpError):
        comm.allreduce(cp.asarray(np.zeros(3, np.int32)), op="avg")
    with pytest.raises(ValueError, match="root"):
        comm.broadcast(dx, root=comm.size)
    check_misaligned_gpu_arrays(comm, cp)


def misaligned_gpu_array(cp, values: np.ndarray):
    """A GPU array of values whose address is one byte past an aligned one (as a view at
    a byte offset is): cupy's, or the stand-in's over numpy memory."""
    if hasattr(cp, "emulate_gpu"):  # (the stand-in)
        memory = np.frombuffer(bytearray(values.nbytes + 1), values.dtype, values.size, 1)
        a = cp.ndarray(memory.reshape(values.shape))
    else:
        a = cp.ndarray(values.shape, values.dtype, memptr=cp.cuda.alloc(values.nbytes + 1) + 1)
    a.set(values)
    return a


def check_misaligned_gpu_arrays(comm, cp):
    """A GPU array at an address its kernels cannot read elements from is refused where a
    kernel would read it (the fault would end CUDA in the process); allgather and
    broadcast of a contiguous one copy bytes only, and work."""
    import pytest

    limit = comm._core.device_host_reduce_bytes
    comm._core.device_host_reduce_bytes = 0  # (the device ring's kernels, not the host's)
    try:
        n = 1000
        values = np.arange(n, dtype=np.float32) + comm.rank
        odd = misaligned_gpu_array(cp, values)
        assert odd.data.ptr % 4 == 1
        block = int(_core.segment_of(comm.rank, comm.size, n)[1])
        for call in (lambda: comm.allreduce(odd),
                     lambda: comm.allreduce(cp.asarray(values), out=odd),
                     lambda: comm.reduce_scatter(odd),
                     lambda: comm.reduce_scatter(cp.asarray(values), out=misaligned_gpu_array(
                         cp, np.zeros(block, np.float32)))):
            with pytest.raises(ValueError, match=r"is a GPU array at an address \(0x[0-9a-f]+\) "
                               r"that is not a multiple of its float32 elements' alignment "
                               r"\(4 bytes\), which GPU kernels cannot read"):
                call()
        gathered = comm.allgather(odd)
        np.testing.assert_array_equal(cp.asnumpy(gathered), np.concatenate(
            [np.arange(n, dtype=np.float32) + r for r in range(comm.size)]))
        assert comm.broadcast(odd, root=comm.size - 1) is odd
        np.testing.assert_array_equal(cp.asnumpy(odd), values - comm.rank + comm.size - 1)
        summed = comm.allreduce(cp.asarray(np.ones(n, np.float32)))
        np.testing.assert_array_equal(cp.asnumpy(summed), comm.size)
    finally:
        comm._core.device_host_reduce_bytes = limit

def on_the_worker_without_python(handle) -> bool:
    """Whether the FastPath queued the asynchronous call of this handle: it runs on the
    worker thread without the GIL (else it was queued as Python work, or ran at once).
    (On one rank the FastPath does an allreduce at once, and its handle passes this
    too.)"""
    return isinstance(handle._work, rr._core.AsyncCall)


def run_threads_of(name, monkeypatch) -> list:
    """The thread each run() of _device.<name> runs on, in call order, from now on."""
    threads = []
    prepare = getattr(_device, name)

    def recording(*args):
        run = prepare(*args)

        def run_and_record():
            threads.append(threading.get_ident())
            return run()

        return run_and_record

    monkeypatch.setattr(_device, name, recording)
    return threads


@contextlib.contextmanager
def worker_held(comm, held=True):
    """The worker starts no call meanwhile (if held): only a caller's wait() can. (For
    10 s at most: a wait that never runs them fails its test instead of hanging it.)"""
    calls = comm._executor.calls
    # (A call that is done leaves the queue a moment later: until then the worker holds
    # its front, and a wait() behind it leaves its call to the worker.)
    calls.drain()
    calls.hold_worker(held)
    let_go = threading.Timer(10, calls.hold_worker, (False,))
    let_go.start()
    try:
        yield calls
    finally:
        let_go.cancel()
        calls.hold_worker(False)


class TorchTensor:
    """What a torch tensor on the CPU shows ringreduce: a shape, a dtype of its own
    ("torch.float32", say) and .numpy(), from torch's module (no torch here to make a
    real one). Its __array__ reads as torch's does, refusing a bfloat16 one."""
    __module__ = "torch"
    __qualname__ = "Tensor"

    def __init__(self, n, dtype="torch.float64"):
        self.shape, self.dtype = (n,), dtype

    def numpy(self):
        raise AssertionError("ringreduce must not convert it: it would write into a copy")

    def __array__(self, dtype=None, copy=None):
        if self.dtype == "torch.bfloat16":
            raise TypeError("Got unsupported ScalarType BFloat16")
        return np.ones(self.shape)


class NumpyWithoutMemory:
    """numpy, except that np.empty fails: a rank that cannot allocate its output (set as
    ringreduce.communicator's np)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(*args, **kwargs):
        raise MemoryError("test: np.empty refused")
