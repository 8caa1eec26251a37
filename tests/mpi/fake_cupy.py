"""Just enough of cupy's surface, over host memory, for ringreduce/_device.py to run on
machines without a GPU: arrays that present __cuda_array_interface__, streams, events
and devices that do nothing (though streams are current per thread, as cupy's are).
Paired with the core's host emulation of the GPU (ringreduce._device._EMULATE), the
Python half of the GPU path (argument checks, out=, in place, strides, the async
worker, allgather's allocation) runs under MPI in CI. What cupy and CUDA really do is
for tests/mpi/test_gpu.py, on a GPU."""
from __future__ import annotations

import threading
import types

import numpy as np


class _Pointer:
    def __init__(self, array):
        self.ptr = array.__array_interface__["data"][0]


class _DeviceId:
    id = 0


class ndarray:
    """A numpy array wearing a GPU array's clothes."""

    def __init__(self, host: np.ndarray):
        self.host = host

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.host.shape, "typestr": self.host.dtype.str,
                "data": (_Pointer(self.host).ptr, False), "version": 3,
                "strides": None if self.host.flags.c_contiguous else self.host.strides}

    shape = property(lambda self: self.host.shape)
    dtype = property(lambda self: self.host.dtype)
    size = property(lambda self: self.host.size)
    ndim = property(lambda self: self.host.ndim)
    nbytes = property(lambda self: self.host.nbytes)
    flags = property(lambda self: self.host.flags)
    strides = property(lambda self: self.host.strides)
    data = property(lambda self: _Pointer(self.host))
    device = property(lambda self: _DeviceId())

    def __getitem__(self, key):
        return ndarray(self.host[key])

    def __setitem__(self, key, value):
        self.host[key] = value.host if isinstance(value, ndarray) else value

    def reshape(self, *shape):
        return ndarray(self.host.reshape(*shape))

    def copy(self):
        return ndarray(self.host.copy())

    def get(self, out=None):  # device to host
        if out is None:
            return self.host.copy()
        out[...] = self.host
        return out

    def set(self, host):  # host to device
        self.host[...] = host

    def __float__(self):
        return float(self.host)


def asarray(x):
    if isinstance(x, ndarray):
        return x
    return ndarray(np.asarray(x))


def asnumpy(x):
    return x.host.copy()


# (thread, current stream's ptr) of each empty(), for tests to read: which of cupy's
# pool arenas the real one would have taken the memory from.
allocations = []


def empty(shape, dtype):
    allocations.append((threading.get_ident(), get_current_stream().ptr))
    return ndarray(np.empty(shape, dtype))


def empty_like(x):
    return ndarray(np.empty_like(x.host))


def ones(shape, dtype):
    return ndarray(np.ones(shape, dtype))


float32 = np.float32


def ascontiguousarray(x):
    return ndarray(np.ascontiguousarray(x.host))


def ravel(x):
    return ndarray(np.ravel(x.host))


def concatenate(arrays):
    return ndarray(np.concatenate([a.host for a in arrays]))


class _Nothing:
    id = 0

    def __init__(self, *args, **kwargs):
        self.ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def record(self, stream=None):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def use(self):
        pass


_threads = threading.local()


class Stream(_Nothing):
    """Does nothing, but is current per thread as cupy's streams are (`with stream:`
    nests), and has cupy's two built-in handles: `null` (ptr 0, the legacy default
    stream) and `ptds` (ptr 2, which names each thread's own per-thread stream)."""

    def __init__(self, *args, ptr=1 << 20, **kwargs):
        self.ptr = ptr

    def __enter__(self):
        _threads.__dict__.setdefault("streams", []).append(self)
        return self

    def __exit__(self, *exc):
        _threads.streams.pop()
        return False


Stream.null = Stream(ptr=0)
Stream.ptds = Stream(ptr=2)


def get_current_stream():
    streams = getattr(_threads, "streams", None)
    return streams[-1] if streams else Stream.null


set_devices = []

cuda = types.SimpleNamespace(
    Device=_Nothing, Event=_Nothing, Stream=Stream,
    get_current_stream=get_current_stream,
    get_elapsed_time=lambda start, stop: 1.0,  # ms; nothing is timed on the host
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                  getDeviceProperties=lambda ordinal: {"name": b"emulated"},
                                  # (thread, GPU) of each call, for tests to read
                                  setDevice=lambda ordinal: set_devices.append(
                                      (threading.get_ident(), ordinal)),
                                  ),
    memory=types.SimpleNamespace(OutOfMemoryError=MemoryError),
)


def get_default_memory_pool():
    return types.SimpleNamespace(free_all_blocks=lambda: None)
