"""The one table that maps numpy dtypes and op names to the core's codes, and the
checks on arrays that every collective shares. Error messages name the argument,
the value and the rank."""
from __future__ import annotations

import importlib.util
import math
import sys

import numpy as np
from mpi4py import MPI

from . import _core

OPS = tuple(_core.OPS)  # ("sum", "prod", "min", "max", "avg"); index = core code
_OP_CODES = {name: code for code, name in enumerate(OPS)}
_DTYPE_CODES = {name: code for code, name in enumerate(_core.DTYPES)}
_COMPLEX = {"complex64", "complex128"}


class UnsupportedOpError(TypeError, ValueError):
    """An op the dtype has no meaning for (min/max of complex, avg of integers).

    It is both a TypeError (the dtype does not support it) and a ValueError (the op
    value is wrong for this call), so either ``except`` catches it.
    """


class DroppedErrorWarning(RuntimeWarning):
    """An asynchronous call failed and its Handle was dropped without ``wait()``, which
    would have raised the error: its result (``out=`` too) holds whatever it held.
    Warned after the next call on any Communicator of this process (of more than one
    rank), at a close, or at exit."""


def cuda_available() -> bool:
    """True if this build has CUDA kernels and this process sees a usable GPU."""
    return _core.cuda_built() and _core.cuda_device_count() > 0


def supported_dtypes() -> list[str]:
    """Names of the dtypes the collectives accept here (bfloat16 needs ml_dtypes: listed
    where it is installed, which is asked without importing it)."""
    bfloat16 = importlib.util.find_spec("ml_dtypes") is not None
    return [name for name in _core.DTYPES if name != "bfloat16" or bfloat16]


def where(rank: int, size: int, call: str) -> str:
    return f"ringreduce.{call} (rank {rank} of {size})"


def call_of(where_: str) -> str:
    """where()'s call, as its errors begin ("ringreduce.allreduce_gradients"), without the
    rank: what renamed() puts in front of an error that already names a rank."""
    return where_.split(" (rank ")[0]


class NamedSettings:
    """Refuses a public name that its class does not know, as it is set: a setting
    misspelt (comm.timout = 5, opt.learning_rate = 0.01) would be a new attribute that
    nothing reads, the real one left as it was, without a word. A class guarded lists
    _ATTRIBUTES itself: the public names its instances hold that are no names of the
    class (its properties, methods: a step() patched on the instance, as
    mock.patch.object does, goes through; a read-only property refuses itself).
    Private names go through, and so does anything on a subclass, which may keep
    attributes of its own. (Some 0.2 us a name set.)"""

    _SETTINGS: tuple = ()

    def __setattr__(self, name: str, value) -> None:
        if not name.startswith("_"):
            cls = type(self)
            if "_ATTRIBUTES" in cls.__dict__ and name not in cls._ATTRIBUTES and \
                    not hasattr(cls, name):
                raise AttributeError(self._no_such_setting(name))
        object.__setattr__(self, name, value)

    def _no_such_setting(self, name: str) -> str:
        cls = type(self).__name__
        return (f"ringreduce.{cls}: {cls} has no setting {name!r} (its settings are "
                f"{', '.join(self._SETTINGS)})")


# The reductions whose result may go into out= (as their errors begin).
_CALLS_WITH_OUT = {f"ringreduce.{name}{form}" for name in ("allreduce", "reduce_scatter")
                   for form in ("", "_async")}


def op_code(op, context: str, dtype_name: str | None = None) -> int:
    """op's code, for arrays of dtype_name (where mpi4py's logical and bitwise ops are
    taken: bool only; None where the dtype is not known, as for a list of arrays)."""
    key = op.lower() if isinstance(op, str) else _mpi_op_name(op, dtype_name)
    if key not in _OP_CODES:
        if getattr(op, "ndim", 0) > 0 and (hasattr(op, "__array_interface__")
                                           or hasattr(op, "__cuda_array_interface__")):
            # mpi4py's Allreduce(sendbuf, recvbuf, op), by habit
            call = call_of(context)
            if call not in _CALLS_WITH_OUT:  # (allreduce_gradients, the reference's)
                raise TypeError(f"{context}: op is an array: the second argument is op "
                                f"({call} takes no out=)")
            raise TypeError(f"{context}: op is an array: the second argument is op; pass "
                            f"the result's buffer as out=... "
                            f"(comm.{call.rpartition('.')[2]}(x, out=buf))")
        name = _mpi_predefined_name(op)
        only = ""
        if name in _MPI_BOOL_OPS:
            same = f"op={_MPI_BOOL_OPS[name]!r}"
            only = (f"; {_op_text(op)} is taken for bool arrays only (where it is {same})"
                    + (f", and x has dtype {dtype_name}" if dtype_name else
                       f", by the collectives: here, pass {same}, which on bools is the same"))
        raise ValueError(f"{context}: op {_op_text(op)} is not one of "
                         + ", ".join(repr(name) for name in OPS)
                         + " (or MPI.SUM, MPI.PROD, MPI.MIN, MPI.MAX; for bools MPI.LOR, "
                         "MPI.BOR, MPI.LAND, MPI.BAND)" + only)
    return _OP_CODES[key]


def _op_text(op) -> str:
    """An op as a message shows it: mpi4py's predefined ops by name (their repr is an
    address)."""
    name = _mpi_predefined_name(op)
    if name is not None:
        return f"MPI.{name}"
    return "(a user-defined MPI.Op)" if _is_mpi_op(op) else repr(op)


def _mpi_op_name(op, dtype_name: str | None):
    """Also accept mpi4py's MPI.SUM, MPI.PROD, MPI.MIN and MPI.MAX; and for bools its
    logical and bitwise ors and ands, as the ops that compute them there."""
    key = _mpi_op_key(op)  # (the op as callers pass it: found without comparing)
    name = key.name if key is not None else _mpi_predefined_name(op)
    if name in ("SUM", "PROD", "MIN", "MAX"):
        return name.lower()
    return _MPI_BOOL_OPS.get(name) if dtype_name == "bool" else None


# On bools (each 0 or 1 once read), an or is a max and an and a min; on other dtypes
# these ops are not those (3 | 4 is 7), and there is no kernel for them.
_MPI_BOOL_OPS = {"LOR": "max", "BOR": "max", "LAND": "min", "BAND": "min"}


class _MpiOpKey:
    """What stands for one of mpi4py's predefined ops in validated_pairs: an MPI.Op
    cannot be a dict key (mpi4py makes it unhashable), and a string would be one that a
    caller could pass as the op."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<validated_pairs' key of MPI.{self.name}>"


# ((MPI.SUM, its key), ...) for each of mpi4py's ops that ringreduce takes for some
# dtype: the op as the caller passes it, the one object mpi4py has for it (an equal Op
# made otherwise is not found, and takes the general path). Made once, at import (made
# at first use, two threads could each make keys of their own, and the FastPath would
# then look up one thread's where the other's were stored).
MPI_OP_KEYS = tuple((getattr(MPI, name), _MpiOpKey(name))
                    for name in ("SUM", "PROD", "MIN", "MAX", *_MPI_BOOL_OPS))


def _mpi_op_key(op):
    for mpi_op, key in MPI_OP_KEYS:
        if op is mpi_op:
            return key
    return None


# mpi4py's predefined ops, the ones ringreduce accepts first; and OP_NULL, which is no
# op at all (a user-defined Op once freed is one), not a user-defined one.
_MPI_OP_NAMES = ("SUM", "PROD", "MIN", "MAX", "LAND", "BAND", "LOR", "BOR", "LXOR", "BXOR",
                 "MAXLOC", "MINLOC", "REPLACE", "NO_OP", "OP_NULL")


def _is_mpi_op(op) -> bool:
    return isinstance(op, MPI.Op)


def _mpi_predefined_name(op):
    """"SUM" for MPI.SUM, and so on; None for anything else."""
    if not _is_mpi_op(op):
        return None
    for name in _MPI_OP_NAMES:
        if op == getattr(MPI, name, None):
            return name
    return None


# Native dtype -> its code: the table the fast path (the core's FastPath) looks dtypes
# up in too. A non-native dtype never compares equal to these, so it is not found.
# bfloat16 joins it with the first such array (see _learn_bfloat16).
dtype_codes = {np.dtype(name): code for name, code in _DTYPE_CODES.items()
               if name != "bfloat16"}


def _learn_bfloat16(dtype: np.dtype):
    """bfloat16's code if dtype is ml_dtypes' (native) bfloat16, which it then adds to
    dtype_codes; else None. ml_dtypes is imported here, not with ringreduce: its import
    takes most of a second (0.75 s with numpy 2.4, registering its dozen dtypes with
    numpy), on every rank, and whoever holds a bfloat16 array has paid it already."""
    if dtype.name != "bfloat16":
        return None
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - a bfloat16 from elsewhere
        return None
    if dtype != np.dtype(ml_dtypes.bfloat16):
        return None
    dtype_codes[dtype] = code = _DTYPE_CODES["bfloat16"]
    return code


_SHAPE_DIM_BITS = 20  # the tag's layout: see CallHeader::shape_tag in ring_communicator.h
_SHAPE_HASHED = 7


def shape_tag(row_shape: tuple) -> int:
    """allgather's row shape as the int64 the header carries (the element count alone
    would let (2, 3) rows meet (3, 2) rows): the shape itself, so that a mismatch
    message can show it, where it fits (up to 3 dimensions, each below 2**20); else
    a hash of it."""
    if len(row_shape) <= 3 and all(d < 1 << _SHAPE_DIM_BITS for d in row_shape):
        tag = len(row_shape) << 60
        for i, d in enumerate(row_shape):
            tag |= d << (_SHAPE_DIM_BITS * i)
        return tag
    return (_SHAPE_HASHED << 60) | (hash(row_shape) & ((1 << 60) - 1))


def dtype_code(dtype: np.dtype, argument: str, context: str) -> int:
    # A dict lookup: comparing dtypes with == costs microseconds per call.
    code = dtype_codes.get(dtype)
    if code is None:
        code = _learn_bfloat16(dtype)
    if code is None:
        raise TypeError(f"{context}: {argument} has dtype {dtype}, which is not supported; "
                        f"supported dtypes: {', '.join(supported_dtypes())}")
    return code


def check_op_for_dtype(op: int, dtype_code: int, context: str) -> None:
    name = _core.DTYPES[dtype_code]
    if not _core.op_supported(dtype_code, op):
        why = ("complex numbers have no order" if name in _COMPLEX
               else "a bool has no average; op='max' is True where any rank's is, "
               "op='min' where every rank's is, and a count of the ranks needs an "
               "integer dtype (x.astype(np.int32), op='sum')" if name == "bool"
               else "an integer average would have to round; use op='sum' and divide")
        raise UnsupportedOpError(f"{context}: op {OPS[op]!r} is not supported for dtype "
                                 f"{name} ({why})")


# native dtype -> {op string, or an MPI op's key (see MPI_OP_KEYS) -> (dtype code, op
# code)}, once valid: what the fast path (the core's FastPath) takes without further
# checks. Two lookups, not one keyed by (dtype, op): a tuple made for every call cost
# more than the second lookup.
validated_pairs: dict = {}


def reduction_codes(dtype: np.dtype, op, context: str, argument: str = "x") -> tuple[int, int]:
    """(dtype code, op code) for a reduction of `dtype` by `op`, or a clear error (naming
    `argument`, the array of that dtype)."""
    key = op if isinstance(op, str) else _mpi_op_key(op)
    try:
        return validated_pairs[dtype][key]
    except KeyError:
        pass
    code = dtype_code(dtype, argument, context)
    codes = code, op_code(op, context, _core.DTYPES[code])
    check_op_for_dtype(codes[1], codes[0], context)
    if key is not None:
        validated_pairs.setdefault(dtype, {})[key] = codes
    return codes


def as_input_array(x, argument: str, context: str) -> np.ndarray:
    """x as a numpy array, x itself if it is one (of any byte order and layout: see
    readable() and native())."""
    if type(x) is np.ndarray:  # the common case, kept cheap
        return x
    if x is None:  # (np.asarray makes an array of one object of it: "dtype object")
        raise TypeError(f"{context}: {argument} is None: give an array (numpy, a GPU "
                        "array, or what np.asarray takes)")
    reject_masked(x, argument, context)
    if hasattr(x, "__cuda_array_interface__") and not isinstance(x, np.ndarray):
        # The collectives send GPU arrays to ringreduce._device first; this is for
        # callers that need host memory.
        raise TypeError(f"{context}: {argument} is a GPU array ({type(x).__name__}); "
                        "a host (numpy) array is needed here")
    reject_mpi_buffer_forms(x, argument, context)
    try:
        array = np.asarray(x)
    except Exception as error:  # e.g. ragged nested lists
        raise TypeError(f"{context}: {argument} cannot be read as an array: {error}"
                        + torch_bfloat16_hint(x)) from None
    return array


def _of_torch(x) -> bool:
    """Whether x is an object of torch's (a tensor, a Parameter), without importing it:
    of a class of torch's, or derived from one (torchvision's tv_tensors, a model's own
    Parameter subclass). A class's __module__ may be anything, None too. (Asked only
    on the way to an error.)"""
    return any(str(getattr(c, "__module__", "")).partition(".")[0] == "torch"
               for c in type(x).__mro__)


def torch_bfloat16_hint(x) -> str:
    # numpy has no bfloat16 of its own, so torch will not make a numpy array of one;
    # ml_dtypes' is the one ringreduce reduces, over the tensor's own bits.
    if _of_torch(x) and str(getattr(x, "dtype", "")) == "torch.bfloat16":
        return ("; a bfloat16 tensor on the CPU reads as ml_dtypes' bfloat16, over its own "
                "memory: t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)")
    return ""


def reject_mpi_buffer_forms(x, argument: str, context: str) -> None:
    """What a program ported from mpi4py's Allreduce and co. passes, which numpy would
    read as something else: MPI.IN_PLACE and MPI.BOTTOM as empty arrays (a result of
    no elements, silently), a buffer spec [buf, MPI.FLOAT] as a ragged list."""
    if x is MPI.IN_PLACE or x is MPI.BOTTOM:
        name = "MPI.IN_PLACE" if x is MPI.IN_PLACE else "MPI.BOTTOM"
        raise TypeError(f"{context}: {argument} is {name}, which ringreduce does not take: "
                        f"for a call in place {_in_place(call_of(context))}")
    # (A spec is [buf, type], [buf, count, type] or [buf, (count, displ), type], its type
    # last: MPI.FLOAT or a typecode; a list of numbers is not scanned.)
    if (isinstance(x, (list, tuple)) and 2 <= len(x) <= 4
            and isinstance(x[-1], (MPI.Datatype, str))):
        raise TypeError(f"{context}: {argument} is an mpi4py buffer spec ([buf, MPI.FLOAT], "
                        "say), which ringreduce does not take: pass the array itself (or "
                        "buf[:count]); its dtype says what the elements are")


def _in_place(call: str) -> str:
    """How `call` ("ringreduce.reduce_scatter_async") is made in place: each collective
    has its own way (told allreduce's, reduce_scatter(buf, out=buf) raised again, out
    being the block's shape)."""
    name = call.rpartition(".")[2]
    if name.startswith("reduce_scatter"):
        return ("pass the buffer as x and this rank's block of it as out "
                f"(comm.{name}(buf, out=buf[lo:hi]), lo, hi = "
                "ringreduce.reference.segment_bounds(buf.size, comm.size)[comm.rank])")
    if name.startswith("allgather"):
        return (f"pass out's own block of rows as x (comm.{name}(buf[lo:hi], out=buf), "
                "lo, hi: the rows of this rank, after the ranks before it)")
    return f"pass the buffer as both x and out (comm.{name}(buf, out=buf))"


def named(error: MemoryError, context: str) -> MemoryError:
    """numpy's own MemoryError ("Unable to allocate 32.0 TiB for an array ...") with the
    call and the rank in front, as every other error of a call has them; any other kind
    (cupy's OutOfMemoryError, one that names them already) as it is. (numpy raises its
    own subclass, _ArrayMemoryError, whose constructor takes a shape and a dtype: the
    error made here is a plain MemoryError.)"""
    numpys = type(error) is MemoryError or type(error).__module__.startswith("numpy")
    if not numpys or str(error).startswith(context):
        return error
    return MemoryError(f"{context}: {error}").with_traceback(error.__traceback__)


def told_in_vain(own: Exception, timeout: Exception) -> Exception:
    """own: this rank's error (it rejected its arguments, or failed to prepare a
    call), raised once it has told the other ranks so, where telling them timed out
    (they did not come to that exchange): still what this rank can mend, rather than
    the timeout, which it notes (after it, the Communicator can no longer be used)."""
    if hasattr(own, "add_note"):  # (Python 3.11)
        own.add_note(f"(Then telling the other ranks so timed out: {timeout})")
    return own


def renamed(error: Exception, ran: str | None, called: str) -> Exception:
    """error, whose message begins with `ran` ("ringreduce.allreduce", the collective
    the core ran), as an error of the same kind (and attributes) that begins with
    `called` (the call the caller made, "ringreduce.allreduce_async") instead; any other
    as it is."""
    message = str(error)
    if ran is None or ran == called or not message.startswith(ran) \
            or message[len(ran):len(ran) + 1] not in (" ", ":"):
        return error
    try:
        again = type(error)(called + message[len(ran):])
    except Exception:  # (a kind whose constructor takes more than a message)
        return error
    again.__dict__.update(error.__dict__)  # (CheckedCallsMismatch's checks)
    return again.with_traceback(error.__traceback__)


def native(dtype: np.dtype) -> np.dtype:
    """dtype in this machine's byte order: what the core computes in, and results are."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def readable(array: np.ndarray) -> bool:
    """Whether the core can read array as it is (else it reads readable_copy(array))."""
    return array.dtype.isnative and array.flags.c_contiguous


def readable_copy(array: np.ndarray) -> np.ndarray:
    """A copy of array in C order and native byte order, shaped like it."""
    return np.array(array, dtype=native(array.dtype), order="C")


def reject_not_an_array(x, argument: str, context: str, why: str) -> None:
    """Refuses what is not an array that can be updated in place; why: what would be
    done to it ("gradients are reduced in place", say)."""
    if isinstance(x, np.generic):  # (it has a shape and a dtype, but is immutable)
        raise TypeError(f"{context}: {argument} is a numpy scalar ({type(x).__name__}), "
                        f"but {why}; pass a 0-d array (np.array(value))")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{context}: {argument} is a {type(x).__name__}, not an array")
    reject_foreign_array(x, argument, context, why)


def reject_foreign_array(x, argument: str, context: str, why: str) -> None:
    """Refuses another library's array on the host (a torch tensor, say) where it would
    be written into, or read as a parameter's gradient: it has a shape and a dtype, but
    neither numpy's memory nor a GPU pointer, and its dtype may not be numpy's (a
    torch.float32 never equals np.float32)."""
    if isinstance(x, (np.ndarray, np.generic)) or hasattr(x, "__cuda_array_interface__"):
        return
    raise TypeError(f"{context}: {argument} is a {qualified_type_name(x)}, not a numpy "
                    f"array or a GPU array, and {why}" + foreign_array_hint(x))


def qualified_type_name(x) -> str:
    # The whole module, as Python's repr of the class has it: torch.nn.Parameter's
    # module is torch.nn.parameter, and its package with its name alone said
    # "torch.Parameter", a class torch does not have.
    module = type(x).__module__
    name = type(x).__qualname__
    return name if module in ("builtins", "numpy") else f"{module}.{name}"


def foreign_array_hint(x) -> str:
    """How to pass an array of another library that ringreduce is to write into."""
    if _of_torch(x) and hasattr(x, "numpy"):
        return torch_bfloat16_hint(x) or (
            "; a tensor on the CPU has a numpy array over its own memory, to pass "
            "instead: t.numpy() (t.detach().numpy() where it requires grad)")
    return ""


def masked(x) -> bool:
    """Whether x is a numpy masked array with elements masked. numpy imports numpy.ma
    at its first use (np.ma), which cost a rank's first call with out= (or its
    optimizer's first step) 6 ms, 30 where numpy's bytecode is not cached; before
    something imports it, no masked array exists to look for."""
    ma = sys.modules.get("numpy.ma")
    return ma is not None and isinstance(x, ma.MaskedArray) and ma.is_masked(x)


def reject_masked(x, argument: str, context: str) -> None:
    # Only the data would travel, masked elements included: a wrong answer, silently.
    # (A masked array with nothing masked, as some readers return, is just its data.)
    if masked(x):
        raise TypeError(f"{context}: {argument} is a masked array with masked elements, but "
                        "the mask cannot take part; "
                        f"pass {argument}.filled(value) with the value masked elements "
                        "should count as (0 for a sum), or its .data")


def check_root(root, size: int, context: str) -> None:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"{context}: root must be an int, got {type(root).__name__}")
    if not 0 <= root < size:
        raise ValueError(f"{context}: root {root} is not a rank of this communicator "
                         f"(0..{size - 1})")


def check_out(out, shape: tuple, dtype: np.dtype, context: str, array_type=np.ndarray,
              type_name: str = "numpy.ndarray"):
    """out= for a result of this shape and dtype (a cupy one: array_type=cupy.ndarray).
    A shape of (None,) + row_shape takes any number of rows (allgather's, whose rows
    are known only later)."""
    if not isinstance(out, array_type):
        reject_mpi_buffer_forms(out, "out", context)
        raise TypeError(f"{context}: out must be a {type_name}, got "
                        f"{qualified_type_name(out)}" + foreign_array_hint(out))
    if masked(out):
        # Its data would be written, and the mask kept: results hidden where it masks.
        raise TypeError(f"{context}: out is a masked array with masked elements, under "
                        "which the result would stay hidden; pass out.data, or unmask it "
                        "first (out.mask = False)")
    if out.dtype != dtype and out.dtype == dtype.newbyteorder("S"):
        raise TypeError(f"{context}: out has non-native byte order ({out.dtype}); the result "
                        f"is written in native order, so pass out of dtype {dtype}")
    if out.dtype != dtype:
        raise TypeError(f"{context}: out has dtype {out.dtype}, expected {dtype} (the dtype of x)")
    shape = tuple(shape)
    if shape[:1] == (None,):
        if out.ndim != len(shape) or tuple(out.shape[1:]) != shape[1:]:
            # (mpi4py's Allgather fills a (size, n) buffer from 1-D arrays.)
            rows_of = ("; for a (ranks, n) result from 1-D x, gather x[np.newaxis]"
                       if not shape[1:] and out.ndim == 2 else "")
            raise ValueError(f"{context}: out has shape {out.shape}; the result has rows of "
                             f"shape {shape[1:]}, so out must have shape (rows,) + {shape[1:]}"
                             + rows_of)
    elif out.shape != shape:
        same_size = (f"; of as many elements, out.reshape({shape}) is a view that takes it"
                     if out.size == math.prod(shape) and out.flags.c_contiguous else "")
        raise ValueError(f"{context}: out has shape {out.shape}, expected {shape}{same_size}")
    if not out.flags.c_contiguous:
        # (A Fortran array in place: mpi4py's Allreduce(MPI.IN_PLACE, a) takes it.)
        in_place = ("; to reduce a Fortran-ordered array in place, pass its transpose, "
                    "which is C-contiguous, as x and out (a.T)"
                    if out.flags.f_contiguous and len(shape) > 1 and shape[:1] != (None,)
                    else "")
        raise ValueError(f"{context}: out is not C-contiguous (strides {out.strides}); "
                         f"pass a contiguous array or out=None{in_place}")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError(f"{context}: out is read-only")
    return out


def same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    """True if a and b are exactly the same bytes (in-place use)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.nbytes == b.nbytes)
