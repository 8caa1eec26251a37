"""Optimizers for plain numpy or cupy models, and DistributedOptimizer, which keeps
the replicas on every rank identical by averaging gradients with the ring (on the GPU
for cupy gradients).

    opt = DistributedOptimizer(SGD(params, lr=0.1, momentum=0.9))
    opt.broadcast_parameters(root=0)   # every rank starts from rank 0's parameters
    opt.step(grads)                    # average grads across ranks, then update params

Parameters are updated in place. Gradients are packed into flat buckets of about
``bucket_mb`` MiB, last parameter first (the order backward produces them); each bucket
is all-reduced asynchronously as soon as it and the buckets before it are complete, so
with ``grad_ready`` the communication overlaps the rest of the backward pass.
"""
from __future__ import annotations

import contextlib
import decimal
import functools
import heapq
import itertools
import math
import operator
import time
import zlib

import numpy as np

from . import _types, compression as _compression
from ._arrays import (array_module, as_list_of_arrays, copy_where_it_is, gpu_of, on_gpu,
                      on_gpu_of, plain, the_one_gpu)
from ._core import CollectiveTimeoutError, MismatchError, copy_gradient, numpy_layout, \
    pack_gradients
from .communicator import Communicator
from .gradients import agree_or_raise, check_bucket_mb, pack_plan, span_of


def _check_params(params, who: str) -> list:
    # (One array is refused, as torch.optim refuses one tensor.)
    params = as_list_of_arrays(params, "params", who, "the parameters")
    if not params:
        raise ValueError(f"{who}: params is empty")
    for i, p in enumerate(params):
        _types.reject_not_an_array(p, f"params[{i}]", who, "steps update parameters in place")
        if p.dtype.kind != "f" and p.dtype.name != "bfloat16":
            raise TypeError(f"{who}: params[{i}] has dtype {p.dtype}; parameters must be floats")
        if not getattr(getattr(p, "flags", None), "writeable", True):  # (cupy's always are)
            raise ValueError(f"{who}: params[{i}] is read-only; steps update parameters in "
                             "place")
    _check_params_apart(params, who)
    return params


# Pairs of parameters whose spans overlap that are compared element by element: past
# it (thousands of interleaved views of one matrix, each pair spanning the others),
# only the cheap tests are made (one array twice, the same view twice, contiguous
# arrays whose spans overlap), rather than construction taking seconds.
_EXACT_COMPARISONS = 20_000


def _check_params_apart(params: list, who: str) -> None:
    """Raises where two parameters share memory (one array listed twice, overlapping
    views): each step would update those bytes twice, with both gradients, silently.
    (A sweep over the bytes they span: each pair whose spans overlap is then compared
    exactly, as two views may interleave without sharing a byte.)"""
    bounds = [span_of(p) for p in params]
    spans = sorted((span, i) for i, span in enumerate(bounds)
                   if span is not None and span[1] > span[0])
    active: list = []  # (end, index) of the spans before that may reach further
    compared = 0
    for (lo, hi), i in spans:
        while active and active[0][0] <= lo:
            heapq.heappop(active)
        for _, j in active:
            a, b = params[min(i, j)], params[max(i, j)]
            compared += 1
            if compared > _EXACT_COMPARISONS:  # (the cheap tests only: the same view)
                shared = _both_contiguous(a, b) or (
                    bounds[i] == bounds[j] and a.shape == b.shape
                    and getattr(a, "strides", None) == getattr(b, "strides", None))
            else:
                shared = _share_memory(a, b)
            if a is not b and not shared:
                continue
            raise ValueError(f"{who}: params[{min(i, j)}] and params[{max(i, j)}] "
                             f"{'are the same array' if a is b else 'share memory'}: each "
                             "step would update the values they share twice; list every "
                             "parameter once (tied weights are one parameter, whose "
                             "gradient adds up the uses)")
        heapq.heappush(active, (hi, i))


_TOO_HARD = getattr(np, "exceptions", np).TooHardError  # (numpy 1.25 moved it)


def _both_contiguous(a, b) -> bool:
    """Both C-contiguous: their spans are their elements, so overlapping spans share."""
    return all(getattr(getattr(p, "flags", None), "c_contiguous", False) for p in (a, b))


def _share_memory(a, b) -> bool:
    """Whether two arrays whose spans overlap share an element: numpy's exact answer
    (or, where that is too hard to find, yes), cupy's where it has one, else whether
    both are contiguous."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        try:
            return bool(np.shares_memory(a, b, max_work=10_000))
        except _TOO_HARD:
            return True
    xp = array_module(a)
    if xp is not np and xp is array_module(b) and hasattr(xp, "shares_memory"):
        return bool(xp.shares_memory(a, b))
    return _both_contiguous(a, b)


def _check_grads(grads, params, who: str) -> list:
    return _checked_grads_and_layout(grads, params, who)[0]


def _checked_grads_and_layout(grads, params, who: str) -> tuple[list, bytes | None]:
    """_check_grads(grads, params, who), and the parameters' numpy_layout() where the
    gradients' is the same (each a plain writeable numpy array with its parameter's
    exact dtype and shape: SGD's and Adam's steps then take a short way), else None."""
    grads = as_list_of_arrays(grads, "grads", who, "one gradient per parameter")
    if len(grads) != len(params):
        raise ValueError(f"{who}: got {len(grads)} gradients for {len(params)} parameters")
    # The usual case at once: plain numpy gradients with the parameters' shapes and
    # dtypes, whose layouts (numpy_layout: each array's dtype and shape, None unless
    # each is a plain writeable numpy array) are the same bytes, pass every test of
    # _check_grad (none is None, foreign, masked or on a GPU). Looking at each in
    # Python took some 0.5 us a gradient, and a step checks its gradients more than
    # once (DistributedOptimizer's step(), then the wrapped optimizer's): a quarter of
    # a step of 200 small parameters on one rank. Anything else is looked at one by
    # one, to be refused with its reason.
    layout = numpy_layout(grads)
    if layout is not None and layout == numpy_layout(params):
        return grads, layout
    return [_check_grad(i, g, p, who) for i, (g, p) in enumerate(zip(grads, params))], None


# What errors about a missing gradient advise: every rank reduces every parameter's
# gradient at every step, and zeros still move a parameter that has momentum or
# weight decay (torch skips one whose grad is None).
_NO_GRADIENT = ("for a parameter this rank's batch did not use, give zeros; one that "
                "no rank trains (frozen) belongs outside the optimizer's params")


def _check_grad(i, g, p, who):
    """g, checked to be params[i]'s gradient: the array to use, a plain view of a numpy
    subclass's data (a masked array with nothing masked, np.matrix, np.memmap). Kept a
    masked array, numpy.ma computed lr * g in float64 (its scalars are 0-d float64
    arrays): plain SGD and Adam updated apart from the same gradient as an ndarray,
    SGD kept a MaskedArray momentum buffer, and PowerSGD's products raised."""
    if type(g) is np.ndarray:  # (grad_ready's usual case, once a gradient)
        # A plain numpy array is no None, no foreign or masked array, and on no GPU:
        # only its shape and dtype can be wrong.
        if g.shape == p.shape and g.dtype == p.dtype:
            return g
    elif g is None:
        raise TypeError(f"{who}: grads[{i}] is None: every parameter's gradient is "
                        f"reduced at every step ({_NO_GRADIENT})")
    if not hasattr(g, "shape") or not hasattr(g, "dtype"):
        raise TypeError(f"{who}: grads[{i}] is a {type(g).__name__}, not an array")
    # (A torch tensor would be refused below for its dtype, torch.float32 being no
    # float32 of numpy's: a confusing reason.)
    _types.reject_foreign_array(g, f"grads[{i}]", who, "a step takes those")
    _types.reject_masked(g, f"grads[{i}]", who)  # (its data would be reduced, masked or not)
    if g.shape != p.shape:
        raise ValueError(f"{who}: grads[{i}] has shape {g.shape}, but "
                         f"params[{i}] has shape {p.shape}")
    if g.dtype != p.dtype:
        raise TypeError(f"{who}: grads[{i}] has dtype {g.dtype}, but params[{i}] has "
                        f"dtype {p.dtype}")
    # (cupy would refuse it, or read it across the bus, or it would be packed into a
    # bucket on another GPU than its own)
    gpu = gpu_of(p)
    if gpu is not None and gpu_of(g) not in (None, gpu):
        raise ValueError(f"{who}: grads[{i}] is on GPU {gpu_of(g)}, but params[{i}] is on "
                         f"GPU {gpu}; give each gradient on its parameter's GPU")
    return plain(g)


def _on_the_side_of(a, p, copy: bool = False):
    """a where p is: on the host for a numpy p (a state saved from a model on a GPU,
    loaded into one on the CPU), else p's array module's own (as torch's
    load_state_dict moves a state to its parameter's device). copy: an array of its
    own, sharing no memory with a (a move between host and GPU is one already; one from
    another array type may not be: np.asarray of an array-like can be a view of it)."""
    if isinstance(p, np.ndarray):
        if isinstance(a, np.ndarray):
            return plain(a.copy() if copy else a)
        get = getattr(a, "get", None)  # (cupy's copy to the host; np.asarray refuses one)
        if hasattr(a, "__cuda_array_interface__") and callable(get):
            return get()
        return np.array(a) if copy else np.asarray(a)
    xp = array_module(p)
    with on_gpu_of(p):  # (cupy's copies go to the current GPU)
        if array_module(a) is xp:
            # A state saved on another GPU comes to p's (cupy's copy() reads any GPU).
            return a.copy() if copy or gpu_of(a) != gpu_of(p) else a
        return xp.array(a) if copy else xp.asarray(a)  # (host to GPU: one copy either way)


def _checked_state_arrays(state, key: str, params, who: str, optional=False,
                          named: str = "state", where: str | None = None,
                          kept_as=None) -> list:
    """state[key]: one array per parameter, shaped and typed like it (None allowed where
    optional), or a clear error before anything is loaded; each a copy of its own
    where its parameter is (host or GPU), whichever it was saved from. The copies are
    made here, with the checks: one that fails (out of memory) fails the check, before
    DistributedOptimizer's ranks agree to load, not on one rank after the others have
    loaded. `named`: what errors call `state` (a part of a larger state, say); `where`:
    what they begin with (DistributedOptimizer's, naming the rank), else who's
    load_state_dict. `kept_as(p)`: the dtype the arrays are kept in where it is not
    p's (Adam's float32 moments of 16-bit parameters); one in p's dtype is taken too,
    and converted."""
    where = where or f"{who}.load_state_dict"
    if not isinstance(state, dict) or key not in state:
        raise KeyError(f"{where}: the state has no {key!r} ({_what_it_holds(state)}is it "
                       f"{_a(who)} state_dict()?)")
    if not isinstance(state[key], (list, tuple, np.ndarray)):
        raise ValueError(f"{where}: {named}[{key!r}] is a {type(state[key]).__name__}, not a "
                         "list of one array per parameter (is it a state_dict() of this "
                         "optimizer?)")
    arrays = list(state[key])
    if len(arrays) != len(params):
        raise ValueError(f"{where}: {named}[{key!r}] holds {len(arrays)} arrays, not one "
                         f"array per parameter of {len(params)} (a state of another model?)")
    kept = [p.dtype if kept_as is None else np.dtype(kept_as(p)) for p in params]
    for i, (a, p) in enumerate(zip(arrays, params)):
        if a is None and optional:
            continue
        if getattr(a, "shape", None) != p.shape or \
                getattr(a, "dtype", None) not in (p.dtype, kept[i]):
            also = "" if kept[i] == p.dtype else f" (kept as {kept[i]})"
            # Of the right shape, only the dtype differs: more likely this model saved
            # in another precision (float64 while prototyping, float32 now) than another
            # model, and the way out is to convert, which is not done here unasked.
            hint = "a state of another model?" if getattr(a, "shape", None) != p.shape \
                else (f"a state of another model, or of this one with {a.dtype} "
                      f"parameters? To load it into these, convert {named}[{key!r}]'s "
                      f"arrays to {kept[i]}")
            raise ValueError(f"{where}: {named}[{key!r}][{i}] is "
                             f"{getattr(a, 'shape', type(a).__name__)} "
                             f"{getattr(a, 'dtype', '')}, but params[{i}] is {p.shape} "
                             f"{p.dtype}{also} ({hint})")
    return [None if a is None else _placed(a, p, dtype)
            for a, p, dtype in zip(arrays, params, kept)]


def _placed(a, p, dtype):
    """A copy of a where p is (see _on_the_side_of), in dtype."""
    with on_gpu_of(p):
        return _on_the_side_of(a, p, copy=a.dtype == dtype).astype(dtype, copy=False)


def _state_values(state, keys, who: str, where: str | None = None) -> list:
    """state[key] for each key, or a clear error before anything is loaded (`where`: as
    in _checked_state_arrays)."""
    missing = [key for key in keys if key not in state]
    if missing:
        raise KeyError(f"{where or f'{who}.load_state_dict'}: the state has no "
                       f"{', '.join(map(repr, missing))} ({_what_it_holds(state)}is it "
                       f"{_a(who)} state_dict()?)")
    return [state[key] for key in keys]


def _a(name: str) -> str:
    """'an Adam', 'a SGD' (as said: "a S-G-D")"""
    return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"


def _what_it_holds(state) -> str:
    """What a state that lacks a key holds instead, for its error: another optimizer's
    (Adam's 'm' and 'v' where SGD's 'momentum_buffers' was looked for) tells itself."""
    if not isinstance(state, dict):
        return f"it is a {type(state).__name__}: "
    keys = [repr(k) for k in state]
    shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    return f"it holds {shown}: " if keys else "it is empty: "


def _check_sgd_settings(lr, momentum, weight_decay, who: str) -> None:
    try:  # (written so that NaN fails too; and a string, which does not compare)
        good = bool(lr >= 0 and momentum >= 0 and weight_decay >= 0
                    and math.isfinite(lr + momentum + weight_decay))
    except (TypeError, ValueError):  # (ValueError: an array of several)
        good = False
    if not good:
        raise ValueError(f"{who}: need lr >= 0, momentum >= 0, weight_decay >= 0, all finite; got "
                         f"lr={lr!r}, momentum={momentum!r}, weight_decay={weight_decay!r}")


def _check_adam_settings(lr, betas, eps, weight_decay, who: str) -> None:
    try:
        good = bool(len(betas) == 2 and lr >= 0 and 0 <= betas[0] < 1 and 0 <= betas[1] < 1
                    and eps > 0 and weight_decay >= 0 and math.isfinite(lr + eps + weight_decay))
    except (TypeError, ValueError):  # (ValueError: an array of several)
        good = False
    if not good:
        raise ValueError(f"{who}: need lr >= 0, betas a pair with 0 <= each < 1, eps > 0, "
                         f"weight_decay >= 0, all finite; got lr={lr!r}, betas={betas!r}, "
                         f"eps={eps!r}, weight_decay={weight_decay!r}")


_SETTING_NAMES = ("lr", "momentum", "betas", "eps", "weight_decay")


class _CheckedSettings(_types.NamedSettings):
    """SGD's and Adam's: a setting set by hand (a schedule's opt.lr = ...) is checked as
    it is set, as the constructor checks it, so that a negative, NaN or infinite one
    raises on that line, not at the next step (whose all-reduces had run by then, under
    a DistributedOptimizer), nor, where one rank alone set it, as the ranks' settings
    differing."""

    def __setattr__(self, name: str, value) -> None:
        # (Not while the constructor sets them, one at a time: it checked them first.)
        if name in self._SETTINGS and all(n in self.__dict__ for n in self._SETTINGS):
            settings = [value if n == name else getattr(self, n) for n in self._SETTINGS]
            self._check_settings(*settings, f"{type(self).__name__}: setting {name}")
        super().__setattr__(name, value)


def _setting(value):
    """A setting as ranks compare it: a float (a tuple of floats for betas), None where
    the optimizer has none, "?" where it is no number (a schedule object, say: not
    compared)."""
    try:
        if isinstance(value, (tuple, list)) or (isinstance(value, np.ndarray) and
                                                 value.ndim == 1 and value.size <= 16):
            return tuple(float(v) for v in value)
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return "?"


def _optimizer_settings(optimizer, loading: dict | None = None) -> str:
    """The wrapped optimizer's type and settings, which every rank must share (or the
    replicas drift apart), as text that is the same on every rank that has the same;
    those in `loading` (a state about to be loaded) in place of its own."""
    settings = [type(optimizer).__qualname__]
    for name in _SETTING_NAMES:
        value = loading[name] if loading and name in loading else getattr(optimizer, name, None)
        settings.append((name, _setting(value)))
    return repr(settings)


def _kind(value):
    """What kind of number a setting is, as an int that every process gives alike: the
    number of its dtype where it has one (a numpy scalar, a 0-d array of numpy or cupy,
    which numpy 2 computes with as its dtype too), else 0 (a tuple's or list's: each
    item's)."""
    if isinstance(value, (tuple, list)):
        return tuple([_kind(v) for v in value])
    dtype = getattr(value, "dtype", None)
    return 1000 + dtype.num if isinstance(dtype, np.dtype) else 0


# What a step's all-reduces carry below the check's kind (_step_fingerprint): a bit that
# says it is a step's, a CRC of the optimizer's identity and every setting (27 bits),
# and 4 bits of each of _STEP_FIELDS (the optimizer's index on the communicator, then a
# CRC of each setting), so that where the ranks' differ, each can name what differs
# (_fingerprints_apart): which optimizer, and which settings.
_STEP_FIELDS = ("optimizer",) + _SETTING_NAMES + ("t",)
_STEP_BIT = 1 << 55
_FIELD_BITS = 4 * len(_STEP_FIELDS)


def _step_texts(optimizer) -> list[str]:
    """Each setting of _SETTING_NAMES as _optimizer_settings() writes it, and Adam's step
    count ("t", "" for another optimizer), which ranks that loaded a state on rank 0
    alone and forgot broadcast_parameters() hold apart: text that is the same in every
    process that holds the same, where Python's own hash is not for a NaN, None or a
    string, and puts -1.0 with -2.0. SGD and Adam compute with float() of their
    settings; another optimizer may not, and numpy 2 computes lr * g in float64 for an
    np.float64 lr and float32 g, in float32 for a Python float: its settings' kinds of
    number count too."""
    custom = type(optimizer).step not in (SGD.step, Adam.step)
    texts = []
    for name in _SETTING_NAMES:
        value = getattr(optimizer, name, None)
        texts.append(repr((_setting(value), _kind(value)) if custom else _setting(value)))
    return texts + [str(optimizer.t) if isinstance(optimizer, Adam) else ""]


def _step_fingerprint(identity: int, index: int, optimizer) -> int:
    """What a step's all-reduces carry (56 bits, see _STEP_FIELDS): which optimizer
    (identity, and its index among those made on the communicator, whose 4 bits differ
    for any two of the first 16, where two identities' own might not) and its settings
    now."""
    texts = [str(identity), type(optimizer).__qualname__] + _step_texts(optimizer)
    whole = zlib.crc32("\0".join(texts).encode()) & ((1 << 27) - 1)
    fields = [index & 0xF] + [zlib.crc32(text.encode()) & 0xF for text in texts[2:]]
    return _STEP_BIT | (whole << _FIELD_BITS) | sum(f << (4 * i) for i, f in enumerate(fields))


def _fingerprints_apart(fingerprints: list[int], optimizer) -> str:
    """What differs between the ranks' _step_fingerprint()s (by rank), as words ("the
    ranks' optimizer settings differ: lr on rank 1 differs from rank 0's (this rank's:
    lr=0.1); set ..."); "" where they agree, or where some rank's is none (a call it
    started in backward)."""
    values = [f & ((1 << 56) - 1) for f in fingerprints]
    if len(set(values)) <= 1:
        return ""
    if not any(v & _STEP_BIT for v in values) and \
            all(f >> 56 == Communicator.CHECK_OPTIMIZER for f in fingerprints):
        # Every rank's call started in backward (grad_ready), or as there, in step(grads)
        # before its last (_report_all), and carries which optimizer only (_call_check):
        # ranks whose calls differ met another optimizer's.
        ranks = [r for r, v in enumerate(values) if v != values[0]]
        return (f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} started an "
                "all-reduce of another DistributedOptimizer than rank 0 at this point, in "
                "backward (grad_ready) or step(grads): where several share a "
                "communicator, every rank gives them their gradients in one order, as it "
                "steps them in one order (a bucket's all-reduce starts as its last "
                "gradient is given)")
    if not all(v & _STEP_BIT for v in values):
        return ""
    apart = {}  # field -> the ranks whose 4 bits differ from rank 0's
    for i, field in enumerate(_STEP_FIELDS):
        ranks = [r for r, v in enumerate(values) if (v >> 4 * i) & 0xF != values[0] >> 4 * i & 0xF]
        if ranks:
            apart[field] = ranks
    if "optimizer" in apart:  # (then its settings may well differ: not compared)
        ranks = apart["optimizer"]
        return (f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} stepped another "
                "DistributedOptimizer than rank 0 (another model, or another of several "
                "made on this communicator): every rank must step the same one")
    if not apart:  # (4 bits agree for one pair of values in 16)
        return ("the ranks' optimizers or their settings differ (which, the check does not "
                "tell): step the same DistributedOptimizer on every rank, with the same "
                "settings")
    parts = []
    for ranks in sorted(set(map(tuple, apart.values()))):
        names = ["Adam's step count t" if field == "t" else field
                 for field in apart if tuple(apart[field]) == ranks]
        said = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        parts.append(f"{said} on rank{'s' * (len(ranks) > 1)} "
                     f"{', '.join(map(str, ranks))} differ{'s' * (len(names) == 1)} "
                     "from rank 0's")
    here = [f"{name}={getattr(optimizer, name, None)!r}" for name in _SETTING_NAMES
            if name in apart] + ([f"t={optimizer.t!r}"] if "t" in apart else [])
    # (Another setting may differ too, where its 4 bits agree: these differ at least.)
    return (f"the ranks' optimizer settings differ, at least: {'; '.join(parts)} (this "
            f"rank's: {', '.join(here)}); set them alike on every rank (a schedule that "
            "follows one rank's own numbers, its validation loss, say, sets them apart)")


def _update_by(verdict, where) -> bool:
    """Whether before_update's verdict says to update: None or True (a numpy bool, or a
    0-d array of bool, numpy's or cupy's: np.isfinite(g).all()) do, False does not.
    Anything else raises TypeError: a clipping function that returns the norm, as
    torch's clip_grad_norm_ does, would skip the steps whose norm is 0 and update where
    it is NaN. where: the optimizer's _where, called only for that error (a string
    formatted every step for nothing otherwise)."""
    if verdict is None:
        return True
    if isinstance(verdict, (bool, np.bool_)) or (getattr(verdict, "dtype", None) == np.bool_
                                                  and getattr(verdict, "ndim", None) == 0):
        return bool(verdict)
    raise TypeError(f"{where('step')}: before_update returned {verdict!r} "
                    f"({type(verdict).__name__}): return None or True to update, False to "
                    "skip the step")


def _quietly(f, *args):
    """f(*args), or None if it raises an Exception (see DistributedOptimizer.abandon_step)."""
    try:
        return f(*args)
    except Exception:
        return None


# What every agreement of a DistributedOptimizer compares first: which call each rank
# is in, and of which optimizer. All of them agree in rows of one size and op (three
# checks after this one), so that ranks in different ones pair up and are told so,
# rather than compare one call's texts with another's (a model with settings), or meet
# a row of another size (a bare MismatchError, after lining up).
_WHICH_CALL = ("call different things here (making a DistributedOptimizer, or "
               "load_state_dict() or broadcast_parameters() of one: which, and of which "
               "optimizer)")
_CHECKS_AFTER_WHICH_CALL = 3


class _LiningUp:
    """The communicator as agree_or_raise uses it, where ranks partway through a step
    may have some of its all-reduces in flight, started before the agreement, which
    the others never make: its first all-reduce meets one of those instead (each
    rank raises MismatchError: another dtype and op), and is made again, up to
    `calls_ahead` more times, until every rank's meets every other's. `repeated`
    says how often it was.

    Not past a call that step() itself started (its check carries _STEP_BIT: the
    step's last all-reduce, which backward never starts): that rank is in step(), not
    on its way to this agreement, and its step's calls end there (a MismatchError
    drops the step, making no more). Made again, the agreement met that rank's next
    call instead, its next step's, and every step after paired with the one before
    elsewhere, up to a timeout at the end; stopped there, both sides' next calls pair
    up."""

    def __init__(self, comm, calls_ahead: int):
        self.comm, self.calls_ahead, self.repeated = comm, calls_ahead, 0
        self.rank, self.size = comm.rank, comm.size

    def allreduce(self, x, op):
        while True:
            try:
                result = self.comm.allreduce(x, op=op)
            except MismatchError as error:
                if self.repeated >= self.calls_ahead or _met_a_step(error):
                    raise
                self.repeated += 1
                continue
            self.calls_ahead = 0  # (lined up: the calls after it are made once)
            return result

    def allgather(self, x):
        return self.comm.allgather(x)

    def broadcast(self, x, root):
        return self.comm.broadcast(x, root=root)


def _scale_unagreed(bucket) -> bool:
    """Whether a bucket's all-reduce begins with the ranks' agreement on its fp16 scale
    (never agreed, or lost to a gradient that was not finite)."""
    scale = bucket.scale
    return scale is not None and scale.value is None and not scale.zero_confirmed


def _all_steps(error: MismatchError) -> bool:
    """Whether every rank's call, where `error` was raised, was one that a
    DistributedOptimizer's step() started (and so its settings' fingerprint)."""
    checks = getattr(error, "checks", ())
    return bool(checks) and all(check >> 56 == Communicator.CHECK_OPTIMIZER and
                                check & _STEP_BIT for check in checks)


def _steps_of_others(error: MismatchError) -> bool:
    """Whether, where `error` was raised, ranks were in step() of different
    DistributedOptimizers (their fingerprints' index fields differ: _step_fingerprint)."""
    return len({check & 0xF for check in getattr(error, "checks", ())}) > 1


def _met_a_step(error: MismatchError) -> bool:
    """Whether some rank's call, where `error` was raised, was one that a
    DistributedOptimizer's step() started (see _LiningUp)."""
    return any(check >> 56 == Communicator.CHECK_OPTIMIZER and check & _STEP_BIT
               for check in getattr(error, "checks", ()))


def _optimizer_repr(optimizer) -> str:
    """SGD(lr=0.1, momentum=0.9, weight_decay=0.0; 4 parameters, 1,234 elements)"""
    settings = ", ".join(f"{name}={getattr(optimizer, name)!r}" for name in optimizer._SETTINGS)
    elements = sum(int(p.size) for p in optimizer.params)
    count = len(optimizer.params)
    return (f"{type(optimizer).__name__}({settings}; {count} parameter{'s' * (count != 1)}, "
            f"{elements:,} element{'s' * (elements != 1)})")


class SGD(_CheckedSettings):
    """Stochastic gradient descent with momentum and L2 weight decay, as torch.optim.SGD:
    g += weight_decay * p; buf = momentum * buf + g (buf = g at first); p -= lr * buf.
    Unlike torch's, for float16 and bfloat16 parameters buf is float32 and each step is
    computed in float32, then rounded into p once (see _kept_dtype)."""

    # Its settings, in the order _check_settings takes them (which state_dict() saves,
    # and DistributedOptimizer.broadcast_parameters() sends).
    _SETTINGS = ("lr", "momentum", "weight_decay")
    _check_settings = staticmethod(_check_sgd_settings)
    # Its public names (see NamedSettings, through which a step sets two at most).
    _ATTRIBUTES = frozenset(("params", "momentum_buffers") + _SETTINGS)

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params = _check_params(params, "SGD")
        _check_sgd_settings(lr, momentum, weight_decay, "SGD")
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.momentum_buffers = [None] * len(self.params)

    def __repr__(self) -> str:
        return _optimizer_repr(self)

    def step(self, grads) -> None:
        grads, layout = _checked_grads_and_layout(grads, self.params, "SGD.step")
        # (As made and loaded: a schedule's lr of -0.1 or NaN, set by hand, would
        # otherwise climb, or turn every parameter into NaN, without a word.)
        _check_sgd_settings(self.lr, self.momentum, self.weight_decay, "SGD.step")
        # As Python floats, whatever number a schedule set: numpy 2 computes lr * g in
        # float64 for an np.float64 lr and float32 g, in float32 for a Python float, so
        # ranks given one or the other would update apart, though their lr is the same.
        lr, momentum, weight_decay = float(self.lr), float(self.momentum), \
            float(self.weight_decay)
        if layout is not None and self._all_host_wide(layout):
            # The usual case: every parameter a plain numpy array of 32 bits or more,
            # each gradient of its exact dtype and shape (_check_grads' layouts). The
            # loop below, with what it decides for each parameter decided once for all:
            # no GPU to make current, computed in p's own dtype (g.astype is g). The
            # same numpy operations on the same arrays, so the same bits; the `with`,
            # astype and dtype tests took some 0.45 us a parameter (200 of 1 KiB: a
            # third of the update).
            buffers = self.momentum_buffers
            big = self._big  # (None where no parameter is updated in blocks)
            if momentum and not weight_decay and big is None and \
                    len(buffers) == len(grads) and \
                    all(map(operator.is_not, buffers, itertools.repeat(None))):
                # (Every momentum buffer made: after the first step with momentum.)
                for p, g, buf in zip(self.params, grads, buffers):
                    buf *= momentum
                    buf += g
                    p -= lr * buf
                return
            for i, (p, g) in enumerate(zip(self.params, grads)):
                if big is not None and big[i] and _sgd_in_blocks(
                        p, g, buffers, i, p.dtype, lr, momentum, weight_decay):
                    continue
                if weight_decay:
                    g = (g + weight_decay * p).astype(p.dtype, copy=False)
                if momentum:
                    buf = buffers[i]
                    if buf is None:  # (an array, even for a numpy scalar: see below)
                        buf = buffers[i] = g.copy() if g.ndim else np.array(g, copy=True)
                    else:
                        buf *= momentum
                        buf += g
                    g = buf
                p -= lr * g
            return
        for i, (p, g) in enumerate(zip(self.params, grads)):
            p = plain(p)  # (see _computed_as_plain)
            dtype = _kept_dtype(p)
            if isinstance(p, np.ndarray) and p.nbytes >= _SGD_BLOCKS_FROM and _sgd_in_blocks(
                    p, g, self.momentum_buffers, i, dtype, lr, momentum, weight_decay):
                continue  # (a big host parameter, updated a block at a time)
            with on_gpu_of(p):  # (cupy computes on the current GPU)
                wide = p if dtype == p.dtype else p.astype(dtype)  # (16-bit p: float32)
                g = g.astype(dtype, copy=False)
                if weight_decay:
                    # In wide's dtype (a 0-d g plus an array is an array of the wider
                    # dtype), and so the momentum buffer made from it.
                    g = (g + weight_decay * wide).astype(dtype, copy=False)
                if momentum:
                    buf = self.momentum_buffers[i]
                    if buf is None:
                        # An array, even where g is a numpy scalar (a 0-d parameter's
                        # gradient plus weight decay, or a gradient like d.sum()): buf is
                        # updated in place below, which a scalar is not.
                        buf = self.momentum_buffers[i] = (g.copy() if g.ndim else
                                                         array_module(p).array(g, copy=True))
                    else:
                        buf *= momentum
                        buf += g
                    g = buf
                wide -= lr * g
                if wide is not p:
                    p[...] = wide

    def _all_host_wide(self, layout: bytes) -> bool:
        """Whether the parameters, whose numpy_layout() is layout (plain numpy arrays),
        are each of 32 bits or more: found once for a layout (which names each one's
        dtype), not at every step."""
        if layout == getattr(self, "_wide_layout", None):
            return True
        if all(p.dtype.itemsize >= 4 for p in self.params):
            self._wide_layout = layout
            self._big = _big_ones(self.params, _SGD_BLOCKS_FROM)
            return True
        return False

    def state_dict(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "momentum_buffers": [None if b is None else copy_where_it_is(b)
                                     for b in self.momentum_buffers]}

    def load_state_dict(self, state: dict) -> None:
        self._take(self._checked(state))

    def _checked(self, state, where: str = "SGD.load_state_dict") -> dict:
        """What load_state_dict(state) loads, checked: everything before anything is
        loaded (a state that failed halfway through left the settings loaded before
        it: lr and momentum without weight_decay, say). `where`: what errors begin with
        (DistributedOptimizer's, naming the rank)."""
        buffers = _checked_state_arrays(state, "momentum_buffers", self.params, "SGD",
                                        optional=True, where=where, kept_as=_kept_dtype)
        lr, momentum, weight_decay = _state_values(state, self._SETTINGS, "SGD", where)
        _check_sgd_settings(lr, momentum, weight_decay, where)
        return {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                "momentum_buffers": buffers}

    def _take(self, checked: dict) -> None:
        self.lr, self.momentum = checked["lr"], checked["momentum"]
        self.weight_decay = checked["weight_decay"]
        self.momentum_buffers = checked["momentum_buffers"]  # (copies: see _checked)


# 40 digits, then rounded to a float: b ** t correctly rounded unless it lies within
# about 1e-40 (relative) of a point halfway between two floats.
_POWERS = decimal.Context(prec=40)


def _power(base, exponent: int):
    """base ** exponent, the same bits on every CPU. A float's ** is the C library's
    pow(), which glibc computes with FMA where the CPU has it and without elsewhere, the
    two differing in the last bit now and then (0.9999 ** t: at 180 of the first 300,000
    t): 1 - beta2 ** t then differed too, and Adam's replicas on ranks of two CPU
    generations drifted apart. decimal's power is the same software everywhere (about
    6 us). A numpy float32 (or float16) keeps its type, rounded from that (numpy's own
    ** picks its code by CPU too); anything else is left to its own **."""
    if isinstance(base, np.floating) and not isinstance(base, float) and \
            base.dtype.itemsize <= 4:
        return base.dtype.type(float(_POWERS.power(decimal.Decimal(float(base)), exponent)))
    if not isinstance(base, (float, int)) or isinstance(base, bool):
        return base ** exponent
    return float(_POWERS.power(decimal.Decimal(base), exponent))


def _zeros_beside(p):
    """Zeros shaped like p, in _kept_dtype(p), where p is (host, or p's GPU)."""
    with on_gpu_of(p):
        return array_module(p).zeros(p.shape, _kept_dtype(p))


# Big parameters on the host (SGD's of _SGD_BLOCKS_FROM bytes or more, Adam's of
# _ADAM_BLOCKS_FROM) are updated _BLOCK elements at a time: each temporary of the update
# (SGD's lr * g, Adam's three, a 16-bit parameter's float32 copy) is then one block, not
# one parameter, and a block's operands stay in the cache from one operation of the
# update to the next. Every operation is elementwise, and the same one on the same
# dtypes as for the whole array, so every element gets the same bits. Measured
# (2026-12-07, docs/performance-log.md): blocks of 128K elements were as fast as any;
# SGD's whole-array update was faster up to 2 MiB (fewer calls, its arrays in the
# cache anyway), Adam's from 512 KiB already slower than its blocks.
_BLOCK = 1 << 17
_SGD_BLOCKS_FROM = 4 << 20
_ADAM_BLOCKS_FROM = 1 << 20


def _blocked_views(p, g, *state):
    """p, g and each of state (SGD's momentum buffer, Adam's moments: None where there
    is none yet) as flat views, where p (a host parameter) may be updated a block at a
    time: every array a plain C-contiguous numpy array (a strided one is updated whole,
    as before; a subclass's, which keeps its own rules through reshape and slicing, is
    not taken: see _computed_as_plain), and the gradient sharing no memory with what
    the update writes (whole, the update read all of it before writing any). Else
    None."""
    if not (type(p) is np.ndarray and type(g) is np.ndarray and
            p.flags.c_contiguous and g.flags.c_contiguous):
        return None
    for a in (p,) + state:
        if a is not None and (type(a) is not np.ndarray or not a.flags.c_contiguous
                              or np.may_share_memory(a, g)):
            return None
    return (p.reshape(-1), g.reshape(-1)) + tuple(None if a is None else a.reshape(-1)
                                                   for a in state)


def _block_slices(a) -> list:
    """Slices that cut a flat array into blocks of _BLOCK elements, where it is a big
    numpy array (a big parameter's update, a 16-bit bucket's float32 copy sent or
    received: each then takes a block's temporaries, not the array's; the same
    elementwise operations, the same bits); else one slice of all of it (cupy: one
    kernel each)."""
    if not isinstance(a, np.ndarray) or a.size <= _BLOCK:
        return [slice(None)]
    return [slice(start, start + _BLOCK) for start in range(0, a.size, _BLOCK)]


def _big_ones(params, blocks_from: int) -> tuple | None:
    """For each parameter, whether it is big enough to be updated in blocks where it
    may be (blocks_from bytes or more); None where none is."""
    big = tuple(p.nbytes >= blocks_from for p in params)
    return big if any(big) else None


def _scratch(n: int, dtype, *wanted: bool) -> list:
    """An array of n elements of dtype for each of wanted that is true (made once for
    all of a parameter's blocks), else None."""
    return [np.empty(n, dtype) if want else None for want in wanted]


def _blocks(flat_p, flat_g, wide, wide_g, *scratch):
    """For each of flat_p's blocks (_block_slices): (its slice, p's block, g's block,
    wide, scratch), wide and each scratch array (of a block's size, or all of a smaller
    p) cut to the block. A 16-bit p's block is widened into wide, and its gradient's
    into wide_g, which is then g's block (as astype would: exactly; each None where p or
    g is of the computing dtype already)."""
    for part in _block_slices(flat_p):
        block, gb = flat_p[part], flat_g[part]
        if block.size < scratch[0].size:  # (the last block, shorter)
            wide, wide_g, *scratch = (None if a is None else a[:block.size]
                                      for a in (wide, wide_g, *scratch))
        if wide is not None:
            wide[...] = block
        if wide_g is not None:
            wide_g[...] = gb
            gb = wide_g
        yield part, block, gb, wide, scratch


def _sgd_in_blocks(p, g, buffers, i, dtype, lr, momentum, weight_decay) -> bool:
    """SGD's update of p (with g, and buffers[i] with momentum: made here at the first
    step) computed in dtype, as SGD.step computes it for the whole array, a block at a
    time (see _BLOCK); False, with nothing done, where it may not be (_blocked_views)."""
    buf = buffers[i] if momentum else None
    views = _blocked_views(p, g, buf)
    if views is None:
        return False
    flat_p, flat_g, flat_buf = views
    first = bool(momentum) and buf is None
    if first:  # (state: its first step makes it, as g.copy() did)
        buf = np.empty(p.shape, dtype)
        flat_buf = buf.reshape(-1)
    n = min(_BLOCK, flat_p.size)
    # s: lr * g (and g + weight_decay * p); wide and wide_g: a 16-bit p's block and
    # gradient, widened (see _blocks), p's block rounded from wide.
    s, wide, wide_g = _scratch(n, dtype, True, dtype != p.dtype, dtype != g.dtype)
    multiply, add = np.multiply, np.add
    for part, block, gb, wide, (s,) in _blocks(flat_p, flat_g, wide, wide_g, s):
        if momentum:
            bb = flat_buf[part]
        if weight_decay:  # g + weight_decay * p, into the buffer at the first step
            into = bb if first else s
            gb = add(gb, multiply(weight_decay, block if wide is None else wide, into),
                     into)
        if momentum:
            if first:
                if not weight_decay:
                    bb[...] = gb
            else:
                bb *= momentum
                bb += gb
            gb = bb
        multiply(lr, gb, s)
        if wide is None:
            block -= s
        else:
            wide -= s
            block[...] = wide
    if first:
        buffers[i] = buf
    return True


def _adam_in_blocks(p, g, m, v, lr, b1, b2, eps, weight_decay, correction1,
                    correction2) -> bool:
    """Adam's update of p, m and v with g, computed in m's dtype, as Adam.step computes
    it for the whole array, a block at a time (see _BLOCK); False, with nothing done,
    where it may not be (_blocked_views)."""
    views = _blocked_views(p, g, m, v)
    if views is None:
        return False
    flat_p, flat_g, flat_m, flat_v = views
    dtype = m.dtype
    one_b1, one_b2 = 1 - b1, 1 - b2
    n = min(_BLOCK, flat_p.size)
    # s and u: the update's temporaries; wide and wide_g: as in _sgd_in_blocks.
    s, u, wide, wide_g = _scratch(n, dtype, True, True, dtype != p.dtype, dtype != g.dtype)
    sqrt, multiply, divide, add = np.sqrt, np.multiply, np.divide, np.add
    for part, block, gb, wide, (s, u) in _blocks(flat_p, flat_g, wide, wide_g, s, u):
        if weight_decay:  # g + weight_decay * p
            gb = add(gb, multiply(weight_decay, block if wide is None else wide, s), s)
        mb, vb = flat_m[part], flat_v[part]
        mb *= b1
        mb += multiply(one_b1, gb, u)  # (1 - b1) * g
        vb *= b2
        vb += multiply(multiply(one_b2, gb, u), gb, u)  # (1 - b2) * g * g, left to right
        # lr * (m / correction1) / (sqrt(v / correction2) + eps)
        multiply(lr, divide(mb, correction1, s), s)
        divide(s, add(sqrt(divide(vb, correction2, u), u), eps, u), s)
        if wide is None:
            block -= s
        else:
            wide -= s
            block[...] = wide
    return True


# _computed_as_plain: SGD's and Adam's general ways update a parameter that is a numpy
# subclass through a plain view of its data (plain()), as they take such a gradient
# (_check_grad): kept as given, np.matrix's * is a matrix product, so Adam's
# (1 - b2) * g * g of a matrix parameter with weight decay raised, or was g @ g for
# a square one, and SGD's weight_decay * p was a float64 np.dot that its momentum
# buffer kept as a matrix; and its flat view is a 1 x n matrix, whose first block is
# all of it, so a big one's blocks raised (helper 211). The short ways take plain
# arrays only (numpy_layout).


def _kept_dtype(p) -> np.dtype:
    """The dtype SGD keeps p's momentum buffer in, Adam its moments, and
    DistributedOptimizer its sums over no_sync()'s micro-batches, each step computed
    there: float32 for 16-bit parameters (compression._computing_dtype), else p's own.
    float16 rounds eps=1e-8 to 0, and (1 - 0.999) * g * g to 0 for gradients under
    5e-3, and a step divides m by sqrt(v) + eps: m of 1e-5 over 0 sent a parameter to
    -inf at the first step; and a momentum buffer of gradients of 1e4 (momentum 0.9:
    1e5) overflowed. bfloat16 keeps 8 significant bits: 0.999 * v rounds back to v,
    which then never decays, and with momentum 0.99 and gradients of 0.1 the buffer
    stopped at 6.69 instead of 10."""
    return _compression._computing_dtype(p.dtype)


class Adam(_CheckedSettings):
    """Adam (Kingma & Ba) with bias correction and L2 weight decay, as torch.optim.Adam:
    g += weight_decay * p; t += 1; m = b1 * m + (1 - b1) * g; v = b2 * v + (1 - b2) * g * g;
    p -= lr * (m / (1 - b1 ** t)) / (sqrt(v / (1 - b2 ** t)) + eps), with (b1, b2) = betas
    and m, v starting at 0. Unlike torch's, for float16 and bfloat16 parameters m and v
    are float32 and each step is computed in float32, then rounded into p once (see
    _kept_dtype)."""

    _SETTINGS = ("lr", "betas", "eps", "weight_decay")  # (as SGD's)
    _check_settings = staticmethod(_check_adam_settings)
    _ATTRIBUTES = frozenset(("params", "t", "m", "v") + _SETTINGS)  # (as SGD's)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        self.params = _check_params(params, "Adam")
        _check_adam_settings(lr, betas, eps, weight_decay, "Adam")
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.t = 0
        self.m = [_zeros_beside(p) for p in self.params]
        self.v = [_zeros_beside(p) for p in self.params]

    def __repr__(self) -> str:
        return _optimizer_repr(self)

    def step(self, grads) -> None:
        grads, layout = _checked_grads_and_layout(grads, self.params, "Adam.step")
        _check_adam_settings(self.lr, self.betas, self.eps, self.weight_decay, "Adam.step")
        self.t += 1
        # As Python floats, whatever numbers they are (see SGD.step).
        lr, eps, weight_decay = float(self.lr), float(self.eps), float(self.weight_decay)
        b1, b2 = (float(b) for b in self.betas)
        correction1, correction2 = 1 - _power(b1, self.t), 1 - _power(b2, self.t)
        if layout is not None and numpy_layout(self.m) == layout == numpy_layout(self.v):
            # The usual case (as in SGD.step): parameters, gradients and moments plain
            # numpy arrays, each moment of its parameter's dtype, so the loop below
            # computes in it: the same operations, without the `with`, astype and dtype
            # tests for each parameter.
            one_b1, one_b2 = 1 - b1, 1 - b2
            sqrt = np.sqrt
            if layout != getattr(self, "_big_layout", None):
                self._big, self._big_layout = _big_ones(self.params, _ADAM_BLOCKS_FROM), layout
            # (Those of self._big updated a block at a time: see _BLOCK.)
            big = itertools.repeat(False) if self._big is None else self._big
            for p, g, m, v, blocked in zip(self.params, grads, self.m, self.v, big):
                if blocked and _adam_in_blocks(p, g, m, v, lr, b1, b2, eps, weight_decay,
                                               correction1, correction2):
                    continue
                if weight_decay:
                    g = g + weight_decay * p
                m *= b1
                m += one_b1 * g
                v *= b2
                v += one_b2 * g * g
                p -= lr * (m / correction1) / (sqrt(v / correction2) + eps)
            return
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            p = plain(p)  # (see _computed_as_plain)
            if isinstance(p, np.ndarray) and p.nbytes >= _ADAM_BLOCKS_FROM and \
                    _adam_in_blocks(p, g, m, v, lr, b1, b2, eps, weight_decay,
                                    correction1, correction2):
                continue  # (a big host parameter, updated a block at a time)
            with on_gpu_of(p):
                xp = array_module(p)
                wide = p if m.dtype == p.dtype else p.astype(m.dtype)  # (16-bit p: float32)
                g = g.astype(m.dtype, copy=False)
                if weight_decay:
                    g = g + weight_decay * wide
                m *= b1
                m += (1 - b1) * g
                v *= b2
                v += (1 - b2) * g * g
                wide -= lr * (m / correction1) / (xp.sqrt(v / correction2) + eps)
                if wide is not p:
                    p[...] = wide

    def state_dict(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay, "t": self.t,
                "m": [copy_where_it_is(m) for m in self.m],
                "v": [copy_where_it_is(v) for v in self.v]}

    def load_state_dict(self, state: dict) -> None:
        self._take(self._checked(state))

    def _checked(self, state, where: str = "Adam.load_state_dict") -> dict:
        """What load_state_dict(state) loads, checked (as in SGD._checked)."""
        # (m and v in a 16-bit parameter's own dtype are taken too: a state saved before
        # they were kept in float32, or written by hand as torch's would be.)
        m = _checked_state_arrays(state, "m", self.params, "Adam", where=where,
                                  kept_as=_kept_dtype)
        v = _checked_state_arrays(state, "v", self.params, "Adam", where=where,
                                  kept_as=_kept_dtype)
        lr, betas, eps, weight_decay, t = _state_values(
            state, self._SETTINGS + ("t",), "Adam", where)
        _check_adam_settings(lr, betas, eps, weight_decay, where)
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise ValueError(f"{where}: state['t'] (the steps taken) must be an "
                             f"int >= 0, got {t!r}")
        return {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                "t": int(t), "m": m, "v": v}

    def _take(self, checked: dict) -> None:
        self.lr, self.betas, self.eps = checked["lr"], checked["betas"], checked["eps"]
        self.weight_decay, self.t = checked["weight_decay"], checked["t"]
        self.m, self.v = checked["m"], checked["v"]  # (copies: see _checked)


# float16 keeps 11 significant bits only between 6.1e-5 and 65504 (below, down to 6e-8,
# ever fewer): gradients of 1e-6 lose most of their digits and smaller ones round to 0.
# So an fp16 bucket travels multiplied by a power of two, its scale. The ranks agree on
# it from every rank's largest gradient (an 8-byte max): the largest scale with which no
# partial sum of the ring passes 2 ** 12 (16x below float16's top: room for the next
# step's gradients to grow). Every rank then holds the same sums, so every rank adjusts
# the scale from them alike, without a message: down at once when the sums pass 2 ** aim
# (room for partial sums up to p times the average too), up 2x after _FP16_GROW_AFTER
# steps below it. Growing slowly, not straight to where the sums say, is what keeps
# ranks whose own gradients are far larger than their average (data pulling different
# ways) from overflowing at every step. The ranks agree again, and send again if the
# scale differs, when the sums overflowed anyway (an inf), or fell 2 ** _FP16_FALL
# below where they were when the scale last changed (or all the way to 0: once per run
# of 0s; for the rest of the run one more element counts the ranks whose gradients are
# not all 0, so that ones far too small for the scale are not taken for 0s); and, for
# the next step only, when they sit 2 ** _FP16_FAR below the aim after a change (a
# spike gone) or after falling that far since the ranks last agreed (a decline faster
# than the growth).
# The scale's exponent stays within these: gradients up to about 5e33 (2 ** 112) keep
# their digits, and the factor each rank multiplies by, scale / p, stays a normal
# float32 (it once stopped at 2 ** -40: gradients from about 1e17 came back as infs).
_FP16_SCALES = (-100, 80)
_FP16_GROW_AFTER = 64        # steps without a change before the scale doubles
_FP16_FALL = 10              # how far the sums may fall (powers of 2) before ranks agree
_FP16_FAR = 3                # how far below the aim, or their last level, sums may sit


def _fp16_scale_below(peak: float) -> float | None:
    """The largest allowed power of two s with peak * s < 2 ** 12 (16x below float16's
    top, 65504: room for gradients 16x larger at the next step); None for a peak of 0 or
    not finite (no scale to learn from it)."""
    if peak == 0 or not math.isfinite(peak):
        return None
    return _fp16_clamped(12 - math.frexp(peak)[1])  # (peak < 2 ** frexp(peak)[1])


def _fp16_clamped(exponent: int) -> float:
    return 2.0 ** min(max(exponent, _FP16_SCALES[0]), _FP16_SCALES[1])


def _fp16_sums(wire) -> tuple[int, bool]:
    """The largest float16 exponent field in wire (31 if it holds an inf or NaN;
    otherwise its largest magnitude is below 2 ** (field - 14)), and whether all are 0."""
    if not wire.size:
        return 0, True
    bits = wire.view(np.uint16)  # (& takes a copy: of a block at a time, _block_slices)
    top = max(int((bits[part] & 0x7C00).max()) for part in _block_slices(wire)) >> 10
    return top, top == 0 and not wire.any()


class _Fp16Scale:
    """An fp16 bucket's scale, and what it learnt from the sums so far. Its decisions
    depend on the sums and the agreed peaks only, which are the same on every rank."""

    def __init__(self, ranks: int):
        self.value = None          # until the ranks agree on one (from nonzero gradients)
        self.zero_confirmed = False  # the ranks found all gradients 0, and none since
        self.settled = False       # agreed on since the scale last changed
        self.ref_top = None        # the sums' top exponent at the last change or agreement
        self.ref_estimated = False  # ref_top is other sums' shifted, until sums are seen
        self.clean_steps = 0       # steps since the scale last changed
        # The sums are kept below 2 ** aim: a partial sum can be p times the average.
        self.aim = 15 - 3 - math.ceil(math.log2(ranks))

    # What it learnt, which state_dict() saves and broadcast_parameters() broadcasts (aim
    # comes from the number of ranks). Without it a resumed run agreed on a scale afresh,
    # and gradients too small for float16's normal range at one scale but not the other
    # arrived otherwise than in the run that went on (3.5% off, in a test).
    LEARNT = ("value", "zero_confirmed", "settled", "ref_top", "ref_estimated", "clean_steps")

    def learnt(self) -> dict:
        return {name: getattr(self, name) for name in self.LEARNT}

    def as_numbers(self) -> np.ndarray:
        """learnt() as float64s, to broadcast (None as NaN)."""
        return np.array([math.nan if v is None else float(v) for v in self.learnt().values()])

    def take_numbers(self, numbers) -> None:
        value, zero_confirmed, settled, ref_top, ref_estimated, clean_steps = numbers.tolist()
        self.value = None if math.isnan(value) else value
        self.zero_confirmed, self.settled = bool(zero_confirmed), bool(settled)
        self.ref_top = None if math.isnan(ref_top) else int(ref_top)
        self.ref_estimated, self.clean_steps = bool(ref_estimated), int(clean_steps)

    @classmethod
    def check_learnt(cls, learnt, where: str) -> None:
        """A clear error unless learnt is one a learnt() could have returned."""
        if not isinstance(learnt, dict) or not set(cls.LEARNT) <= learnt.keys():
            raise ValueError(f"{where} is not an fp16 scale's state (it needs "
                             f"{', '.join(cls.LEARNT)})")
        value, ref_top = learnt["value"], learnt["ref_top"]
        good_value = value is None or (
            isinstance(value, float) and value > 0 and math.frexp(value)[0] == 0.5
            and _FP16_SCALES[0] <= math.frexp(value)[1] - 1 <= _FP16_SCALES[1])
        flags = all(isinstance(learnt[name], bool)
                    for name in ("zero_confirmed", "settled", "ref_estimated"))
        counts = isinstance(learnt["clean_steps"], int) and learnt["clean_steps"] >= 0 and (
            ref_top is None or isinstance(ref_top, int))
        if not (good_value and flags and counts):
            raise ValueError(f"{where} is not an fp16 scale's state: value must be None or a "
                             f"power of two from 2 ** {_FP16_SCALES[0]} to 2 ** "
                             f"{_FP16_SCALES[1]}, ref_top None or an int, clean_steps an int "
                             f">= 0, the others bools; got {learnt!r}")

    def sending(self) -> float:
        """The scale to send with. With none agreed yet, because all gradients were 0:
        the largest, so that any that are not show up in the sums."""
        if self.value is not None:
            return self.value
        return 2.0 ** _FP16_SCALES[1] if self.zero_confirmed else 1.0

    def must_agree(self, top: int, zero: bool, lost: bool) -> bool:
        """Before these sums are used: should the ranks agree, and send again? lost: the
        sums are 0 but some rank's gradients are not."""
        if zero:
            return not self.zero_confirmed or lost
        return top == 31 or self.value is None or (
            self.ref_top is not None and top < self.ref_top - _FP16_FALL)

    def adopt(self, agreed: float | None, peak: float, top: int | None = None,
              top_scale: float | None = None) -> None:
        """Take the scale the ranks agreed on; top: of the latest sums, if known, sent
        with top_scale."""
        self.zero_confirmed = peak == 0
        if agreed is not None:
            if agreed != self.value:
                self.value, self.clean_steps = agreed, 0
            # The level later falls are judged by: the latest sums, shifted to this
            # scale if they were sent with another (until sums sent with this one are
            # seen: learn()). It once stood unset after an agreement for the next step,
            # and sums that fell far below it then became the level, unchecked. Without
            # sums (the agreement is on this step's gradients, which are then sent with
            # the scale) the first sums set it.
            if top is None:
                self.ref_top, self.ref_estimated = None, False
            else:
                shift = math.frexp(agreed)[1] - math.frexp(top_scale)[1]
                self.ref_top = min(max(top + shift, 0), 30)
                self.ref_estimated = shift != 0
            self.settled = True

    def learn(self, top: int) -> bool:
        """Adjust to this step's sums, which are below 2 ** (top - 14) and were sent
        with the scale. True if the ranks should agree on the next step's."""
        self.zero_confirmed = False
        if top == 31:  # an inf or NaN in the gradients themselves: nothing to learn
            return False
        if self.ref_top is None or self.ref_estimated:
            self.ref_top, self.ref_estimated = top, False
        room = self.aim - (top - 14)  # doublings left before the sums pass the aim
        change = 0
        if room < 0:
            change = room
        elif room >= 1 and self.clean_steps + 1 >= _FP16_GROW_AFTER:
            change = 1
        exponent = math.frexp(self.value)[1] - 1
        new = _fp16_clamped(exponent + change)
        if new == self.value:
            self.clean_steps += 1
            # Far below the aim after a change (a spike gone), or having fallen far
            # since the ranks last agreed (a decline faster than the growth).
            return room >= _FP16_FAR and (not self.settled or top <= self.ref_top - _FP16_FAR)
        change = math.frexp(new)[1] - 1 - exponent
        self.value, self.ref_top, self.clean_steps = new, top + change, 0
        self.settled = False
        return room - change >= _FP16_FAR


# The op of the all-reduces abandon_step() makes for a step: not the one a step sends
# with, so that where other ranks make that step's calls to use them, every rank's
# call raises MismatchError instead (their results are thrown away either way).
_ABANDONED_OP = "prod"


class _Bucket:
    """Gradients of a few parameters, packed back to back in one flat buffer."""

    def __init__(self, indices, params, wire_dtype, ranks):
        self.indices = indices
        xp = array_module(params[indices[0]])
        self.slices, offset = {}, 0
        for i in indices:
            self.slices[i] = slice(offset, offset + params[i].size)
            offset += params[i].size
        self.buffer = xp.zeros(offset, params[indices[0]].dtype)
        # Each parameter's place in the buffer, shaped like it, where its gradient is
        # copied (DistributedOptimizer._add_to_bucket): made once, not a slice and a
        # reshape at every gradient. Handed out as the averages only to ringreduce's
        # SGD and Adam, without a before_update: anything else gets fresh views or
        # copies (see DistributedOptimizer._finish).
        self.targets = {i: self.buffer[self.slices[i]].reshape(params[i].shape)
                        for i in indices}
        # float16 travels scaled and divided before the sum (see _send_16_bit) even
        # where the parameters are float16 themselves: their plain average, a float16
        # sum divided after, overflows to inf from 65504 / p.
        self.wire = None if wire_dtype == self.buffer.dtype != np.float16 else \
            xp.empty(offset, wire_dtype)
        # float16 only: the power of two the gradients travel multiplied by.
        scaled = self.wire is not None and self.wire.dtype == np.float16
        self.scale = _Fp16Scale(ranks) if scaled else None
        self.sent_scale = 1.0  # the scale of the sums in wire
        # float16 only: the wire and one more element, which counts the ranks whose
        # gradients are not all 0 (sent only while the ranks hold them all 0).
        self.counted = xp.empty(offset + 1, wire_dtype) if scaled else None
        if scaled:
            self.wire = self.counted[:offset]
        self.sent_count = False
        # 16-bit gradients only: their sums over no_sync()'s micro-batches, in float32
        # (made at the first accumulation; see DistributedOptimizer._accumulate).
        self.sums = None
        self.reported: set = set()
        self.handle = None


def _on_its_gpu(method):
    """A DistributedOptimizer's method, run with its parameters' GPU current: cupy makes
    new arrays (buckets, sums, copies, PowerSGD's matrices) and runs kernels on the
    current GPU, and a model made under `with cupy.cuda.Device(1)` is stepped outside
    it. (Also around the wrapped optimizer's step(), which may allocate.) Parameters on
    the host need no GPU: no `with` then (grad_ready() is called for every gradient)."""
    @functools.wraps(method)
    def on_its_gpu(self, *args, **kwargs):
        if self._gpu is None:
            return method(self, *args, **kwargs)
        with on_gpu(self._gpu):
            return method(self, *args, **kwargs)

    return on_its_gpu


def _forwarded(name: str) -> property:
    """A DistributedOptimizer's `name`: the wrapped optimizer's, read and set through it."""
    def get(self):
        return getattr(self.optimizer, name)

    def set(self, value):
        if not hasattr(self.optimizer, name):  # (a new attribute no step would read)
            raise AttributeError(f"{self._where()}: the wrapped "
                                 f"{type(self.optimizer).__name__} has no {name} to set")
        setattr(self.optimizer, name, value)
    return property(get, set, doc=f"The wrapped optimizer's {name} (the one its steps use).")


class DistributedOptimizer(_types.NamedSettings):
    """Wraps an optimizer (SGD, Adam, or anything with ``params`` and ``step(grads)``) so
    that every step uses the gradients averaged over all ranks. Another optimizer gets
    arrays of its own, which it may keep; state_dict() and load_state_dict() need its
    own state_dict() and load_state_dict(state).

    Either step(grads), or grad_ready(i, g) for each gradient as backward produces it
    and then step(): a bucket's all-reduce starts once its gradients, and those of the
    buckets before it, are in, while backward goes on (docs/training.md walks through a
    whole script).

    before_update: a function given the step's averaged gradients (a list, the same on
    every rank) before the update, which may change them (clip them, say) and returns
    None or True to update, False to skip this step's update (gradients not finite,
    say); the ranks compare what each one's did (see _agreed_to_update).

    Construction is collective: every rank must wrap parameters of the same shapes
    (and so are load_state_dict() and broadcast_parameters()).
    """

    # The wrapped optimizer's settings, through the wrapper too (a schedule ported from
    # torch or Horovod, whose wrappers are the optimizer, sets opt.lr: that had made an
    # attribute of the wrapper that no step read).
    lr, momentum, betas = _forwarded("lr"), _forwarded("momentum"), _forwarded("betas")
    eps, weight_decay = _forwarded("eps"), _forwarded("weight_decay")
    # Its public names (see NamedSettings: a step of 200 gradients in one bucket sets 11
    # names through it, some 2 us of its 300-500 us; grad_ready() none, unless changed).
    _ATTRIBUTES = frozenset(("comm", "optimizer", "params", "compression", "powersgd",
                             "bytes_sent", "comm_seconds"))

    def _no_such_setting(self, name: str) -> str:  # (NamedSettings's error)
        wrapped = self.optimizer
        # (Not where the wrapped one has it: a subclass's setting of its own, which the
        # wrapper does not forward, is set on it, as another optimizer's is.)
        if isinstance(wrapped, (SGD, Adam)) and not hasattr(wrapped, name):
            return (f"{self._where()}: DistributedOptimizer has no setting {name!r} (the "
                    f"wrapped {type(wrapped).__name__}'s settings, which it sets, are "
                    f"{', '.join(wrapped._SETTINGS)})")
        return (f"{self._where()}: DistributedOptimizer has no setting {name!r}: "
                f"a setting of the wrapped {type(wrapped).__name__} is set on it "
                f"(opt.optimizer.{name} = ...), where it has one")

    def __init__(self, optimizer, comm=None, bucket_mb: float = 25.0, compression=None,
                 before_update=None):
        from ._shortcuts import _communicator

        self.comm = _communicator(comm, "DistributedOptimizer")  # (first: it is collective)
        # (grad_ready's, made once: it is called for every parameter, every step)
        self._grad_ready_where = self._where("grad_ready")
        try:
            self._set_up(optimizer, bucket_mb, compression, before_update)
        except Exception as error:  # (an array-like whose dtype has no .kind, say)
            # The others wait in the check below: tell them, rather than leave them to
            # wait out their timeout, or to pair it with this rank's next call.
            try:
                self._check_same_model_everywhere(rejected=error)
            except CollectiveTimeoutError as timeout:
                _types.told_in_vain(error, timeout)
            except Exception:  # (telling them failed: this rank's own error says more)
                pass
            raise
        self._check_same_model_everywhere()
        if self.powersgd is not None:
            self.powersgd._taken = True
        # What every all-reduce of its steps carries: which optimizer it belongs to (the
        # model, and its place among the optimizers made on this communicator, which
        # are made collectively, so in the same order on every rank), so that ranks
        # that step different optimizers at one point (two of one model and settings
        # too) raise MismatchError instead of mixing their gradients. A hash of ints is
        # the same in every process (a string's is salted).
        self._index = self.comm._optimizers_made
        self._identity = hash((zlib.crc32("".join(self._model_texts).encode()), self._index))
        self._call_check = self.comm._check(self.comm.CHECK_OPTIMIZER,  # (not a step's)
                                            self._identity & (_STEP_BIT - 1))
        self.comm._optimizers_made += 1
        self._step_check = self._call_check  # (see _renew_step_check)

    def __repr__(self) -> str:
        buckets = len(self._buckets)
        return (f"DistributedOptimizer({self.optimizer!r}, rank {self.comm.rank} of "
                f"{self.comm.size}, {buckets} bucket{'s' * (buckets != 1)}"
                + (f", compression={self.compression!r}" if self.compression else "") + ")")

    def _where(self, method: str = "") -> str:
        """What this optimizer's errors begin with: the call and this rank, as the
        collectives' do, so that one rank's error among many is placed."""
        call = f"DistributedOptimizer.{method}" if method else "DistributedOptimizer"
        return _types.where(self.comm.rank, self.comm.size, call)

    def _check_calling_thread(self, method: str) -> None:
        """Where MPI lets only the main thread call it, the refusal names this method (not
        the collective it would make), before the step changes: nothing is abandoned."""
        # (Only then is the error's beginning made: grad_ready is called per gradient.)
        if not self.comm._executor.threaded:
            self.comm._check_calling_thread(self._where(method))

    def _check_open(self, method: str) -> None:
        """Where the Communicator is closed (or being closed), the refusal names this
        method, not the collective it would make, before any parameter changes."""
        comm = self.comm
        if comm._closed or comm._closing:
            comm._refuse_as_closed(self._where(method))

    def _renew_step_check(self) -> None:
        """What a step's all-reduces carry (_step_check): which optimizer (as
        _call_check) and its settings now, so that ranks where a schedule set another lr
        (or momentum, betas, eps, weight_decay), which are compared only once otherwise,
        raise MismatchError in step() instead of updating their replicas apart. Made in
        step(), for the all-reduces it starts (the step's last among them, which every
        update waits for), once a step (some 4 us): the calls before it, started during
        backward, carry which optimizer only (_call_check), so that ranks that set the
        same lr at different points of backward still pair up."""
        self._step_check = self.comm._check(self.comm.CHECK_OPTIMIZER, _step_fingerprint(
            self._identity, self._index, self.optimizer))

    def _set_up(self, optimizer, bucket_mb, compression, before_update) -> None:
        """All of construction that this rank does alone (and may refuse)."""
        self.optimizer = optimizer
        if before_update is not None and not callable(before_update):
            raise TypeError(f"{self._where()}: before_update must be a function of the "
                            f"averaged gradients, or None; got {type(before_update).__name__}")
        self._before_update = before_update
        if not hasattr(optimizer, "params") or not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"{self._where()}: optimizer must have .params and .step(grads) "
                            f"(as ringreduce.optim.SGD and Adam do), got {type(optimizer).__name__}")
        self.params = _check_params(optimizer.params, self._where())
        # One GPU for all: buckets pack gradients of several parameters, and the ring
        # runs each call on one GPU (the core keeps its staging for one at a time).
        self._gpu = the_one_gpu(self.params, "params", self._where(), "a "
                                "DistributedOptimizer keeps its buckets and all-reduces on "
                                "one GPU: give each rank's model one GPU (or one "
                                "DistributedOptimizer per GPU)")
        with on_gpu(self._gpu):
            self._set_up_on_the_gpu(optimizer, bucket_mb, compression)

    def _set_up_on_the_gpu(self, optimizer, bucket_mb, compression) -> None:
        """The rest of _set_up, with the parameters' GPU current (see _on_its_gpu)."""
        # The averaged gradients are views of the buckets, which the next step
        # overwrites. ringreduce's SGD and Adam keep none of them; another optimizer
        # may (a momentum buffer that starts as the first gradient, say), and would then
        # see it change under it: it gets copies, as it would get fresh arrays without
        # DistributedOptimizer. (A step set on the instance, sgd.step = mine, is another
        # optimizer's too, though its class's is ours.)
        self._hand_copies = (type(optimizer).step not in (SGD.step, Adam.step)
                             or "step" in getattr(optimizer, "__dict__", ()))
        for i, p in enumerate(self.params):
            if not p.dtype.isnative:  # (the ring's buffers are native, and so its results)
                raise ValueError(f"{self._where()}: params[{i}] has dtype {p.dtype.str}, "
                                 "in the other byte order than this machine's: make it "
                                 "p.astype(p.dtype.newbyteorder('='))")
        check_bucket_mb(bucket_mb, self._where())
        self.compression = compression
        self.powersgd = compression if isinstance(compression, _compression.PowerSGD) else None
        if self.powersgd is not None and self.powersgd._taken:
            raise ValueError(f"{self._where()}: this PowerSGD object was given to another "
                             "DistributedOptimizer, and keeps state for its parameters (the "
                             "error fed back, the last Q): give each DistributedOptimizer a "
                             "PowerSGD(...) of its own (copy.deepcopy() of one carries its "
                             "state over)")
        cast = None if self.powersgd else compression  # PowerSGD sends the rest as is
        # Matrices PowerSGD compresses skip the buckets; everything else is bucketed.
        self._low_rank = [i for i, p in enumerate(self.params)
                          if self.powersgd is not None and self.powersgd.compresses(p.shape, p.dtype)]
        if self.powersgd is not None:
            # One with state already (loaded, or a copy of one that ran): its arrays are
            # keyed by parameter index, and must fit this model, as a loaded state must,
            # and go where the parameters are, as the optimizer's own load_state_dict()
            # puts them (a state saved from a model on a GPU, given to one on the CPU).
            state = self.powersgd.state_dict()
            self._check_powersgd_arrays(state, self._where(), "compression.state_dict()")
            self.powersgd._load(state, lambda i, a: _on_the_side_of(a, self.params[i]))
        bucketed = [i for i in range(len(self.params)) if i not in set(self._low_rank)]
        plan = pack_plan([self.params[i] for i in bucketed], int(bucket_mb * 1024 * 1024))
        self._buckets = []
        # Checked here, where each rank can still refuse for all: the ring's own error
        # would come at every step's first all-reduce.
        travels = [(i, self.params[i].dtype) for i in self._low_rank]
        for indices in plan:
            members = [bucketed[j] for j in indices]
            wire = _compression._wire_dtype(cast, self.params[members[0]], self._where())
            travels += [(i, wire) for i in members]
            self._buckets.append(_Bucket(members, self.params, wire, self.comm.size))
        reduced = _types.supported_dtypes()
        for i, dtype in sorted(travels):
            if dtype.name not in reduced:
                raise TypeError(f"{self._where()}: params[{i}] has dtype "
                                f"{self.params[i].dtype}, and its gradients would travel as "
                                f"{dtype}, which the ring does not reduce (it takes "
                                f"{', '.join(n for n in reduced if 'float' in n)}); give "
                                "the optimizer float64 parameters, or compression='fp16'")
        self._bucket_of = {i: b for b in self._buckets for i in b.indices}
        # The buckets grad_ready()'s short way fills: all of them where the parameters
        # are on the host (there are then no GPU to make current), else none.
        self._host_bucket_of = self._bucket_of if self._gpu is None else {}
        # Each bucketed parameter's place in its bucket (its target), by index: what
        # step() hands ringreduce's SGD and Adam as the averaged gradients where no
        # before_update sees them (see _finish).
        self._targets = [self._bucket_of[i].targets[i] if i in self._bucket_of else None
                         for i in range(len(self.params))]
        self._low_rank_sums: dict = {}       # index -> gradient (summed over micro-batches)
        self._low_rank_reported: set = set()  # reported in the current (micro-)step
        self._low_rank_calls: dict = {}      # index -> its PowerSGD all-reduces in flight
        # The order all-reduces start in, the same on every rank: buckets and PowerSGD's
        # matrices (as their index), last parameter first, as backward produces them.
        # (A bucket is complete when its first parameter is in.)
        units = [(min(b.indices), b) for b in self._buckets] + [(i, i) for i in self._low_rank]
        self._units = [unit for _, unit in sorted(units, key=lambda u: -u[0])]
        self._next_to_start = 0      # the first unit of _units not started yet
        # A complete unit waits for step() to start it (the last; or an fp16 bucket
        # whose scale was never agreed, and those after it: see _start_complete_units):
        # until then the step can still be abandoned.
        self._holding_for_step = False
        self._accumulating = False   # inside no_sync()
        self._accumulated = False    # the buckets hold gradients from no_sync() steps
        # Inside no_sync(): (index, its sum before) of each gradient given in this
        # micro-batch, to put back if it fails (see _undo_micro_batch()).
        self._micro_batch: list = []
        self._abandoning = False     # inside abandon_step(): calls go with _ABANDONED_OP
        self._abandoned_by_error = False  # an error abandoned the step; nothing given since
        # An fp16 scale agreement of this step met another call (see _start): the
        # others are not in this step, and abandoning it makes no calls.
        self._met_another_call = False
        self.bytes_sent = 0          # payload bytes this rank handed to allreduce
        self.comm_seconds = 0.0      # time step() spent waiting for communication
        self._model_texts = self._texts_to_agree_on()  # (here: what fails in it is refused)

    # -- public ---------------------------------------------------------------------

    @_on_its_gpu
    def broadcast_parameters(self, root: int = 0) -> None:
        """Overwrite every rank's parameters with root's, so all replicas start equal;
        and, where the wrapped optimizer is ringreduce's SGD or Adam, its state too
        (its settings: lr, momentum, betas, eps, weight_decay; momentum buffers; Adam's
        moments and step count), so that a replica left behind goes on equal; and the
        fp16 buckets' scales. Collective. Refused, on every rank, where any rank is
        partway through a step (see state_dict), or holds SGD or Adam settings, set by
        hand, that their constructor refuses: the ranks learn it in one small
        all-reduce first."""
        self._check_calling_thread("broadcast_parameters")
        self._check_open("broadcast_parameters")
        partway = self._partway_error("broadcast_parameters", "the parameters broadcast "
                                      "now would be updated with gradients of the ones "
                                      "before")
        where = self._where("broadcast_parameters")
        # Settings set by hand that cannot be sent (or stepped with) refuse here, with
        # the others told, not halfway through the broadcasts, where they would wait.
        rejected = partway
        if rejected is None:
            try:
                _types.check_root(root, self.comm.size, where)
                self._check_settings_to_send(where)
            except (TypeError, ValueError) as error:
                rejected = error
        # (A bad root or ranks of different roots: every rank raises, naming this call,
        # before any broadcast, not at the first parameter's, naming that.)
        try:
            self._agree_between_steps(where, "broadcast_parameters", ["broadcast from "
                                      "different roots"], [repr(int(root)) if rejected is
                                                           None else None],
                                      rejected, "no rank broadcast anything")
        except CollectiveTimeoutError as timeout:
            if rejected is None or partway is not None:
                raise
            raise _types.told_in_vain(rejected, timeout) from None
        if partway is not None:
            raise self._partway_outcome(partway, "Nothing was broadcast")
        if rejected is not None:
            raise rejected
        try:
            for p in self.params:
                self.comm.broadcast(p, root=root)
            self._broadcast_optimizer_state(root)
            # (The same everywhere already, unless a rank loaded a state_dict() alone.)
            self._broadcast_fp16_scales(root)
        except (CollectiveTimeoutError, MismatchError) as error:
            # (A rank left halfway, say: named for the call made, not the broadcast.)
            raise _types.renamed(error, "ringreduce.broadcast", _types.call_of(where)) from None

    def _check_settings_to_send(self, where: str) -> None:
        optimizer = self.optimizer
        if isinstance(optimizer, (SGD, Adam)):
            settings = [getattr(optimizer, name) for name in optimizer._SETTINGS]
            optimizer._check_settings(*settings, f"{where}: {type(optimizer).__name__}'s settings")

    def _broadcast_optimizer_state(self, root: int) -> None:
        # Of SGD and Adam, whose state is known here; another optimizer's is its own.
        optimizer = self.optimizer
        if isinstance(optimizer, (SGD, Adam)):
            # The settings too: where rank 0 alone loaded a state_dict() (a decayed lr,
            # say), the others hold the ones they were made with.
            names = optimizer._SETTINGS
            mine = [float(v) for name in names for v in np.atleast_1d(getattr(optimizer, name))]
            root_s = iter(self.comm.broadcast(np.array(mine, np.float64), root=root).tolist())
            for name in names:
                value = getattr(optimizer, name)
                setattr(optimizer, name, tuple(next(root_s) for _ in value)
                        if np.ndim(value) else next(root_s))  # (a pair: a list too)
        if isinstance(optimizer, Adam):
            for a in optimizer.m + optimizer.v:
                self.comm.broadcast(a, root=root)
            t = self.comm.broadcast(np.array([optimizer.t], np.int64), root=root)
            optimizer.t = int(t[0])
        elif isinstance(optimizer, SGD):
            # A buffer is made at the first step with momentum: root's say which exist.
            buffers = optimizer.momentum_buffers
            made = self.comm.broadcast(np.array([b is not None for b in buffers], np.uint8),
                                       root=root)
            for i, (p, exists) in enumerate(zip(self.params, made)):
                if not exists:
                    buffers[i] = None
                    continue
                if buffers[i] is None:
                    buffers[i] = _zeros_beside(p)
                self.comm.broadcast(buffers[i], root=root)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: inside, step(grads) only adds grads to a local sum.
        May be nested: only the outermost one ends the accumulation."""
        outer = self._accumulating
        self._accumulating = True
        try:
            yield self
        finally:
            self._accumulating = outer

    def grad_ready(self, index: int, grad) -> None:
        """The gradient of params[index] is final. Once every gradient of its bucket is
        in, the bucket's all-reduce starts (outside no_sync), while you keep computing;
        the step's last one waits for step(), so that the step can still be abandoned
        until then. An error here (a bad index or gradient, say) abandons the step
        (abandon_step()), so that the other ranks' step() raises MismatchError instead
        of waiting for this rank's calls; inside no_sync(), where nothing was sent,
        only this micro-batch's gradients are dropped, and the sums accumulated before
        stay. Give none of that step's gradients after the error: the next one given
        begins the next step."""
        if not self.comm._executor.threaded:  # (_check_calling_thread, written out here)
            self.comm._check_calling_thread(self._grad_ready_where)
        if self._abandoned_by_error:  # (a gradient given, even one refused, begins one;
            self._abandoned_by_error = False  # set only then: see NamedSettings)
        # The usual case at once (through _report, some 0.7 us a gradient, half of it
        # Python's calls and tests): outside no_sync(), a plain numpy gradient of a host
        # parameter's bucket, not given yet this step, is only copied into it: by
        # copy_gradient, which tests the index, the array, its shape and its dtype as
        # _report does, and copies nothing where any differs. Anything else, and every
        # error, goes through _report, which says what is wrong.
        try:
            bucket = self._host_bucket_of.get(index) if type(index) is int else None
            if bucket is not None and index not in bucket.reported and not (
                    self._accumulating or self._accumulated) and \
                    copy_gradient(self.params, self._targets, index, grad):
                reported = bucket.reported
                reported.add(index)
                if len(reported) == len(bucket.indices):  # (as _report, outside no_sync())
                    self._start_complete_units()
                return
            if self._gpu is None:  # (no `with` for the host: see _on_its_gpu)
                self._report(index, grad)
            else:
                with on_gpu(self._gpu):
                    self._report(index, grad)
        except BaseException as error:
            with on_gpu(self._gpu):  # (as _on_its_gpu would, around all of grad_ready)
                self._abandon_at_error()
            if isinstance(error, CollectiveTimeoutError):
                # (A call it started that raised at once: as it is, but named for the
                # call the script made. Its one blocking call, an fp16 bucket's first
                # agreement on its scale, is step()'s now: see _start_complete_units.)
                raise _types.renamed(error, "ringreduce.allreduce",
                                     _types.call_of(self._grad_ready_where)) from None
            raise

    def _reported_twice(self, who: str, index: int) -> ValueError:
        every = sum(len(b.reported) for b in self._buckets) + len(self._low_rank_reported)
        forgot = (": every parameter's gradient of this step is in already; was step() "
                  "forgotten after the last backward pass?") if every == len(self.params) else ""
        return ValueError(f"{who}: params[{index}] was reported twice in one step{forgot}")

    def _report_all(self, grads: list) -> None:
        """step(grads)'s _report() of every gradient, all checked already (_check_grads).
        Outside no_sync(), with no sums kept, a bucket's gradients are only copied into
        its buffer: for plain contiguous numpy ones, by one call into the core
        (pack_gradients, a memcpy each, as allreduce_gradients packs), where a view and
        an assignment a gradient, with _report's bookkeeping, took some 0.8 us each
        (200 small parameters, one rank: a step of 840 us took 670 us). The buckets'
        all-reduces start as they would have: all are complete, and
        _start_complete_units() starts them in their one order, holding the last for
        step(). Anything else (inside no_sync(), a gradient that is no plain contiguous
        array) goes through _report() as before."""
        packed = []  # (the buckets packed)
        if not self._accumulating and not self._accumulated:
            for bucket in self._buckets:
                if isinstance(bucket.buffer, np.ndarray) and \
                        pack_gradients(grads, bucket.indices, bucket.buffer):
                    bucket.reported.update(bucket.indices)
                    packed.append(bucket)
        if len(packed) < len(self._buckets) or self._low_rank:
            done = {i for bucket in packed for i in bucket.indices}
            for i, g in enumerate(grads):
                if i not in done:
                    self._report(i, g, checked=True)
        if packed:  # (as _report() would have, outside no_sync())
            self._start_complete_units()

    def _report(self, index: int, grad, checked: bool = False) -> None:
        who = self._grad_ready_where
        if type(index) is not int and (  # (a Python int, the usual case, at once)
                isinstance(index, bool) or not isinstance(index, (int, np.integer))) or not (
                0 <= index < len(self.params)):
            raise ValueError(f"{who}: index {index!r} is not a parameter index "
                             f"(0..{len(self.params) - 1})")
        if not checked:  # (step(grads) checked them all, with _check_grads)
            p = self.params[index]
            # (_check_grad's first test, here: a plain numpy array of p's shape and dtype)
            if type(grad) is not np.ndarray or grad.shape != p.shape or grad.dtype != p.dtype:
                grad = _check_grad(index, grad, p, who)
        bucket = self._bucket_of.get(index)  # (None: a matrix PowerSGD compresses)
        complete = True  # (whether its unit's gradients are all in: see below)
        if bucket is None:
            if index in self._low_rank_reported:
                raise self._reported_twice(who, index)
            earlier = self._low_rank_sums.get(index) if self._accumulated else None
            if earlier is not None:
                self._low_rank_sums[index] = earlier + grad  # (float32 + 16 bits: float32)
            elif self._accumulating:  # (in float32 for 16-bit gradients: see _accumulate)
                self._low_rank_sums[index] = grad.astype(
                    _compression._computing_dtype(grad.dtype))
            else:
                self._low_rank_sums[index] = grad.copy()
            self._low_rank_reported.add(index)
        else:
            if index in bucket.reported:
                raise self._reported_twice(who, index)
            if self._accumulating or self._accumulated:
                # (A copy of the sums it adds to, to put back if the micro-batch fails:
                # the gradient, subtracted again, would take an inf or a huge value with
                # it, or may have been changed by then.)
                earlier = self._sums_in(bucket)[bucket.slices[index]].copy() \
                    if self._accumulating and self._accumulated else None
                self._add_to_bucket(bucket, index, grad)
            else:  # (_add_to_bucket's case outside no_sync(), with no sums kept)
                bucket.targets[index][...] = grad
            bucket.reported.add(index)
            complete = len(bucket.reported) == len(bucket.indices)
        if self._accumulating:
            self._micro_batch.append((index, earlier))
        elif complete:
            # Only where this gradient completed its unit: only then can the next
            # all-reduce in order be ready.
            self._start_complete_units()

    @_on_its_gpu
    def step(self, grads=None) -> None:
        """Average the gradients across ranks and update the parameters.

        With ``grads``: a list of one gradient per parameter. Without: the gradients
        given to grad_ready() since the last step. Inside no_sync(), only accumulates.
        An error abandons the step, as in grad_ready().
        """
        self._check_calling_thread("step")
        if grads is not None:
            self._abandoned_by_error = False  # (as in grad_ready)
        try:
            # (Inside the try: refused, the step is dropped as at any error here, so that
            # state_dict() still saves what the optimizer holds.)
            self._check_open("step")
            if grads is not None:
                grads = _check_grads(grads, self.params, self._where("step"))
                if any(b.reported for b in self._buckets) or self._low_rank_reported:
                    raise ValueError(f"{self._where('step')}: gradients were already given "
                                     "with grad_ready() in this step; call step() without "
                                     "grads")
                self._report_all(grads)
            missing = None
            if any(len(b.reported) < len(b.indices) for b in self._buckets) or \
                    len(self._low_rank_reported) < len(self._low_rank):
                missing = [i for b in self._buckets for i in b.indices if i not in b.reported]
                missing += [i for i in self._low_rank if i not in self._low_rank_reported]
            if missing and grads is None and self._accumulated and \
                    len(missing) == len(self.params):
                # Every micro-batch given inside no_sync(), then step() outside to send
                # them: "no gradient reported" named none of the gradients given, nor
                # that the sums went with the step (the error abandons it, below).
                raise ValueError(
                    f"{self._where('step')}: no gradient given since the micro-batches "
                    "accumulated in no_sync(): the step's last micro-batch is given "
                    "outside no_sync() (step(grads), or grad_ready() for each parameter; "
                    "zeros where this rank has no more), which adds it to their sums and "
                    "sends them. This step is dropped, with the sums of its micro-batches")
            if missing:
                raise ValueError(f"{self._where('step')}: no gradient reported for params "
                                 f"{sorted(missing)} (call grad_ready for each, or step(grads)"
                                 f"; {_NO_GRADIENT})")
        except BaseException:
            self._abandon_at_error()
            raise
        if self._accumulating:  # one micro-batch done: keep the sums, send nothing
            if self._started_any():
                # Their all-reduces have started (outside no_sync) and overwrite the
                # sums with averages: nothing is left to accumulate.
                self.abandon_step()
                self._abandoned_by_error = True
                raise ValueError(f"{self._where('step')}: called inside no_sync(), but "
                                 "gradients of this step were given to grad_ready() outside "
                                 "it, which started their all-reduce; this step's gradients "
                                 "(and any accumulated before) are dropped. Give a step's "
                                 "gradients and call its step() on the same side of no_sync()")
            self._accumulated = True
            for b in self._buckets:
                b.reported.clear()
            self._low_rank_reported.clear()
            self._micro_batch.clear()
            return
        # The buckets' targets themselves, for ringreduce's SGD and Adam, which neither
        # keep nor change them, where no before_update sees them (see _finish).
        targets = not self._hand_copies and self._before_update is None
        averaged = list(self._targets) if targets else [None] * len(self.params)
        start = time.perf_counter()
        # PowerSGD's error fed back and Q as before this step, for a step that
        # before_update skips or the ranks drop: as if it had never been (finish()
        # keeps this step's, which the next would otherwise take up).
        kept = (dict(self.powersgd._q), dict(self.powersgd._error)) \
            if self._before_update is not None and self.powersgd is not None else None
        try:
            self._renew_step_check()  # the settings it updates with
            self._start_complete_units(last_too=True)  # all are complete now
            # Every all-reduce of the step completes before what only ranks that step
            # do (an fp16 bucket's agreement on its scale): where another rank abandoned
            # the step, its calls raise MismatchError here, on every rank (see
            # _ABANDONED_OP), before this rank makes a call that rank never makes.
            for unit in self._units:  # (PowerSGD's second all-reduces queue after all)
                if isinstance(unit, _Bucket):
                    unit.handle.wait()
                else:
                    call = self._low_rank_calls[unit]
                    self.powersgd.project(call, self.comm, check=self._step_check)
                    self.bytes_sent += call.q.nbytes
            for i in self._low_rank:
                self._low_rank_calls[i].handle.wait()
            for unit in self._units:
                if isinstance(unit, _Bucket):
                    self._finish(unit, None if targets else averaged)
            for i in self._low_rank:
                averaged[i] = self.powersgd.finish(self._low_rank_calls[i])[0]
        except MismatchError as error:
            met_another_call = self._met_another_call  # (abandon_step() clears it)
            self.abandon_step()
            self._abandoned_by_error = True
            if met_another_call and not _all_steps(error):
                raise  # (_start's error says what happened, named for step)
            apart = _fingerprints_apart(getattr(error, "checks", []), self.optimizer)
            if apart:
                raise MismatchError(
                    f"{self._where('step')}: this step is dropped here, without an update "
                    f"(the next starts clean): {apart}: {error}") from error
            raise MismatchError(
                f"{self._where('step')}: this "
                "step's all-reduces did not pair up with the other ranks', so it is dropped "
                "here, without an update; the next step starts clean (an abandon_step() "
                "before its first gradient counts as this step's: call one here if the next "
                "step may need one before any gradient). Another rank abandoned "
                "the step (abandon_step(), as after an exception in its backward pass), "
                "stepped another DistributedOptimizer or holds other settings (lr, "
                "momentum, betas, eps or weight_decay, or Adam's step count: 'the caller's "
                "check' below differs), "
                "or made other calls in their place (a rank out of data that went on past "
                "its training loop, say: docs/training.md shows how ranks with uneven data "
                f"step alike): {error}") from error
        except CollectiveTimeoutError as error:
            self.abandon_step()
            self._abandoned_by_error = True
            # (_kind: the core's TimeoutError::Kind; absent from one raised in Python)
            if getattr(error, "_kind", None) not in ("not joined", "another gave up"):
                # (A rank left, or stopped in the ring, or this call never began: as it
                # is, but named for the call the script made, not the all-reduce.)
                raise _types.renamed(error, "ringreduce.allreduce",
                                     _types.call_of(self._where("step"))) from None
            # A step's last all-reduce starts here, not in backward (so that a rank can
            # still abandon the step): ranks that step several optimizers must do so in
            # one order, which the error of the call alone does not say.
            raise CollectiveTimeoutError(
                f"{self._where('step')}: this step's all-reduces did not complete, so it "
                "is dropped here, without an update. step() starts the step's last "
                "all-reduce, so it is collective: another rank never called it, is stuck "
                "before it, or steps several DistributedOptimizers in another order (make "
                f"their step() calls in the same order on every rank): {error}") from error
        except BaseException:
            self.abandon_step()
            self._abandoned_by_error = True
            raise
        finally:
            self.comm_seconds += time.perf_counter() - start
        self._new_step()
        if self._before_update is not None:
            updating = False
            try:
                updating = self._agreed_to_update(averaged)
            finally:
                if not updating and kept is not None:
                    self.powersgd._q, self.powersgd._error = kept
            if not updating:
                return
        self.optimizer.step(averaged)

    def _agreed_to_update(self, averaged) -> bool:
        """Runs before_update on the averaged gradients; whether every rank updates.
        What each rank's did (update, skip, or raise) and the optimizer's settings after
        it go to all (an allgather of two numbers a rank), so that no rank updates where
        another skipped or failed, or with settings that before_update changed on some
        ranks only, which would move the replicas apart silently: a rank whose
        before_update raised raises its error, the others MismatchError naming it, and
        ranks that decided differently, or hold other settings, all raise MismatchError;
        the step is dropped on every rank then (and a handler's abandon_step() makes no
        calls, as after any error in step())."""
        UPDATE, SKIP, RAISED = 0, 1, 2
        error = None
        try:
            mine = UPDATE if _update_by(self._before_update(averaged), self._where) else SKIP
            if mine == UPDATE and not self._hand_copies:
                # What SGD's and Adam's step() would refuse (an item replaced by one of
                # another dtype or shape), refused here, where it counts as
                # before_update's error on every rank: refused after the agreement, it
                # left this rank behind while the others updated.
                _check_grads(averaged, self.params,
                             f"{self._where('step')}: the gradients before_update left")
            settings = _step_fingerprint(self._identity, self._index, self.optimizer)
        except BaseException as raised:  # (Ctrl-C too: the others wait for this rank)
            error, mine, settings = raised, RAISED, 0
        self._abandoned_by_error = True  # (unless it returns)
        start = time.perf_counter()
        try:
            told = self.comm.allgather(np.array([mine, settings], np.int64)
                                       ).reshape(-1, 2).tolist()
        except CollectiveTimeoutError as timeout:
            raise CollectiveTimeoutError(
                f"{self._where('step')}: the ranks could not compare what before_update "
                "did (a rank's outlasted the timeout, or it is stuck before its step()), so "
                "this step is dropped here, without an update (a late rank may still "
                f"update: resume from a checkpoint): {timeout}") from timeout
        finally:
            self.comm_seconds += time.perf_counter() - start
        states = [state for state, _ in told]
        dropped = "so this step is dropped on every rank, without an update"
        if error is not None:
            if hasattr(error, "add_note"):  # (Python 3.11)
                error.add_note(f"{self._where('step')}: from before_update, {dropped}")
            raise error
        raised = [r for r, state in enumerate(states) if state == RAISED]
        if raised:
            raise MismatchError(f"{self._where('step')}: before_update raised on rank"
                                f"{'s' * (len(raised) > 1)} {raised}, {dropped}")
        if len(set(states)) > 1:
            skipped = [r for r, state in enumerate(states) if state == SKIP]
            raise MismatchError(
                f"{self._where('step')}: before_update skipped the update on ranks "
                f"{skipped} and not on the others, {dropped}: it must decide from the "
                "averaged gradients alone, which are the same on every rank")
        apart = _fingerprints_apart([settings for _, settings in told], self.optimizer)
        if apart:
            raise MismatchError(f"{self._where('step')}: after before_update, {dropped}: "
                                f"{apart}")
        self._abandoned_by_error = False
        return states[0] == UPDATE

    def _check_optimizer_has(self, method: str) -> None:
        if not callable(getattr(self.optimizer, method, None)):
            raise TypeError(f"{self._where(method)}: the wrapped optimizer, a "
                            f"{type(self.optimizer).__name__}, has no {method}(); give it "
                            "state_dict() and load_state_dict(state) (as "
                            "ringreduce.optim.SGD and Adam have) to save and resume it")

    @_on_its_gpu
    def state_dict(self) -> dict:
        """The optimizer's state, the fp16 scales, PowerSGD's (this rank's own) and,
        between micro-batches of no_sync(), their sums (this rank's own too), as they
        are between steps: partway through one (gradients given since the last step(),
        whose all-reduces may be in flight) it raises ValueError, as load_state_dict()
        and broadcast_parameters() do on every rank."""
        partway = self._partway_error("state_dict", "a state holds what the optimizer "
                                      "keeps between steps, and would leave them out")
        if partway is not None:
            raise partway
        self._check_optimizer_has("state_dict")
        state = {"optimizer": self.optimizer.state_dict()}
        if self.powersgd is not None:
            # With the number of ranks: the state is this rank's own, and has no
            # meaning on another number (see _check_powersgd_state).
            state["powersgd"] = {**self.powersgd.state_dict(), "ranks": self.comm.size}
        scaled = self._scaled_buckets()
        if scaled:  # (the same on every rank: learnt from the sums)
            state["fp16_scales"] = [{"params": list(b.indices), **b.scale.learnt()}
                                    for b in scaled]
        if self._accumulated:
            # Between micro-batches of no_sync(): their sums, not sent yet, which a run
            # resumed from the state would otherwise lose. One per parameter, however
            # it travels; this rank's own, so with the number of ranks (see
            # _checked_sums).
            state["accumulated"] = {"sums": [self._sum_of(i).copy()
                                             for i in range(len(self.params))],
                                    "ranks": self.comm.size}
        return state

    @_on_its_gpu
    def load_state_dict(self, state: dict | None) -> None:
        """Loads a state_dict(): the optimizer's, the fp16 scales, and PowerSGD's, which
        is this rank's own (what its approximations missed): each rank loads the state
        it saved; and the sums of micro-batches it holds (this rank's own too), in place
        of any accumulated since the last step (a state without them leaves none).
        Collective: each rank checks its state, then the ranks agree (one small
        all-reduce) that every state passed, that they will hold the same
        optimizer settings (lr, momentum, betas, eps, weight_decay), and on Adam's step
        count, which of SGD's momentum buffers exist, and the fp16 scales (not on
        PowerSGD's state, which differs from rank to rank); else every rank raises (its
        own error where its state failed, MismatchError elsewhere) and none loads
        anything. A rank that takes its state from broadcast_parameters() afterwards
        (rank 0 alone loaded) passes None and loads nothing: only where the optimizer is
        ringreduce's SGD or Adam, whose state and settings broadcast_parameters() sends
        (another optimizer's state is refused beside None), and no rank loads sums of
        micro-batches. Refused, on every rank, where any rank is partway through a step
        (see state_dict)."""
        self._check_calling_thread("load_state_dict")
        self._check_open("load_state_dict")
        partway = self._partway_error("load_state_dict", "a state loaded now would be "
                                      "mixed with them")
        try:
            if partway is not None:
                raise partway
            if state is None and self._accumulated:
                raise ValueError(
                    f"{self._where('load_state_dict')}: given None, but this rank holds the "
                    "sums of micro-batches accumulated in no_sync() since the last step, "
                    "which the next step would add to the state another rank loads (and "
                    "broadcast_parameters() sends). Call abandon_step() on every rank "
                    "first, which drops them, or load on this rank a state of its own")
            checked = None if state is None else self._checked_state(state)
        except Exception as error:
            # The others wait in the agreement below: tell them (as construction does).
            try:
                self._agree_on_loading(None, rejected=error)
            except CollectiveTimeoutError as timeout:
                _types.told_in_vain(error, timeout)
            except Exception:  # (telling them failed: this rank's own error says more)
                pass
            if error is partway:
                raise self._partway_outcome(partway, "Nothing was loaded") from None
            raise
        self._agree_on_loading(checked)
        if checked is None:
            return
        optimizer_state, powersgd_state, scales, sums = checked
        if self._optimizer_checks_first:
            self.optimizer._take(optimizer_state)
        else:  # (another optimizer's: its own checks come only now)
            self.optimizer.load_state_dict(optimizer_state)
        if powersgd_state is not None:  # (checked, and placed, in _checked_state)
            self.powersgd._load(powersgd_state)
        # fp16 scales as saved; or, where the state has none for these buckets (saved
        # without fp16, or with other buckets), as a new optimizer's: the ranks agree on
        # them at the next step, as at the first.
        for bucket, learnt in zip(self._scaled_buckets(), scales):
            bucket.scale = _Fp16Scale(self.comm.size)
            for name in _Fp16Scale.LEARNT if learnt is not None else ():
                setattr(bucket.scale, name, learnt[name])
        # The state's sums of micro-batches, or none: in place of any this run had
        # accumulated since its last step, which belong to the run the state replaces.
        self._low_rank_sums.clear()
        self._accumulated = sums is not None
        for i, total in enumerate(sums or ()):  # (copies: see _checked_sums)
            if i in self._low_rank:
                self._low_rank_sums[i] = total
            else:
                self._put_sum(self._bucket_of[i], i, total.reshape(-1))

    # -- plumbing -------------------------------------------------------------------

    @property
    def _optimizer_checks_first(self) -> bool:
        """Whether the wrapped optimizer's state can be checked before any is loaded
        (ringreduce's SGD and Adam, unless a subclass loads otherwise)."""
        return type(self.optimizer).load_state_dict in (SGD.load_state_dict,
                                                         Adam.load_state_dict)

    @property
    def _state_broadcast(self) -> bool:
        """Whether broadcast_parameters() sends all of the wrapped optimizer's state:
        ringreduce's SGD's or Adam's, not a subclass's that saves more of its own."""
        return self._optimizer_checks_first and \
            type(self.optimizer).state_dict in (SGD.state_dict, Adam.state_dict)

    def _checked_state(self, state) -> tuple:
        """What load_state_dict(state) loads, all of it checked (a clear error before
        anything is loaded): the optimizer's state, PowerSGD's (or None), the fp16
        scales."""
        if not isinstance(state, dict) or "optimizer" not in state:
            raise KeyError(f"{self._where('load_state_dict')}: the state has no "
                           "'optimizer' (is it a DistributedOptimizer state_dict()?)")
        self._check_optimizer_has("load_state_dict")
        powersgd_state = state.get("powersgd")
        if "powersgd" in state:
            self._check_powersgd_state(state["powersgd"])
            # Copies where the parameters are, here with the checks: one that fails (out
            # of memory) is this rank's rejection, before the ranks agree to load.
            powersgd_state = {**powersgd_state, **{
                key: {i: _on_the_side_of(a, self.params[i], copy=True)
                      for i, a in dict(powersgd_state[key]).items()}
                for key in ("q", "error")}}
        scales = self._checked_fp16_scales(state.get("fp16_scales"))
        sums = self._checked_sums(state.get("accumulated"))
        optimizer_state = state["optimizer"]
        if self._optimizer_checks_first:
            optimizer_state = self.optimizer._checked(
                optimizer_state, f"{self._where('load_state_dict')}: "
                                 f"{type(self.optimizer).__name__}'s state")
        return optimizer_state, powersgd_state, scales, sums

    def _sum_of(self, index: int):
        """params[index]'s gradient summed over the micro-batches (while _accumulated)."""
        if index in self._low_rank:
            return self._low_rank_sums[index]
        bucket = self._bucket_of[index]
        return self._sums_in(bucket)[bucket.slices[index]].reshape(self.params[index].shape)

    def _checked_sums(self, saved) -> list | None:
        """state['accumulated']['sums'] (None where the state has none), checked."""
        if saved is None:
            return None
        where = f"{self._where('load_state_dict')}: state['accumulated']"
        if not isinstance(saved, dict) or not {"sums", "ranks"} <= saved.keys():
            raise KeyError(f"{where} is not the sums of micro-batches a state_dict() saves "
                           "(it needs 'sums' and 'ranks')")
        # Each rank's own: on another number of ranks, with other shards, they have no
        # meaning (and which rank would take which?).
        if saved["ranks"] != self.comm.size:
            raise ValueError(f"{where}: the sums of micro-batches accumulated in no_sync() "
                             f"were saved on {saved['ranks']} ranks, and this job has "
                             f"{self.comm.size}: they are each rank's own, and cannot be "
                             f"shared out over another number of ranks. Resume on "
                             f"{saved['ranks']} ranks, or load the state without them (del "
                             "state['accumulated']: those micro-batches are lost; redo them)")
        if not isinstance(saved["sums"], (list, tuple)):  # (as state_dict() saves them)
            raise ValueError(f"{where}['sums'] is a {type(saved['sums']).__name__}, not a "
                             "list of one array per parameter (a state of another model?)")
        # (Sums of 16-bit gradients are kept in float32, see _accumulate; sums in their
        # own dtype, saved before they were, are taken too.)
        return _checked_state_arrays(saved, "sums", self.params, "DistributedOptimizer",
                                     named="state['accumulated']",
                                     where=self._where("load_state_dict"),
                                     kept_as=_kept_dtype)

    def _agree_on_loading(self, checked, rejected: Exception | None = None) -> None:
        # Ranks that load different settings (each reading its own file, one of them
        # stale) would update their replicas differently from then on: the settings
        # compared at construction, and where the optimizer's progress shows (Adam's
        # bias correction counts its steps) and the fp16 scales (sums sent with
        # different scales are unscaled wrongly). Not PowerSGD's state: each rank's
        # error is its own, and its Q is the same on every rank of a run.
        texts = None
        if rejected is None:
            loading = checked[0] if checked is not None else None
            settings = _optimizer_settings(self.optimizer,
                                           loading if isinstance(loading, dict) else None)
            if checked is None and isinstance(self.optimizer, (SGD, Adam)):
                settings = None  # (broadcast_parameters() sends SGD's and Adam's)
            progress = None  # (a rank given None: broadcast_parameters() sends these)
            if checked is not None:
                steps = None  # (another optimizer's state is its own)
                if self._optimizer_checks_first:
                    steps = (loading["t"] if isinstance(self.optimizer, Adam) else
                             [b is not None for b in loading["momentum_buffers"]])
                progress = repr([steps, [None if learnt is None else
                                         [learnt[name] for name in _Fp16Scale.LEARNT]
                                         for learnt in checked[2]]])
            # What a rank given None cannot have from broadcast_parameters(): sums of
            # micro-batches, each rank's own (a rank that loads them beside ranks given
            # None would add its saved micro-batches alone to the next step), and the
            # state of an optimizer other than SGD and Adam (its momentum buffers, say,
            # on the loading rank alone: the replicas apart from the next step on).
            own = "given None" if checked is None else (
                "loads" if checked[3] is not None or not self._state_broadcast else None)
            texts = [settings, progress, own]
        self._agree_between_steps(
            self._where("load_state_dict"), "load_state_dict",
            ["would hold different optimizer settings after it (lr, momentum, betas, eps or "
             "weight_decay; a rank given None keeps its own, which broadcast_parameters() "
             "sends only for ringreduce's SGD and Adam)",
             "load states of different steps or runs (Adam's step count, which of SGD's "
             "momentum buffers exist, or the fp16 scales)",
             "load a state where others are given None that broadcast_parameters() does "
             "not send: sums of micro-batches accumulated in no_sync(), which are each "
             "rank's own, or the state of an optimizer other than ringreduce's SGD and "
             "Adam (its momentum buffers, say), which only ranks that load it would have "
             "(load every rank the state; for sums, its own state, or the state without "
             "'accumulated', whose micro-batches are then lost)"],
            texts, rejected, "no rank loaded its state")

    def _given_this_step(self) -> list:
        """The parameters whose gradients were given since the last step() (inside
        no_sync(), since the micro-batch's last step())."""
        return sorted([i for b in self._buckets for i in b.reported] +
                      list(self._low_rank_reported))

    def _partway_error(self, method: str, why: str) -> ValueError | None:
        """The error for `method` called partway through a step, or None between steps
        (after step(), abandon_step(), or an error that abandoned the step)."""
        given = self._given_this_step()
        if not given:
            return None
        started = (f"; {self._next_to_start} of its {len(self._units)} all-reduces have "
                   "started, and cannot be saved or undone") if self._next_to_start else ""
        return ValueError(
            f"{self._where(method)}: "
            f"called partway through a step: the gradients of params {given} were given "
            f"since the last step(){started}; {why}. Call it between steps, on every rank: "
            "after step() (inside no_sync(), after the micro-batch's step()), or after "
            "abandon_step() on every rank, which drops the step (from a signal handler, "
            "set a flag there and call it after the step)")

    def _agree_between_steps(self, where, method, checks, texts, rejected, outcome) -> None:
        """agree_or_raise on this optimizer's communicator for `method` (see _WHICH_CALL),
        lined up past any of a step's all-reduces that ranks partway through it started
        (_LiningUp); those ranks reject. Where the ranks had started different numbers
        of them, some met the others' agreement instead and failed, and the step cannot
        be finished alike: every rank that started any drops it then (past the agreement, every
        rank's calls are lined up, so the next step's pair up; a rank that gave
        gradients but started no all-reduce keeps them)."""
        padding = _CHECKS_AFTER_WHICH_CALL - len(checks)
        checks = [_WHICH_CALL] + checks + [""] * padding
        texts = [f"{method} {self._call_check}"] + texts + [None] * padding \
            if rejected is None else None
        ring = _LiningUp(self.comm, len(self._units))
        try:
            agree_or_raise(ring, where, checks, texts, rejected, outcome)
        finally:
            if self._next_to_start:
                failed = False
                for handle in [b.handle for b in self._buckets if b.handle is not None] + [
                        call.handle for call in self._low_rank_calls.values()]:
                    try:
                        handle.wait()
                    except Exception:  # (MismatchError: it met another call)
                        failed = True
                if ring.repeated or failed:
                    self._new_step()

    def _partway_outcome(self, partway: ValueError, nothing: str) -> ValueError:
        """partway's error, saying what became of this rank's step."""
        return ValueError(f"{partway}. {nothing}, on any rank. " + (
            "This rank's step stands: finish it (step()), or drop it (abandon_step() on "
            "every rank)" if self._given_this_step() else "This rank's step is dropped, "
            "as abandon_step() drops it: the ranks had started different numbers of its "
            "all-reduces, and some met the others' calls here"))

    def _scaled_buckets(self) -> list:
        """The buckets that travel with an fp16 scale, in order."""
        return [b for b in self._buckets if b.scale is not None]

    def _checked_fp16_scales(self, saved) -> list:
        """For each fp16 bucket, its scale's state in saved (a state_dict()'s
        'fp16_scales'), or None for each where saved has none for these buckets; a clear
        error for a state that no state_dict() makes."""
        scaled = self._scaled_buckets()
        where = f"{self._where('load_state_dict')}: state['fp16_scales']"
        if saved is None:
            return [None] * len(scaled)
        if not isinstance(saved, (list, tuple)) or not all(
                isinstance(entry, dict) and "params" in entry for entry in saved):
            raise ValueError(f"{where} is not a list of fp16 scales' states, each with the "
                             "'params' of its bucket (is it a DistributedOptimizer "
                             "state_dict()?)")
        for k, entry in enumerate(saved):
            _Fp16Scale.check_learnt(entry, f"{where}[{k}]")
        if [list(entry["params"]) for entry in saved] != [list(b.indices) for b in scaled]:
            return [None] * len(scaled)  # (other buckets: see load_state_dict)
        return list(saved)

    def _broadcast_fp16_scales(self, root: int) -> None:
        scaled = self._scaled_buckets()
        if not scaled:
            return
        numbers = self.comm.broadcast(np.concatenate([b.scale.as_numbers() for b in scaled]),
                                      root=root)
        for bucket, mine in zip(scaled, numbers.reshape(len(scaled), -1)):
            bucket.scale.take_numbers(mine)

    def _check_powersgd_state(self, state):
        where = self._where("load_state_dict")
        if not isinstance(state, dict) or not {"rank", "seed", "q", "error"} <= state.keys():
            raise KeyError(f"{where}: state['powersgd'] is not a PowerSGD state_dict()")
        saved = f"PowerSGD(rank={state['rank']}, seed={state['seed']})"
        if self.powersgd is None:
            # Ignored, it would drop what the saving ranks' approximations had not sent
            # yet (owed to the update), silently.
            raise ValueError(f"{where}: the state was saved with {saved}, and this optimizer "
                             f"has no PowerSGD (compression={self.compression!r}): its "
                             "state['powersgd'] holds what this rank's approximations had not "
                             f"sent yet. Make the optimizer with compression={saved} to go on "
                             "with the run, or load the state without it (del "
                             "state['powersgd']: what PowerSGD had not sent yet is lost)")
        # The seed too: PowerSGD.load_state_dict takes both, and the ranks agreed on
        # them (repr(PowerSGD)) when the optimizer was made. A Q is drawn from the seed
        # for a matrix the state has no Q for, and again after an inf or NaN: with
        # another seed the run goes on otherwise than the one saved, and ranks that
        # loaded states of different seeds would draw different Qs.
        if (state["rank"], state["seed"]) != (self.powersgd.rank, self.powersgd.seed):
            raise ValueError(f"{where}: the state is {saved}'s, and this optimizer's is "
                             f"{self.powersgd!r}, which the ranks agreed on when it was made. "
                             f"Make the optimizer with compression={saved} to go on with the "
                             "run, or load the state without it (del state['powersgd']: "
                             "PowerSGD then starts as a new one does, and what it had not "
                             "sent yet is lost)")
        # What the ranks' approximations missed is owed to the update as the average of
        # every rank's error: given out to another number of ranks (rank 0's to rank 2
        # as well, or to rank 0 alone), it changes that average, silently.
        saved_on = state.get("ranks", self.comm.size)  # (states saved before 2026-12-04: none)
        if saved_on != self.comm.size:
            raise ValueError(f"{where}: state['powersgd'] was saved on {saved_on} ranks, and "
                             f"this job has {self.comm.size}: it is each rank's own (what its "
                             "approximations missed), so it cannot be shared out over another "
                             f"number of ranks. Resume on {saved_on} ranks, or load the state "
                             "without it (del state['powersgd']: PowerSGD then starts as a new "
                             "one does, and what it had not sent yet is lost)")
        self._check_powersgd_arrays(state, where, "state['powersgd']")

    def _check_powersgd_arrays(self, state, where: str, named: str) -> None:
        """That the arrays of a PowerSGD state (named so in errors) fit this model."""
        for key in ("q", "error"):
            for index, array in dict(state[key]).items():
                if index not in self._low_rank:
                    raise ValueError(f"{where}: {named}[{key!r}] has an array for "
                                     f"params[{index}], which this optimizer's PowerSGD does "
                                     "not compress (a state of another model?)")
                param = self.params[index]
                n = param.shape[0]
                m = param.size // n
                shape = (m, min(self.powersgd.rank, n, m)) if key == "q" else (n, m)
                dtype = _compression._computing_dtype(param.dtype)
                if (getattr(array, "shape", None), getattr(array, "dtype", None)) != (
                        shape, dtype):
                    raise ValueError(f"{where}: {named}[{key!r}][{index}] is "
                                     f"{getattr(array, 'shape', type(array).__name__)} "
                                     f"{getattr(array, 'dtype', '')}, but for params[{index}] "
                                     f"{tuple(param.shape)} {param.dtype} it is {shape} "
                                     f"{dtype} (a state of another model?)")

    def _start_complete_units(self, last_too: bool = False):
        # Strictly in _units order: ranks may finish gradients in different orders, but
        # their all-reduces must pair up one by one. The last one waits for step()
        # (last_too): once every all-reduce of a step has started, the other ranks' step()
        # uses them all, and a rank that then abandoned the step alone (an error after
        # backward, a gradient given twice) could no longer tell them, and would drop
        # the update that they make: its replica would fall behind, silently. A call
        # held back can still go with _ABANDONED_OP, which their step() raises at.
        # So does an fp16 bucket whose scale was never agreed (the first step's, say),
        # and the units after it: its first call is the ranks' blocking agreement on
        # the scale, which a rank makes in step() alone, and which carries the step's
        # check (_start), so that another rank's load_state_dict() agreement, lined up
        # past a partway rank's calls, stops there (_LiningUp) instead of passing it.
        while self._next_to_start < len(self._units):
            unit = self._units[self._next_to_start]
            complete = len(unit.reported) == len(unit.indices) if isinstance(unit, _Bucket) \
                else unit in self._low_rank_reported
            if not complete:
                return
            if not last_too and (self._next_to_start == len(self._units) - 1 or
                                 isinstance(unit, _Bucket) and _scale_unagreed(unit)):
                self._holding_for_step = True
                return
            self._holding_for_step = False
            # (step() checked this at its start: only grad_ready() meets it here.)
            self._check_open("grad_ready")
            if isinstance(unit, _Bucket):
                try:
                    self._start(unit)
                except MismatchError:
                    # (Raised by its fp16 agreement, a blocking call: the call is made,
                    # with no send after it, as where abandon_step()'s raises. Made again
                    # by the step's abandon, it was one call more than a rank abandoning
                    # beside this one makes: the ranks' calls stayed one apart.)
                    self._next_to_start += 1
                    raise
            else:  # a matrix PowerSGD compresses: its first all-reduce (of P)
                call = self.powersgd.start(unit, self._low_rank_sums[unit], self.comm,
                                           check=self._step_check,
                                           dtype=self.params[unit].dtype)
                self._low_rank_calls[unit] = call
                self.bytes_sent += call.p.nbytes
            self._next_to_start += 1

    @_on_its_gpu
    def abandon_step(self) -> None:
        """Drop the step begun, without an update: the gradients given since the last
        step, and those accumulated in no_sync(). For after an exception halfway
        through backward; after an error inside step() or grad_ready() it is done
        already (and this, if nothing was given since, makes no calls: a second set
        would pair with the others' next step). Collective: ranks may have got to
        different points, so each makes the rest of the step's all-reduces, with 0s
        for the gradients not given, and every rank has then made the same calls
        (none pairs with a call of the next step elsewhere). All are waited for, what
        they raise is dropped, and their results are thrown away. Inside no_sync(),
        where no rank has started any, it makes none. (Not a zero_grad() to call
        before every step: outside no_sync() it costs a step's all-reduces.)

        A rank may also abandon a step alone, while the others call step(): it makes
        its calls with another op, so the others' step() raises MismatchError and
        updates nothing (catch it, and go on with the next step); also once it has
        given every gradient, as the step's last all-reduce waits for step(). Not
        inside no_sync(), where it makes none: there every rank must abandon the step
        (see docs/api.md, Data-parallel training)."""
        self._check_calling_thread("abandon_step")
        if self._abandoned_by_error and self._untouched():
            # grad_ready() or step() abandoned this step already, at its error: a second
            # set of calls would pair with the others' next step. (It cannot tell this
            # from the next step's abandon before any gradient, which the others make
            # calls for: docs/api.md says how to keep the two apart.)
            self._abandoned_by_error = False
            return
        if (not self._accumulating or self._started_any()) and not self._met_another_call:
            # (As step() would: an fp16 bucket's first agreement on its scale, held back
            # for step(), carries the step's check, which the others' step() compares.)
            self._renew_step_check()
            self._abandoning = True
            try:
                self._make_the_rest_of_the_calls()
            finally:
                self._abandoning = False
        for handle in [b.handle for b in self._buckets] + [
                call.handle for call in self._low_rank_calls.values()]:
            if handle is not None:
                _quietly(handle.wait)
        self._new_step()

    def _abandon_at_error(self):
        """After an error in grad_ready() or step(), before step() started the last of
        its all-reduces (see _start_complete_units): abandons the step, so that the
        others' step() raises MismatchError. Inside no_sync(), where no rank has sent
        anything, only the failed micro-batch is dropped: the sums of those before stay."""
        if self._accumulating and not self._started_any():
            self._undo_micro_batch()
            # Nothing given since: a handler's abandon_step() (as docs/api.md advises)
            # keeps the sums of the micro-batches before, instead of dropping them.
            self._abandoned_by_error = True
            return
        if self._abandoned_by_error and self._untouched():
            return  # (abandoned at the last error, and nothing given since)
        self.abandon_step()
        self._abandoned_by_error = True

    def _undo_micro_batch(self) -> None:
        """Takes the gradients given in this micro-batch (inside no_sync()) out of the
        sums again, so that the next micro-batch can give them: each sum goes back to
        what it was (in a step's first micro-batch, the next one overwrites it)."""
        for index, earlier in reversed(self._micro_batch):
            if index in self._low_rank:
                self._low_rank_reported.discard(index)
                if earlier is None:
                    self._low_rank_sums.pop(index, None)
                else:
                    self._low_rank_sums[index] = earlier
            else:
                bucket = self._bucket_of[index]
                bucket.reported.discard(index)
                if earlier is not None:
                    self._put_sum(bucket, index, earlier)
        self._micro_batch.clear()

    def _started_any(self) -> bool:
        """Whether, outside no_sync(), the step's gradients completed any all-reduce
        (started, or held back for step(): the last, say): its calls are a step's."""
        return self._next_to_start > 0 or self._holding_for_step

    def _untouched(self) -> bool:
        return (self._next_to_start == 0 and not self._low_rank_reported
                and not any(b.reported for b in self._buckets))

    def _make_the_rest_of_the_calls(self):
        """The all-reduces of this step that this rank has not made yet, in their order
        (see abandon_step)."""
        for unit in self._units[self._next_to_start:]:
            if isinstance(unit, _Bucket):
                unit.buffer[...] = 0
                if unit.sums is not None:  # (which a 16-bit send reads: _sums_in)
                    unit.sums[...] = 0
                _quietly(self._start, unit)
            else:
                zeros = array_module(self.params[unit]).zeros_like(self.params[unit])
                call = _quietly(self.powersgd.start, unit, zeros, self.comm, _ABANDONED_OP,
                                self._step_check)
                if call is not None:
                    self._low_rank_calls[unit] = call
        self._next_to_start = len(self._units)
        self._holding_for_step = False
        for unit in self._units:  # PowerSGD's second all-reduces, as step() makes them
            call = self._low_rank_calls.get(unit) if not isinstance(unit, _Bucket) else None
            if call is not None and call.q is None:
                _quietly(self.powersgd.project, call, self.comm, _ABANDONED_OP,
                         self._step_check)

    def _new_step(self):
        self._step_check = self._call_check  # (until step(): see _renew_step_check)
        self._micro_batch.clear()
        for b in self._buckets:
            b.handle = None
            b.reported.clear()
        self._next_to_start = 0
        self._holding_for_step = False
        self._low_rank_sums.clear()
        self._low_rank_reported.clear()
        self._low_rank_calls.clear()
        self._accumulated = False
        self._met_another_call = False

    def _add_to_bucket(self, bucket, index, grad):
        if bucket.buffer.dtype.itemsize < 4 and (self._accumulating or self._accumulated):
            self._accumulate(bucket, index, grad, add=self._accumulated)
            return
        target = bucket.targets[index]
        if self._accumulated:
            target += grad
        else:
            target[...] = grad

    def _accumulate(self, bucket, index, grad, add: bool):
        """Adds a 16-bit gradient to its sum over no_sync()'s micro-batches, kept in
        float32. Summed in 16 bits, rounded at every micro-batch, a sum stopped
        growing once the gradients were below half its spacing: 1000 micro-batches of
        1e-3 summed to 0.5 in bfloat16 (0.98 in float16), 4096 of 1.0 to 256 (2048).
        The buffer holds the sums rounded once, for what sends it as it is."""
        if bucket.sums is None:
            bucket.sums = array_module(bucket.buffer).zeros(
                bucket.buffer.shape, _compression._computing_dtype(bucket.buffer.dtype))
        wide = bucket.sums[bucket.slices[index]]
        if add:
            wide += grad.reshape(-1)
        else:
            wide[...] = grad.reshape(-1)
        with np.errstate(over="ignore"):  # (a float16 inf: the fp16 wire sends sums)
            bucket.buffer[bucket.slices[index]] = wide

    def _sums_in(self, bucket):
        """The bucket's gradients, summed over no_sync()'s micro-batches while it
        accumulates (in float32 for 16-bit ones: see _accumulate), else its buffer."""
        return bucket.sums if self._accumulated and bucket.sums is not None else bucket.buffer

    def _put_sum(self, bucket, index, total):
        """Sets params[index]'s sum of micro-batches (flat) in the bucket."""
        if bucket.buffer.dtype.itemsize < 4:
            self._accumulate(bucket, index, total, add=False)
        else:
            bucket.buffer[bucket.slices[index]] = total

    def _start(self, bucket):
        if bucket.wire is None:
            op = _ABANDONED_OP if self._abandoning else "avg"
            bucket.handle = self.comm._allreduce_checked(bucket.buffer, op, self._step_check,
                                                         wait=False)
            self.bytes_sent += bucket.buffer.nbytes
        else:
            scale = bucket.scale
            if _scale_unagreed(bucket):
                try:
                    # (In step(), or abandoning: the step's check, which tells a rank
                    # lining up an agreement that this one is in step(): see _LiningUp.)
                    agreed = self._agreed_fp16_scale(bucket, self._step_check)
                except MismatchError as error:
                    if self._abandoning:
                        raise
                    if _all_steps(error):
                        # (Every rank was stepping: step() says what differs.) Where
                        # some stepped another optimizer, they make none of this one's
                        # calls: this step makes no more, as theirs make none of this
                        # one's. Its abandon made the other buckets' agreements, which
                        # met their next calls (of a model with as many fewer buckets):
                        # the ranks' calls were apart from then on.
                        self._met_another_call = _steps_of_others(error)
                        raise
                    # Blocking, it met a call that is no step's elsewhere (another
                    # rank's load_state_dict() agreement, say, which stops here: see
                    # _LiningUp): abandoning must make no more.
                    self._met_another_call = True
                    raise MismatchError(
                        f"{self._where('step')}: "
                        f"the ranks' agreement on the fp16 scale of params {bucket.indices} "
                        "met another call on some rank (load_state_dict() or "
                        "broadcast_parameters() there, say), so this step is dropped here, "
                        f"without an update: {error}") from error
                scale.adopt(*agreed)
            self._send_16_bit(bucket)

    def _send_16_bit(self, bucket):
        # Divide before the sum, so a 16-bit sum of p gradients cannot overflow.
        bucket.sent_scale = bucket.scale.sending() if bucket.scale is not None else 1.0
        # In the buffer's dtype, so that numpy and cupy round the product alike; but
        # at least float32: a 16-bit factor of 1/3 is itself rounded (bfloat16: 0.334),
        # which made every gradient arrive that much too large.
        sums = self._sums_in(bucket)
        dtype = _compression._computing_dtype(bucket.buffer.dtype)
        factor = dtype.type(bucket.sent_scale / self.comm.size)
        with np.errstate(over="ignore", invalid="ignore"):  # an inf is dealt with after
            for part in _block_slices(sums):
                # (The assignment rounds to 16 bits.)
                bucket.wire[part] = sums[part].astype(dtype, copy=False) * factor
        wire = bucket.wire
        # After the ranks found all gradients 0, sums of 0 are trusted without asking;
        # but gradients far smaller than the scale can hold sum to 0 too. The count of
        # ranks with any that are not 0 tells them apart.
        bucket.sent_count = bucket.scale is not None and bucket.scale.zero_confirmed
        if bucket.sent_count:
            bucket.counted[-1:] = self._sums_in(bucket).any()
            wire = bucket.counted
        op = _ABANDONED_OP if self._abandoning else "sum"
        bucket.handle = self.comm._allreduce_checked(wire, op, self._step_check, wait=False)
        self.bytes_sent += wire.nbytes

    def _agreed_fp16_scale(self, bucket, check=None) -> tuple[float | None, float]:
        """The largest scale with which no partial sum passes 2 ** 12 (None if all
        gradients are 0 or one is not finite), and the largest gradient of all ranks.
        check: what the all-reduce carries (_call_check if None)."""
        # (Each rank sends its gradients divided by p, so every partial sum of the ring
        # is at most the largest of them.)
        xp = array_module(bucket.buffer)
        gradients = self._sums_in(bucket)  # (float32 sums of micro-batches: _accumulate)
        peak = np.array([float(xp.abs(gradients).max()) if gradients.size else 0.0])
        # Checked (which optimizer; in step(), its settings too, as the step's data
        # all-reduces are): a user's own max of one float (a loss, say) made at this
        # point on another rank would pair with it, unnoticed.
        self.comm._allreduce_checked(peak, "max",
                                     self._call_check if check is None else check)
        return _fp16_scale_below(peak[0]), float(peak[0])

    def _unscale_fp16(self, bucket):
        # Every rank holds the same sums, so every rank takes the same branches here.
        scale = bucket.scale
        top, zero = _fp16_sums(bucket.wire)  # the sums are below 2 ** (top - 14)
        lost = zero and bucket.sent_count and bool(bucket.counted[-1] != 0)
        if scale.must_agree(top, zero, lost):
            scale.adopt(*self._agreed_fp16_scale(bucket), None if zero or top == 31 else top,
                        bucket.sent_scale)
            # Send again with the agreed scale (0s that are 0 everywhere: no need).
            if scale.sending() != bucket.sent_scale and not (zero and scale.zero_confirmed):
                self._send_16_bit(bucket)
                bucket.handle.wait()
                top, zero = _fp16_sums(bucket.wire)
        # Sums of 0 are exact at any scale, and tell nothing about it.
        if not zero and scale.value is not None and scale.learn(top):
            scale.adopt(*self._agreed_fp16_scale(bucket), top, bucket.sent_scale)  # (next step)
        # (Only now: agreeing reads this rank's gradients from the buffer.)
        # In float32 at least: a float16 buffer would take the factor as a float16
        # (numpy 2), which is 0 below 2 ** -24, and a scale goes up to 2 ** 80.
        dtype = _compression._computing_dtype(bucket.buffer.dtype)
        factor = dtype.type(1.0 / bucket.sent_scale)  # (a power of two: exact)
        for part in _block_slices(bucket.wire):
            wide = bucket.wire[part].astype(dtype)
            wide *= factor
            bucket.buffer[part] = wide

    def _finish(self, bucket, averaged):
        """Waits for the bucket's all-reduce and puts its averages in its buffer; and
        into `averaged`, fresh views of them (copies for another optimizer than SGD and
        Adam: see _set_up), unless it is None: then the targets were handed out (step()
        does that for ringreduce's SGD and Adam without before_update, which use them
        and let them be: views made anew, a slice and a reshape a parameter, took some
        0.5 us each). Fresh views keep a before_update that reshapes its arrays in place
        (g.shape = ...) from reshaping the targets that gradients are copied into."""
        bucket.handle.wait()
        if bucket.scale is not None:
            self._unscale_fp16(bucket)
        elif bucket.wire is not None:
            for part in _block_slices(bucket.wire):
                bucket.buffer[part] = bucket.wire[part].astype(bucket.buffer.dtype)
        if averaged is None:
            return
        for i in bucket.indices:
            averaged[i] = bucket.buffer[bucket.slices[i]].reshape(self.params[i].shape)
            if self._hand_copies:  # (see _set_up)
                averaged[i] = averaged[i].copy()

    def _texts_to_agree_on(self) -> list[str]:
        model = repr([(tuple(p.shape), str(p.dtype)) for p in self.params])
        wire = repr([(b.indices, str(b.buffer.dtype), None if b.wire is None else str(b.wire.dtype))
                     for b in self._buckets] + [self._low_rank, repr(self.powersgd)])
        return [model, wire, _optimizer_settings(self.optimizer)
                + f" before_update={self._before_update is not None}"]

    def _check_same_model_everywhere(self, rejected: Exception | None = None):
        # The parameters, and how their gradients travel (buckets, compression): ranks
        # that differ in either would make different all-reduces, which pair up wrongly;
        # and the optimizer, which would move the replicas apart.
        agree_or_raise(self.comm, self._where(),
                       [_WHICH_CALL,
                        "wrap different parameters (number, shapes or dtypes)",
                        "send gradients differently (bucket_mb or compression)",
                        "wrap different optimizers (type, or settings: lr, momentum, betas, "
                        "eps or weight_decay; or a before_update on some ranks only)"],
                       None if rejected is not None else
                       ["DistributedOptimizer()"] + self._model_texts, rejected,
                       "no rank made its DistributedOptimizer", (1, "params"))
