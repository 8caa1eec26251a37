"""Just enough of cupy's surface, over host memory, for ringreduce/_device.py to run on
machines without a GPU: arrays that present __cuda_array_interface__, streams, events
and devices that do nothing (though streams are current per thread, as cupy's are).
Paired with the core's host emulation of the GPU (ringreduce._device._EMULATE), the
Python half of the GPU path (argument checks, out=, in place, strides, the async
worker, allgather's allocation) runs under MPI in CI.

The arrays also do arithmetic, as cupy's do, in numpy on the host: operators, methods,
numpy's ufuncs and functions on them (cupy implements __array_ufunc__ and
__array_function__), and cupy's own functions where they are numpy's. As in cupy,
reductions return 0-d arrays, and an implicit conversion to a numpy array raises
TypeError. So the code for cupy models (optimizers, compression, the digits example)
runs here too (test_gpu_emulated.py). What cupy and CUDA really do is for
tests/mpi/test_gpu.py, on a GPU."""
from __future__ import annotations

import sys
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
        return ndarray(np.asarray(self.host[_host(key)]))

    def __setitem__(self, key, value):
        self.host[_host(key)] = _host(value)

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

    # Arithmetic, in numpy on the host (cupy's own would run kernels on the GPU).
    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if "out" in kwargs:
            kwargs["out"] = tuple(_host(o) for o in kwargs["out"])
        return _device_array(getattr(ufunc, method)(*_operands(inputs), **_host(kwargs)))

    def __array_function__(self, func, types, args, kwargs):
        return _device_array(func(*_host(args), **_host(kwargs)))

    def __len__(self):
        return len(self.host)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __bool__(self):
        return bool(self.host)

    def __int__(self):
        return int(self.host)

    def __complex__(self):
        return complex(self.host)

    def __repr__(self):
        return f"fake_cupy.{self.host!r}"

    def item(self):
        return self.host.item()

    def tolist(self):
        return self.host.tolist()

    T = property(lambda self: ndarray(self.host.T))
    real = property(lambda self: ndarray(self.host.real))
    imag = property(lambda self: ndarray(self.host.imag))


def _host(x):
    """x with every fake array in it (nested in tuples, lists, dicts) as its numpy array."""
    if isinstance(x, ndarray):
        return x.host
    if isinstance(x, (tuple, list)):
        return type(x)(_host(item) for item in x)
    if isinstance(x, dict):
        return {key: _host(value) for key, value in x.items()}
    return x


def _operands(x):
    """_host(x), refusing numpy arrays as cupy's kernels do (of any shape: a 0-d one is
    no scalar to cupy), where an operator, a ufunc or an elementwise function of
    cupy's would launch one."""
    if isinstance(x, np.ndarray):
        raise TypeError(f"Unsupported type {type(x)}")
    if isinstance(x, (tuple, list)):
        return type(x)(_operands(item) for item in x)
    return _host(x)


def _device_array(x):
    """numpy's result as cupy's would be: arrays (and scalars: cupy's reductions give
    0-d arrays) on the "GPU"; tuples of them too."""
    if isinstance(x, (np.ndarray, np.generic)):
        return ndarray(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(_device_array(item) for item in x)
    return x


def _on_device(function, operands=_operands):
    def on_device(*args, **kwargs):
        return _device_array(function(*operands(args), **_host(kwargs)))

    on_device.__name__ = function.__name__
    return on_device


# Operators and methods: numpy's, on the host array, with results on the "GPU". The
# in-place ones write into the host array and return the same fake array.
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
              "or", "xor", "lshift", "rshift"):
    for _form in ("__{}__", "__r{}__"):
        _dunder = _form.format(_name)
        setattr(ndarray, _dunder, (lambda d: lambda self, other: _device_array(
            getattr(self.host, d)(_operands(other))))(_dunder))

    def _in_place(self, other, _dunder=f"__i{_name}__"):
        result = getattr(self.host, _dunder)(_operands(other))
        if result is not self.host:  # (numpy writes in place, or says it cannot)
            return NotImplemented
        return self

    setattr(ndarray, f"__i{_name}__", _in_place)
for _dunder in ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__neg__",
                "__pos__", "__abs__", "__invert__"):
    setattr(ndarray, _dunder, (lambda d: lambda self, *other: _device_array(
        getattr(self.host, d)(*_operands(other))))(_dunder))
ndarray.__hash__ = None  # (as cupy's and numpy's arrays: __eq__ is elementwise)
for _method in ("sum", "prod", "mean", "max", "min", "all", "any", "astype", "view", "fill",
                "dot", "conj", "argmax", "argmin", "clip", "squeeze", "flatten", "ravel",
                "transpose", "std", "var", "cumsum", "nonzero", "round", "swapaxes"):
    setattr(ndarray, _method, (lambda m: lambda self, *args, **kwargs: _device_array(
        getattr(self.host, m)(*_host(args), **_host(kwargs))))(_method))

# cupy's functions that are numpy's (by name: a name real cupy lacks is not here).
# Those that make an array take numpy's too (its data, or its shape and dtype).
for _name in ("zeros_like", "ones_like", "full_like", "array"):
    globals()[_name] = _on_device(getattr(np, _name), operands=_host)
for _name in ("zeros", "full", "arange",
              "linspace", "sqrt", "exp", "log", "log1p", "expm1", "tanh", "abs", "absolute",
              "sign", "maximum", "minimum", "isfinite", "isnan", "isinf", "where", "sum",
              "prod", "mean", "max", "min", "amax", "amin", "argmax", "argmin", "matmul",
              "dot", "outer", "stack", "vstack", "hstack", "split", "array_split", "clip",
              "square", "einsum", "allclose", "array_equal", "count_nonzero", "take",
              "cumsum", "diag", "eye", "logaddexp", "round", "frexp", "ldexp",
              "multiply", "add", "subtract", "divide", "negative", "reshape", "transpose",
              "copyto", "any", "all", "nonzero", "unique", "sort", "argsort", "float_power",
              "ravel", "concatenate", "ascontiguousarray"):
    globals()[_name] = _on_device(getattr(np, _name))
del _name, _form, _dunder, _method
linalg = types.SimpleNamespace(qr=_on_device(np.linalg.qr), norm=_on_device(np.linalg.norm),
                               svd=_on_device(np.linalg.svd))
for _dtype in ("float16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
               "uint32", "uint64", "complex64", "complex128", "bool_", "dtype", "newaxis",
               "pi", "inf", "nan"):
    globals()[_dtype] = getattr(np, _dtype)
del _dtype


def get_array_module(*arrays):
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in arrays) else np


def asarray(x, dtype=None):
    if isinstance(x, ndarray):
        return x if dtype is None or x.dtype == dtype else x.astype(dtype)
    return ndarray(np.asarray(x, dtype))


def asnumpy(x):
    return x.host.copy()


# (thread, current stream's ptr) of each empty(), for tests to read: which of cupy's
# pool arenas the real one would have taken the memory from.
allocations = []


def empty(shape, dtype=float):
    allocations.append((threading.get_ident(), get_current_stream().ptr))
    return ndarray(np.empty(shape, dtype))


def empty_like(x, dtype=None):
    return ndarray(np.empty_like(x.host, dtype))


def ones(shape, dtype=float):
    return ndarray(np.ones(shape, dtype))


float32 = np.float32

# cupy.random's one function that docs/gpu.md's example calls (tests/test_docs.py runs it
# here), with cupy's signature: standard_normal(size=None, dtype=float).
random = types.SimpleNamespace(
    standard_normal=lambda size=None, dtype=float: ndarray(np.asarray(
        np.random.default_rng().standard_normal(size, dtype=np.dtype(dtype)))))


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


def emulate_gpu(patch=None) -> None:
    """Makes this module ringreduce's cupy, over the core's host emulation of a GPU, in
    this process: `import cupy` gives it, ringreduce takes its arrays for GPU arrays,
    and rr.cuda_available() says True (the digits example asks it before it takes
    cupy). patch: a pytest MonkeyPatch that undoes it all (None: for good)."""
    import ringreduce as rr
    from ringreduce import _device

    this = sys.modules[__name__]
    set_attribute = setattr if patch is None else patch.setattr
    if patch is None:
        sys.modules["cupy"] = this
    else:
        patch.setitem(sys.modules, "cupy", this)
    set_attribute(_device, "_EMULATE", True)
    set_attribute(_device, "_cupy", lambda *args: this)
    set_attribute(rr, "cuda_available", lambda: True)
