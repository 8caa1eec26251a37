"""Just enough of cupy's surface, over host memory, for ringreduce/_device.py to run on
machines without a GPU: arrays that present __cuda_array_interface__, streams and
events that do nothing (though streams are current per thread and GPU, as cupy's are),
flags as cupy's (no `writeable`), and GPUs that arrays live on (below).
Paired with the core's host emulation of the GPU (ringreduce._device._EMULATE), the
Python half of the GPU path (argument checks, out=, in place, strides, the async
worker, allgather's allocation) runs under MPI in CI.

The arrays also do arithmetic, as cupy's do, in numpy on the host: operators, methods,
numpy's ufuncs and functions on them (cupy implements __array_ufunc__ and
__array_function__), and cupy's own functions where they are numpy's. As in cupy,
reductions return 0-d arrays, and an implicit conversion to a numpy array raises
TypeError. So the code for cupy models (optimizers, compression, the digits example)
runs here too (test_gpu_emulated.py). What cupy and CUDA really do is for
tests/mpi/test_gpu.py, on a GPU.

It has `device_count` GPUs (2), so that code which leaves arrays on the wrong one fails
here: as in CUDA each thread has a current GPU (0 until it sets one; cuda.Device(i) as
a context manager or .use(), runtime.setDevice), arrays stay on the GPU current where
they were made, new arrays and the results of kernels go to the current one, and a
kernel (arithmetic, a reduction, astype, filling or writing into an array, ...) that
reads or writes an array on another GPU raises cupy's ValueError, as cupy does where
the two GPUs have no peer access (with it, cupy warns and reads across the bus). What
runs no kernel works from any GPU, as in cupy: views (slices, reshape), .get(),
.set(), copy() (to the current GPU), float(), asarray() of an array."""
from __future__ import annotations

import builtins
import sys
import threading
import types

import numpy as np


class _Pointer:
    def __init__(self, array, device_id=0):
        self.ptr = array.__array_interface__["data"][0]
        self.device_id = device_id


device_count = 2

_threads = threading.local()


def _current() -> int:
    return getattr(_threads, "device", 0)  # (a new thread's is GPU 0, as in CUDA)


def _set_current(ordinal: int) -> None:
    if not 0 <= ordinal < device_count:
        raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
    _threads.device = ordinal


class CUDARuntimeError(RuntimeError):
    pass


class Device:
    """cupy.cuda.Device: GPU `device`, or the current one for None; `with` makes it
    current and then gives the thread back the one before, use() makes it current."""

    def __init__(self, device=None):
        self.id = _current() if device is None else int(device)

    def use(self):
        _set_current(self.id)

    def __enter__(self):
        _threads.__dict__.setdefault("devices_before", []).append(_current())
        _set_current(self.id)
        return self

    def __exit__(self, *exc):
        _set_current(_threads.devices_before.pop())
        return False

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __int__(self):
        return self.id

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


def _arrays_in(x):
    if isinstance(x, ndarray):
        yield x
    elif isinstance(x, (tuple, list)):
        for item in x:
            yield from _arrays_in(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _arrays_in(item)


def _here(*operands):
    """Raises as cupy's kernels do (_check_peer_access) where an array among operands
    lives on another GPU than the current one (two GPUs without peer access)."""
    current = _current()
    for a in _arrays_in(operands):
        if a._device != current:
            raise ValueError(f"The device where the array resides ({a._device}) is different "
                             f"from the current device ({current}). Peer access is "
                             "unavailable between these devices.")


class ndarray:
    """A numpy array wearing a GPU array's clothes."""

    def __init__(self, host: np.ndarray, device: int | None = None):
        self.host = host
        self._device = _current() if device is None else device  # (its memory's GPU)

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
    flags = property(lambda self: _Flags(self.host.flags))
    strides = property(lambda self: self.host.strides)
    data = property(lambda self: _Pointer(self.host, self._device))
    device = property(lambda self: Device(self._device))

    def __getitem__(self, key):
        if _fancy(key):  # (a gather: a kernel)
            _here(self, key)
            return ndarray(np.asarray(self.host[_host(key)]))
        return ndarray(np.asarray(self.host[key]), self._device)  # (a view; 0-d for an item)

    def __setitem__(self, key, value):
        _here(self, key, value)
        self.host[_host(key)] = _host(value)

    def reshape(self, *shape):
        return _view_or_kernel(self, self.host.reshape(*shape))

    def copy(self):
        # cupy's copy() copies to the current GPU, from any GPU (through the source's).
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
        _here(inputs, kwargs)
        if "out" in kwargs:
            kwargs["out"] = tuple(_host(o) for o in kwargs["out"])
        return _device_array(getattr(ufunc, method)(*_operands(inputs), **_host(kwargs)))

    def __array_function__(self, func, types, args, kwargs):
        _here(args, kwargs)
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

    def astype(self, dtype, copy=True, **kwargs):
        if not copy and np.dtype(dtype) == self.dtype:
            return self  # (as cupy: no cast, no kernel)
        _here(self)
        return ndarray(self.host.astype(dtype, **kwargs))

    T = property(lambda self: ndarray(self.host.T, self._device))
    real = property(lambda self: ndarray(self.host.real, self._device))
    imag = property(lambda self: ndarray(self.host.imag, self._device))


class _Flags:
    """cupy's ndarray.flags: C_CONTIGUOUS, F_CONTIGUOUS and OWNDATA only (numpy's
    writeable, aligned and the rest are not there: code that asks a cupy array for them
    raises AttributeError, as it does on a GPU)."""

    def __init__(self, flags):
        self.c_contiguous = flags.c_contiguous
        self.f_contiguous = flags.f_contiguous
        self.owndata = flags.owndata

    def __getitem__(self, key):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[key]


def _fancy(key) -> bool:
    """Whether indexing with key gathers (arrays or lists in it) rather than views."""
    keys = key if isinstance(key, tuple) else (key,)
    return builtins.any(isinstance(k, (ndarray, np.ndarray, list)) for k in keys)  # (not ours)


def _view_or_kernel(a, result: np.ndarray):
    """numpy's result of reshaping or transposing a: a view of a on a's GPU, as cupy's
    is, or (where numpy had to copy) a kernel's result on the current GPU."""
    if result.size == 0 or np.may_share_memory(result, a.host):
        return ndarray(result, a._device)
    _here(a)
    return ndarray(result)


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
        _here(args, kwargs)
        return _device_array(function(*operands(args), **_host(kwargs)))

    on_device.__name__ = function.__name__
    return on_device


# Operators and methods: numpy's, on the host array, with results on the "GPU". The
# in-place ones write into the host array and return the same fake array.
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
              "or", "xor", "lshift", "rshift"):
    for _form in ("__{}__", "__r{}__"):
        _dunder = _form.format(_name)
        setattr(ndarray, _dunder, (lambda d: lambda self, other: _here(self, other) or
                                   _device_array(getattr(self.host, d)(_operands(other))))(
            _dunder))

    def _in_place(self, other, _dunder=f"__i{_name}__"):
        _here(self, other)
        result = getattr(self.host, _dunder)(_operands(other))
        if result is not self.host:  # (numpy writes in place, or says it cannot)
            return NotImplemented
        return self

    setattr(ndarray, f"__i{_name}__", _in_place)
for _dunder in ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__neg__",
                "__pos__", "__abs__", "__invert__"):
    setattr(ndarray, _dunder, (lambda d: lambda self, *other: _here(self, other) or
                               _device_array(getattr(self.host, d)(*_operands(other))))(
        _dunder))
ndarray.__hash__ = None  # (as cupy's and numpy's arrays: __eq__ is elementwise)
for _method in ("sum", "prod", "mean", "max", "min", "all", "any", "fill", "dot", "conj",
                "argmax", "argmin", "clip", "flatten", "std", "var", "cumsum", "nonzero",
                "round"):
    setattr(ndarray, _method, (lambda m: lambda self, *args, **kwargs: _here(
        self, args, kwargs) or _device_array(getattr(self.host, m)(*_host(args),
                                                                   **_host(kwargs))))(_method))
for _method in ("view", "squeeze", "ravel", "transpose", "swapaxes"):  # (views, mostly)
    setattr(ndarray, _method, (lambda m: lambda self, *args, **kwargs: _view_or_kernel(
        self, getattr(self.host, m)(*args, **kwargs)))(_method))

# cupy's functions that are numpy's (by name: a name real cupy lacks is not here).
# Those that make an array take numpy's too (its data, or its shape and dtype); the
# *_like ones read no data of theirs (cupy allocates and fills on the current GPU).
for _name in ("zeros_like", "ones_like", "full_like"):
    globals()[_name] = (lambda f: lambda *args, **kwargs: _device_array(
        f(*_host(args), **_host(kwargs))))(getattr(np, _name))
array = _on_device(np.array, operands=_host)  # (from a cupy array: a kernel, as astype)
for _name in ("zeros", "full", "arange",
              "linspace", "sqrt", "exp", "log", "log1p", "expm1", "tanh", "abs", "absolute",
              "sign", "maximum", "minimum", "isfinite", "isnan", "isinf", "where", "sum",
              "prod", "mean", "max", "min", "amax", "amin", "argmax", "argmin", "matmul",
              "dot", "outer", "stack", "vstack", "hstack", "split", "array_split", "clip",
              "square", "einsum", "allclose", "array_equal", "count_nonzero", "take",
              "cumsum", "diag", "eye", "logaddexp", "round", "frexp", "ldexp",
              "multiply", "add", "subtract", "divide", "negative", "copyto", "any", "all",
              "nonzero", "unique", "sort", "argsort", "float_power", "concatenate"):
    globals()[_name] = _on_device(getattr(np, _name))
for _name in ("reshape", "transpose", "ravel", "ascontiguousarray"):  # (views where they can)
    globals()[_name] = (lambda f: lambda a, *args, **kwargs: _view_or_kernel(
        a, f(a.host, *args, **kwargs)) if isinstance(a, ndarray) else _on_device(f)(
        a, *args, **kwargs))(getattr(np, _name))
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
    if isinstance(x, ndarray):  # (where it is: no copy, no kernel)
        return x if dtype is None or x.dtype == dtype else x.astype(dtype)
    return ndarray(np.asarray(x, dtype))


def asnumpy(x):
    return x.host.copy()  # (from any GPU, as get())


# (thread, current stream's ptr) of each empty(), for tests to read: which of cupy's
# pool arenas the real one would have taken the memory from.
allocations = []


def empty(shape, dtype=float):
    if getattr(get_current_stream(), "capturing", False):  # (CUDA forbids cudaMalloc then)
        raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted "
                               "when stream is capturing")
    allocations.append((threading.get_ident(), get_current_stream().ptr))
    return ndarray(np.empty(shape, dtype))


def empty_like(x, dtype=None):
    return ndarray(np.empty_like(x.host, dtype))  # (on the current GPU, as cupy's)


def ones(shape, dtype=float):
    return ndarray(np.ones(shape, dtype))


float32 = np.float32

# cupy.random's one function that docs/gpu.md's example calls (tests/test_docs.py runs it
# here), with cupy's signature: standard_normal(size=None, dtype=float).
random = types.SimpleNamespace(
    standard_normal=lambda size=None, dtype=float: ndarray(np.asarray(
        np.random.default_rng().standard_normal(size, dtype=np.dtype(dtype)))))


class _Nothing:
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


class Stream(_Nothing):
    """Does nothing, but is current as cupy's streams are: per thread and per GPU
    (`with stream:` nests, on the GPU the stream was made on, and raises cupy's
    RuntimeError where another GPU is current; get_current_stream() gives the current
    GPU's), and has cupy's two built-in handles, of no GPU in particular: `null` (ptr
    0, the legacy default stream) and `ptds` (ptr 2, which names each thread's own
    per-thread stream)."""

    def __init__(self, *args, ptr=None, device_id=None, **kwargs):
        self.ptr = id(self) if ptr is None else ptr  # (each stream a handle of its own)
        self.device_id = _current() if device_id is None else device_id
        self.capturing = False  # (set by tests, for is_capturing(): cupy's begin_capture())

    def begin_capture(self):
        self.capturing = True

    def end_capture(self):
        self.capturing = False

    def is_capturing(self):
        return self.capturing

    def __enter__(self):
        current = _current()
        if self.device_id not in (-1, current):  # (cupy's check_stream_device_match)
            raise RuntimeError(f"The device that the stream is created on ({self.device_id}) "
                               f"does not match with the current device ({current})")
        _threads.__dict__.setdefault("streams", []).append((current, self))
        return self

    def __exit__(self, *exc):
        _threads.streams.pop()
        return False


Stream.null = Stream(ptr=0, device_id=-1)
Stream.ptds = Stream(ptr=2, device_id=-1)


def get_current_stream(device_id=-1):
    """The stream entered last on GPU device_id (-1: the current GPU) in this thread."""
    device = _current() if device_id == -1 else device_id
    entered = [s for d, s in getattr(_threads, "streams", ()) if d == device]
    return entered[-1] if entered else Stream.null


# (thread, GPU) of each runtime.setDevice() call (not Device's own), for tests to read
set_devices = []


def _set_device(ordinal):
    set_devices.append((threading.get_ident(), ordinal))
    _set_current(ordinal)


cuda = types.SimpleNamespace(
    Device=Device, Event=_Nothing, Stream=Stream,
    get_current_stream=get_current_stream,
    get_elapsed_time=lambda start, stop: 1.0,  # ms; nothing is timed on the host
    runtime=types.SimpleNamespace(getDeviceCount=lambda: device_count,
                                  getDeviceProperties=lambda ordinal: {"name": b"emulated"},
                                  getDevice=_current, setDevice=_set_device,
                                  CUDARuntimeError=CUDARuntimeError),
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
