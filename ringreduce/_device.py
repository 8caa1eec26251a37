"""GPU arrays through the device ring: cupy arrays in, cupy arrays out.

Any object with ``__cuda_array_interface__`` (a cupy array, a torch CUDA tensor, ...)
is read in place, without a copy; results are cupy arrays. Stream semantics: each call
is ordered after the work already enqueued on the caller's current cupy stream when
the call is made, and its result is ready on that stream when the call (or the
handle's ``wait()``) returns.

Each ``prepare_*`` function checks its arguments in the caller's thread and returns a
``run()`` closure, which the Communicator runs at once or on its worker thread, as for
numpy arrays.
"""
from __future__ import annotations

import threading

import numpy as np

from . import _core
from . import _types as t
from ._arrays import keeping_on_departure


# Tests only: run the core's host emulation of a GPU (see csrc/device.h), so that this
# module can be tested, with a stand-in for cupy, on machines without one.
_EMULATE = False


def is_device_array(x) -> bool:
    # The type test first: a failed hasattr() costs more than the rest of a small call.
    return (type(x) is not np.ndarray and hasattr(x, "__cuda_array_interface__")
            and not isinstance(x, np.ndarray))


def _cupy(context: str, argument: str, x):
    if not t.cuda_available():
        raise TypeError(f"{context}: {argument} is a GPU array ({type(x).__name__}), but this "
                        f"process has no usable GPU ({_core.cuda_status()})")
    try:
        import cupy
    except ImportError:
        raise TypeError(f"{context}: {argument} is a GPU array ({type(x).__name__}); "
                        "ringreduce needs cupy for GPU arrays: pip install cupy-cuda12x "
                        "(or -cuda13x, to match your CUDA)") from None
    return cupy


def as_device_array(x, argument: str, context: str):
    """(cupy module, x as a cupy array on the GPU it lives on); no copy."""
    cp = _cupy(context, argument, x)
    try:
        array = x if isinstance(x, cp.ndarray) else cp.asarray(x)
    except Exception as error:
        raise TypeError(f"{context}: {argument} ({type(x).__name__}) cannot be read as a GPU "
                        f"array: {error}") from None
    return cp, array


def _check_aligned(a, argument: str, context: str):
    """A GPU's kernels fault on an element at an address that is not a multiple of its
    alignment, and the fault ends CUDA for the whole process, cupy's too (the host path
    reads any address): refused before any kernel, cupy's copies included."""
    if a.data.ptr % a.dtype.alignment:
        raise ValueError(
            f"{context}: {argument} is a GPU array at an address ({a.data.ptr:#x}) that is "
            f"not a multiple of its {a.dtype.name} elements' alignment ({a.dtype.alignment} "
            "bytes), which GPU kernels cannot read (a view at a byte offset, say); use an "
            "array of its own (cupy.empty's memory is aligned)")


def _check_out(cp, out, shape, dtype, device: int, context: str):
    t.check_out(out, shape, dtype, context, cp.ndarray, "cupy.ndarray (x is a GPU array)")
    if out.device.id != device:
        raise ValueError(f"{context}: out is on GPU {out.device.id} but x is on GPU {device}")


def _extent(a) -> tuple:
    """(address, bytes) of a C-contiguous GPU array: exactly the memory it uses."""
    return a.data.ptr, a.nbytes


def _ranges_overlap(a, b) -> bool:
    """Two (address, bytes) ranges share a byte."""
    return a[1] > 0 and b[1] > 0 and a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def _overlap_but_differ(a, b) -> bool:
    """Two C-contiguous arrays share bytes without being the same bytes. (Bounds are
    exact for contiguous arrays; cupy.shares_memory would sort every address.)"""
    return _ranges_overlap(_extent(a), _extent(b)) and _extent(a) != _extent(b)


class _Launch:
    """Where and after what a call runs: x's GPU, the caller's current stream, and an
    event recorded on that stream now (so later work on it is not waited for)."""

    __slots__ = ("cp", "device", "stream", "ready", "direct", "caller")

    def __init__(self, cp, array, direct: bool):
        self.cp = cp
        self.caller = threading.get_ident()
        self.device = array.device.id
        with cp.cuda.Device(self.device):
            self.stream = cp.cuda.get_current_stream()
            self.ready = cp.cuda.Event(block=False, disable_timing=True, interprocess=False)
            self.ready.record(self.stream)
        self.direct = direct

    def on_its_device(self):
        """First thing in run(). On ringreduce's worker thread (an asynchronous call, or
        one queued behind it) x's GPU is made current, and stays so: the thread's
        current GPU before is GPU 0, whichever GPU the rank uses, and switching back to
        it (as `with cupy.cuda.Device(...)` or the core would, at the end) makes a CUDA
        context there (CUDA 12 does, on cudaSetDevice): memory on GPU 0 for every
        rank, and errors where GPUs are in exclusive-process mode. The caller's own
        thread keeps its current GPU."""
        if threading.get_ident() != self.caller:
            self.cp.cuda.runtime.setDevice(self.device)

    def args(self, ready=None):
        """The five arguments every *_device call of the core ends with (but for
        allreduce_device's optional check, after them); the ring waits
        for `ready` (an event), by default the one recorded when the call was made."""
        ready = self.ready if ready is None else ready
        return self.device, ready.ptr, self.stream.ptr, self.direct, _EMULATE

    def context(self, stream=None):
        """The caller's GPU and `stream` (by default the caller's), for cupy work done
        on the worker thread."""
        return _StreamContext(self.cp, self.device, self.stream if stream is None else stream)

    def allocating_stream(self):
        """The stream under which run() takes memory from cupy's pool, and copies:
        the caller's, but the legacy default stream (Stream.null) on the worker thread
        for a caller on cupy's per-thread default stream (ptr 2). There ptr 2 is the
        worker's own stream, whose freed memory cupy keeps per thread: an earlier
        result the worker allocated comes back to it when freed, maybe while some
        thread's kernels still read it, and nothing orders the worker's stream after
        them. The legacy stream follows the work already enqueued on every blocking
        stream, every thread's per-thread stream included, so an event recorded there
        after the allocation (after()) makes the ring wait for those kernels."""
        if self.stream.ptr == 2 and threading.get_ident() != self.caller:
            return self.cp.cuda.Stream.null
        return self.stream

    def after(self, stream):
        """An event for the ring to wait on instead of `ready`, recorded on `stream`
        after run()'s own allocation and copies there. cupy's pool hands out memory
        whose last users are ordered only on the stream it was freed to, maybe after
        the call was made (another thread's work on a shared stream, while the call
        waited in the queue), so the ring waits for that stream as it is now."""
        event = self.cp.cuda.Event(block=False, disable_timing=True, interprocess=False)
        event.record(stream)
        return event

    def settle(self):
        """After cupy work in run(): cupy's per-thread default stream (ptr 2) names
        another stream on the worker thread than on the caller's, so there the work
        is finished before the call counts as done."""
        if self.stream.ptr == 2:
            self.stream.synchronize()


class _StreamContext:
    def __init__(self, cp, device, stream):
        self.device = cp.cuda.Device(device)
        self.stream = stream

    def __enter__(self):
        self.device.__enter__()
        self.stream.__enter__()

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


def _refuse_capture(cp, x, context: str) -> None:
    """Raises where the caller's current stream (on x's GPU) is capturing a CUDA graph:
    the call's event and its waits on it would pull ringreduce's own streams into the
    capture, and CUDA would end it with an error that seems ringreduce's; nor could a
    graph replay MPI. First thing: a copy of x or a new out would be captured too."""
    with cp.cuda.Device(x.device.id):
        capturing = getattr(cp.cuda.get_current_stream(), "is_capturing", None)
        if capturing is not None and capturing():
            raise RuntimeError(f"{context}: the current stream is capturing a CUDA graph; a "
                               "collective cannot be captured (it waits for other ranks): "
                               "call it outside the capture")


def prepare_allreduce(comm, context, x, op, out, check=0):
    cp, x = as_device_array(x, "x", context)
    _refuse_capture(cp, x, context)
    dtype, op = t.reduction_codes(x.dtype, op, context)
    _check_aligned(x, "x", context)
    launch_device = x.device.id
    with cp.cuda.Device(launch_device):
        source = x if x.flags.c_contiguous else cp.ascontiguousarray(x)
        if out is None:
            out = cp.empty(x.shape, x.dtype)
        else:
            _check_out(cp, out, x.shape, x.dtype, launch_device, context)
            _check_aligned(out, "out", context)
            if _overlap_but_differ(source, out):
                source = source.copy()  # the ring would read its own writes
    launch = _Launch(cp, source, comm._cuda_direct())
    core, chunk, count = comm._core, comm.chunk_bytes, x.size

    def run():
        launch.on_its_device()
        core.allreduce_device(source.data.ptr, out.data.ptr, count, dtype, op, chunk,
                              *launch.args(), check)
        return out

    return run


def prepare_reduce_scatter(comm, context, x, op, out):
    cp, x = as_device_array(x, "x", context)
    _refuse_capture(cp, x, context)
    dtype, op = t.reduction_codes(x.dtype, op, context)
    _check_aligned(x, "x", context)
    offset, count = _core.segment_of(comm.rank, comm.size, x.size)
    with cp.cuda.Device(x.device.id):
        if out is None:
            out = cp.empty(count, x.dtype)
        else:
            _check_out(cp, out, (count,), x.dtype, x.device.id, context)
            _check_aligned(out, "out", context)  # (filled by a kernel's copy)
        source = x if x.flags.c_contiguous else cp.ascontiguousarray(x)
        work = cp.empty(x.size, x.dtype)
    launch = _Launch(cp, source, comm._cuda_direct())
    core, chunk = comm._core, comm.chunk_bytes

    def run():
        launch.on_its_device()
        core.reduce_scatter_device(source.data.ptr, work.data.ptr, x.size, dtype, op, chunk,
                                   *launch.args())
        with launch.context():
            out[...] = work[offset:offset + count]
        launch.settle()
        return out

    return run


def prepare_allgather(comm, context, x, out):
    cp, x = as_device_array(x, "x", context)
    _refuse_capture(cp, x, context)
    dtype = t.dtype_code(x.dtype, "x", context)
    if not x.flags.c_contiguous:  # (copied by a kernel; else by bytes, at any address)
        _check_aligned(x, "x", context)
    with cp.cuda.Device(x.device.id):
        source = x if x.flags.c_contiguous else cp.ascontiguousarray(x)
    rows = 1 if x.ndim == 0 else x.shape[0]
    row_shape = tuple(x.shape[1:])
    if out is not None:
        _check_out(cp, out, (None,) + row_shape, x.dtype, x.device.id, context)
    row_elems = int(np.prod(row_shape, dtype=np.int64))
    shape_tag = t.shape_tag(row_shape)
    launch = _Launch(cp, source, comm._cuda_direct())
    core, chunk = comm._core, comm.chunk_bytes

    out_rows = -1 if out is None else out.shape[0]
    itemsize = x.dtype.itemsize

    def run():
        launch.on_its_device()
        counts = core.allgather_counts(rows, row_elems, shape_tag, dtype, chunk, out_rows,
                                       device=True)
        total = sum(counts)
        nbytes = total * row_elems * itemsize
        # From here the ranks are committed to this call: whatever fails on one rank
        # (allocating the result, pinned staging, the GPU) is reported to all by the
        # core, which confirms every rank is ready before the ring starts.
        source_now, result, failure, ready = source, out, None, None
        try:
            stream = launch.allocating_stream()
            with launch.context(stream):
                # Where that is not the caller's stream, the copy below must still
                # follow what `ready` marked.
                stream.wait_event(launch.ready)
                if result is None:
                    result = cp.empty((total,) + row_shape, x.dtype)
                mine = sum(counts[:comm.rank]) * row_elems * itemsize
                block = result.data.ptr + mine, rows * row_elems * itemsize
                if (_ranges_overlap(_extent(source), (result.data.ptr, nbytes))
                        and _extent(source) != block):
                    source_now = source.copy()  # x inside out, not as its own block
                # With neither, the ring waits only for the work enqueued before the
                # call, as documented.
                if result is not out or source_now is not source:
                    ready = launch.after(stream)
            core.reserve_staging(nbytes, *launch.args(ready))
        except Exception as error:  # cupy's OutOfMemoryError is a MemoryError
            failure = error
        try:
            keeping_on_departure(core, lambda: core.allgather_device(
                source_now.data.ptr, 0 if result is None else result.data.ptr, counts,
                row_elems, dtype, failure is None, *launch.args(ready)), source_now, result)
        except MemoryError:
            if failure is not None:
                raise failure from None
            raise
        return result

    return run


def prepare_broadcast(comm, context, x, root):
    cp, array = as_device_array(x, "x", context)
    _refuse_capture(cp, array, context)
    dtype = t.dtype_code(array.dtype, "x", context)
    t.check_root(root, comm.size, context)
    if not array.flags.c_contiguous:  # (copied by a kernel; else by bytes, at any address)
        _check_aligned(array, "x", context)
    with cp.cuda.Device(array.device.id):
        buffer = array if array.flags.c_contiguous else cp.ascontiguousarray(array)
    launch = _Launch(cp, buffer, comm._cuda_direct())
    core, chunk, root = comm._core, comm.chunk_bytes, int(root)

    def run():
        launch.on_its_device()
        core.broadcast_device(buffer.data.ptr, array.size, dtype, root, chunk, *launch.args())
        if buffer is not array:
            with launch.context():
                array[...] = buffer.reshape(array.shape)
            launch.settle()
        return x

    return run
