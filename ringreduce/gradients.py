"""rr.allreduce_gradients: average a list of gradient arrays across ranks, in place:
small ones packed into a few large all-reduces instead of one small call per array,
large ones reduced where they are."""
from __future__ import annotations

import ast
import heapq
import math
import zlib

import numpy as np

from . import _types
from ._arrays import array_module, as_list_of_arrays, on_gpu_of, the_one_gpu
from ._core import CheckedCallsMismatch, CollectiveTimeoutError, MismatchError, numpy_layout, \
    pack_gradients, unpack_gradients
from ._shortcuts import _communicator
from ._types import OPS, native, op_code, reduction_codes, reject_masked
from .communicator import Communicator

try:
    from numpy.lib.array_utils import byte_bounds  # numpy 2
except ImportError:  # numpy 1
    byte_bounds = np.byte_bounds

def pack_plan(arrays, bucket_bytes: int):
    """Indices of `arrays` grouped into buckets of one dtype and about bucket_bytes
    each, last array first (the order backward produces gradients). An array larger
    than a bucket gets a bucket of its own."""
    buckets, open_bucket = [], {}
    for i in reversed(range(len(arrays))):
        a = arrays[i]
        key = (a.dtype, array_module(a).__name__)
        indices, size = open_bucket.get(key, ([], 0))
        if indices and size + a.nbytes > bucket_bytes:
            buckets.append(indices)
            indices, size = [], 0
        indices.append(i)
        open_bucket[key] = (indices, size + a.nbytes)
    buckets.extend(indices for indices, _ in open_bucket.values() if indices)
    return buckets


def check_bucket_mb(bucket_mb, who: str) -> None:
    # (Written so that NaN fails too.)
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float, np.integer,
                                                                 np.floating)) \
            or not 0 < bucket_mb < float("inf"):
        raise ValueError(f"{who}: bucket_mb must be a number of MiB > 0, got {bucket_mb!r}")


def _reason_from(ring, first: int, error) -> str:
    """Collective: rank `first`'s error (this rank's, if it is `first`), as text, on
    every rank; cut to 1 KiB."""
    text = np.zeros(1024, np.uint8)
    if ring.rank == first:
        data = f"{type(error).__name__}: {error}".encode()[:text.size]
        text[:len(data)] = np.frombuffer(data, np.uint8)
    ring.broadcast(text, root=first)
    return bytes(text).rstrip(b"\0").decode(errors="ignore")  # (a character cut short)


# What a rank that rejected its arguments sends in agree_or_raise's reduction (op min)
# for the checksums it has not got: no other rank's is larger.
_NONE_TO_COMPARE = np.iinfo(np.int64).max


# The collectives an agreement makes (agree_or_raise), whose errors it names for the
# call the script made.
_AGREEMENT_CALLS = ("ringreduce.allreduce", "ringreduce.broadcast", "ringreduce.allgather")


def agree_or_raise(ring, where: str, checks: list[str], texts: list, rejected,
                   outcome: str, lists: tuple[int, str] | None = None) -> None:
    """_agree_or_raise, whose collectives' errors (a rank left, or never came; or it
    met another call) are named for the call the script made (`where`: load_state_dict,
    say), not the "ringreduce.allreduce" (broadcast, allgather) it never made."""
    try:
        _agree_or_raise(ring, where, checks, texts, rejected, outcome, lists)
    except (CollectiveTimeoutError, MismatchError) as error:
        called = _types.call_of(where)
        for ran in _AGREEMENT_CALLS:
            ours = _types.renamed(error, ran, called)
            if ours is not error:
                raise ours from None
        raise  # (its own: named so already)


def _agree_or_raise(ring, where: str, checks: list[str], texts: list, rejected,
                    outcome: str, lists: tuple[int, str] | None = None) -> None:
    """Collective: every rank learns whether every rank accepted its arguments and
    whether they agree, before any rank makes a call that the others might not make
    (one that would pair with some other call of theirs, or wait out their timeout).
    `checks`: for each thing that must be the same on every rank, what ranks that
    differ in it do; `texts`: this rank's text of each, or None for one this rank has
    nothing to compare in (the others' are compared among themselves); `texts` itself
    is None where the rank rejected its arguments: `rejected` is its error, and it only
    says so. Raises MismatchError, naming the ranks, on every rank that did not reject
    its own arguments; `outcome` says what no rank then did. `lists`: (k, name) where
    texts[k] is the repr() of a list of tuples, of `name` ("params": [((6, 8),
    'float32'), ...]): where that differs, the error says where first, between the
    first two ranks that differ."""
    # One small allreduce (op min), the same size on any number of ranks: for each
    # thing the lowest checksum and the lowest of minus each (the highest), then the
    # lowest rank that rejected its arguments and minus the highest (size and 1: none).
    # crc32, not hash(): Python salts string hashes differently in every process.
    if rejected is not None:
        crcs = [None] * len(checks)
        row = [_NONE_TO_COMPARE] * (2 * len(checks)) + [ring.rank, -ring.rank]
    else:
        crcs = [None if text is None else zlib.crc32(text.encode()) for text in texts]
        row = [value for crc in crcs
               for value in ((_NONE_TO_COMPARE,) * 2 if crc is None else (crc, -crc))]
        row += [ring.size, 1]
    # (Where it meets another call on some rank, a step of an optimizer there, it raises
    # MismatchError: agree_or_raise names it for the call made.)
    agreed = ring.allreduce(np.array(row, np.int64), op="min").tolist()
    first, last = agreed[-2], -agreed[-1]
    reason = _reason_from(ring, first, rejected) if first < ring.size else ""
    if rejected is not None:
        return
    if first < ring.size:
        more = " (and more)" if last > first else ""
        raise MismatchError(f"{where}: rank {first}{more} rejected its arguments "
                            f"({reason}), so {outcome}")
    differing = [k for k in range(len(checks))  # (none compared k: both at _NONE_TO_COMPARE)
                 if agreed[2 * k] != _NONE_TO_COMPARE and agreed[2 * k] != -agreed[2 * k + 1]]
    if differing:
        # Only on this path: every rank's checksums (-1: none), to name the ranks that
        # differ from the first that compared.
        mine = [-1 if crc is None else crc for crc in crcs]
        values = ring.allgather(np.array([mine], np.int64))[:, differing[0]].tolist()
        compared = [r for r, crc in enumerate(values) if crc != -1]
        differ = [r for r in compared if values[r] != values[compared[0]]]
        detail = ""
        if lists is not None and differing[0] == lists[0]:
            two = _texts_of(ring, texts[lists[0]] or "", (compared[0], differ[0]))
            detail = f" ({_first_difference(lists[1], *two, compared[0], differ[0])})"
        raise MismatchError(f"{where}: ranks {checks[differing[0]]}: ranks {differ} differ "
                            f"from rank {compared[0]}{detail}, so {outcome}")


def _texts_of(ring, mine: str, ranks: tuple) -> list[str]:
    """Collective: the text `mine` of each rank in `ranks` (on the error path only)."""
    data = np.frombuffer(mine.encode(), np.uint8)
    sizes = ring.allgather(np.array([len(data)], np.int64)).tolist()
    every = ring.allgather(data).tobytes()
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [every[starts[r]:starts[r + 1]].decode() for r in ranks]


def _first_difference(name: str, a: str, b: str, rank_a: int, rank_b: int) -> str:
    """Where two ranks' lists (the repr() of lists of tuples) first differ, in words."""
    try:
        first, second = ast.literal_eval(a), ast.literal_eval(b)
    except (ValueError, SyntaxError):
        return f"{name}: {a[:200]} on rank {rank_a}; {b[:200]} on rank {rank_b}"
    if len(first) != len(second):
        return f"{len(first)} {name} on rank {rank_a}, {len(second)} on rank {rank_b}"

    def said(entry):
        return " ".join(str(part) for part in entry) if isinstance(entry, tuple) else str(entry)
    i = next((i for i, (x, y) in enumerate(zip(first, second)) if x != y), None)
    if i is None:
        return f"{name} alike, as far as a rank can see"
    return f"{name}[{i}]: {said(first[i])} on rank {rank_a}, {said(second[i])} on rank {rank_b}"


def _signature(grads) -> str:
    return repr([(tuple(g.shape), g.dtype.str, array_module(g).__name__) for g in grads])


# The first call's check (see Communicator._allreduce_checked) from a rank that rejected
# its arguments: no other rank's is this, unless every rank rejected its own.
_CHECK_OF_REJECTED = Communicator._check(Communicator.CHECK_GRADIENTS, 1)

_WHAT_MUST_AGREE = [
    "pass gradients that differ (in number, shapes, dtypes with their byte order, numpy "
    "or cupy, or order)",
    "pass different ops", "pack the gradients differently (bucket_mb)"]


# dtype -> an int that names it alike in every process (dtypes that compare equal, as
# int64 spelt 'l' and 'q' do, share an entry: a dtype's hash follows its equality).
_DTYPE_KEYS: dict = {}


def _dtype_key(dtype) -> int:
    key = _DTYPE_KEYS.get(dtype)
    if key is None:
        key = _DTYPE_KEYS[dtype] = zlib.crc32(f"{dtype.str} {dtype.name}".encode())
    return key


def _check_of(grads, op: int, plan) -> int:
    """A check (never _CHECK_OF_REJECTED) that differs between ranks where their
    gradients' shapes, dtypes and array modules, op or buckets (`plan`) do.
    Cheaper than the texts agree_or_raise compares, as every call makes it: a hash of
    ints only, as Python salts the hashes of strings differently in every process, not
    those of ints. Equal dtypes hash alike, however spelt (int64 as 'l' or 'q'), and
    two bucket_mb that cut the same buckets do too, as agree_or_raise's texts do."""
    layout = tuple((g.shape, _dtype_key(g.dtype), isinstance(g, np.ndarray)) for g in grads)
    check = Communicator._check(Communicator.CHECK_GRADIENTS,
                                hash((layout, op, tuple(map(tuple, plan)))))
    return check if check != _CHECK_OF_REJECTED else check + 1


# numpy gradients at least this large are reduced in place, each in a call of its own:
# packing copies a gradient twice (in, and back out), which costs more than the calls it
# saves from about this size up (2 ranks here, eight gradients of a size, blocking calls
# against one packed call: 64 KiB 117-143 us against 170-206 us; 1 MiB 1.6-2.1 ms against
# 4.1-4.8 ms; 4 KiB about even). Not cupy arrays, for which copies are cheap and calls
# are not.
_ALONE_BYTES = 64 * 1024


def _gradient_plan(grads, bucket_bytes: int) -> list[list[int]]:
    """The calls allreduce_gradients makes: indices of grads, one bucket a call; large
    numpy arrays alone (see _ALONE_BYTES), the rest packed (pack_plan). Made from the
    shapes, dtypes and array types only, so the same on every rank that agrees."""
    alone = [isinstance(g, np.ndarray) and g.nbytes >= _ALONE_BYTES for g in grads]
    packed = [i for i, a in enumerate(alone) if not a]
    return [[i] for i in reversed(range(len(grads))) if alone[i]] + [
        [packed[j] for j in bucket]
        for bucket in pack_plan([grads[i] for i in packed], bucket_bytes)]


# (op code, bucket bytes, layout) -> _plan_and_check(): a training loop passes the same
# layout call after call, and making these took some 25 us of an 8-gradient call's 60
# (one rank). The layout is numpy_layout()'s bytes, or else a tuple of each gradient's
# type, shape and dtype.
_PLANS: dict = {}


def _plan_and_check(grads, layout, code: int, bucket_bytes: int, where: str):
    """The plan (_gradient_plan), the check (_check_of), and for each bucket where its
    gradients go in the flat buffer: (index, start, stop, shape, or None for 1-D)."""
    key = (code, bucket_bytes, layout)
    found = _PLANS.get(key)
    if found is None:
        plan = _gradient_plan(grads, bucket_bytes)
        places = []
        for indices in plan:
            offsets = np.cumsum([0] + [grads[i].size for i in indices]).tolist()
            places.append([(i, start, stop, None if grads[i].ndim == 1 else grads[i].shape)
                           for i, start, stop in zip(indices, offsets, offsets[1:])])
        # Every bucket's dtype with op, checked here: rejected in a later call, it would
        # leave the gradients reduced in place before it reduced and the rest not.
        for indices in plan:
            reduction_codes(native(grads[indices[0]].dtype), OPS[code], where,
                            f"grads[{indices[0]}]")
        found = (plan, _check_of(grads, code, plan), places)
        if len(_PLANS) >= 64:  # (a program that keeps changing its layout)
            _PLANS.clear()
        _PLANS[key] = found
    return found


def _overlapping(grads, plan) -> set:
    """Indices of the gradients that would be reduced in place (alone, numpy) but share
    memory with another of those (the same array twice, tied weights, overlapping
    views): those go through a copy, taken before any call, so that each is reduced
    once from what it held, not once more after another's call. (A packed copy that
    overlaps one reduced in place is harmless: taken before, it comes back with the
    same values.) Compared by the bytes they span, whatever owns them: views of one
    memory need not share an ndarray owner (np.frombuffer of two memoryviews, two
    as_strided() views, arrays from __array_interface__ or DLPack), and spans of
    memory that different allocations own never overlap. (A strided array's span
    covers bytes it skips, but such an array goes through a copy anyway.) GPU arrays
    (cupy) too: one larger than a bucket is alone in its bucket, and reduced in place."""
    spans = [(span, b[0]) for b in plan if len(b) == 1
             for span in [span_of(grads[b[0]])] if span is not None]
    if len(spans) < 2:
        return set()
    shared = set()
    active: list = []  # (end, index) of the spans before that may reach further
    for (lo, hi), i in sorted(spans):
        while active and active[0][0] <= lo:
            heapq.heappop(active)
        if active:  # each still active overlaps this one
            shared.add(i)
            shared.update(j for _, j in active)
        heapq.heappush(active, (hi, i))
    return shared


def span_of(g) -> tuple[int, int] | None:
    """The bytes g spans, numpy's or a GPU array's (from its shape and strides, as
    numpy's byte_bounds; None for anything else). Host and GPU memory share one address
    space under CUDA's unified addressing, so the two kinds of span never overlap each
    other."""
    if isinstance(g, np.ndarray):
        return byte_bounds(g)
    interface = getattr(g, "__cuda_array_interface__", None)
    if interface is None:
        return None
    start, shape = interface["data"][0], tuple(interface["shape"])
    if 0 in shape:
        return start, start
    itemsize = np.dtype(interface["typestr"]).itemsize
    strides = interface.get("strides")
    if strides is None:  # (C-contiguous)
        return start, start + math.prod(shape) * itemsize
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    return start + low, start + high + itemsize


def _flat(grads, indices, shared: set, size: int):
    """The buffer a bucket's call reduces (`size` elements), and whether it is a copy
    (to unpack after): a gradient alone that the ring can take as it is (contiguous, in
    native byte order) and that shares no memory with another gradient (`shared`),
    itself, flattened."""
    g = grads[indices[0]]
    if len(indices) == 1 and g.flags.c_contiguous and g.dtype.isnative \
            and indices[0] not in shared:
        return g.reshape(-1), False
    if isinstance(g, np.ndarray):  # the usual case, by memcpy (see pack_gradients)
        flat = np.empty(size, g.dtype)
        if pack_gradients(grads, indices, flat):
            return flat, True
    xp = array_module(g)  # (xp.ravel: an np.matrix's own ravel() stays 2-D)
    with on_gpu_of(g):  # (cupy's: on the current GPU, not the gradients')
        flat = xp.concatenate([xp.ravel(grads[i]) for i in indices])
        if not flat.dtype.isnative:  # (the ring's is native; g[...] = converts back)
            flat = flat.astype(flat.dtype.newbyteorder("="))
    return flat, True


def _unpack(grads, indices, places, flat) -> None:
    if isinstance(flat, np.ndarray) and unpack_gradients(flat, grads, indices):
        return
    with on_gpu_of(flat):
        for i, start, stop, shape in places:
            grads[i][...] = flat[start:stop] if shape is None else \
                flat[start:stop].reshape(shape)


def _not_completed(error: CollectiveTimeoutError, where: str) -> CollectiveTimeoutError:
    """A timeout of one of allreduce_gradients' all-reduces, as its own error: the
    script called allreduce_gradients, not the ringreduce.allreduce that the core's
    error names (which stays as the cause, with what kind of timeout it was)."""
    return CollectiveTimeoutError(
        f"{where}: its all-reduces did not complete, and the gradients may be partly "
        "reduced (it is collective: every rank must call it, with the same list of "
        f"shapes and dtypes, op and bucket_mb): {error}")


def _as_ours(error: MismatchError) -> MismatchError:
    """The core's error of one of allreduce_gradients' all-reduces, named for the call
    the script made (it began "ringreduce.allreduce: ranks disagree", where a rank
    stepped a DistributedOptimizer, say, and the caller had made no allreduce)."""
    return _types.renamed(error, "ringreduce.allreduce", "ringreduce.allreduce_gradients")


def allreduce_gradients(grads, op: str = "avg", comm=None, bucket_mb: float = 25.0):
    """Reduce every array in ``grads`` across ranks, in place; returns ``grads``.

    Small arrays of one dtype are packed into flat buffers of about ``bucket_mb`` MiB,
    each all-reduced in one call, then unpacked; numpy arrays of 64 KiB or more are
    reduced in place, each in a call of its own. Collective: every rank must pass the
    same list of shapes and dtypes, op and bucket_mb, and the first call checks that
    they do before any data moves (else every rank raises, and nothing is reduced).
    """
    # First: making the Communicator is collective, whatever the arguments.
    ring = _communicator(comm, "allreduce_gradients")
    where = _types.where(ring.rank, ring.size, "allreduce_gradients")
    rejected = None
    flats = []
    try:
        check_bucket_mb(bucket_mb, where)
        grads = as_list_of_arrays(grads, "grads", where, "one per parameter")
        layout = numpy_layout(grads)  # (None unless each is a plain, writeable array)
        if layout is None:
            for i, g in enumerate(grads):
                if g is None:  # (a torch parameter's grad, where backward made none)
                    raise TypeError(f"{where}: grads[{i}] is None: every rank reduces every "
                                    "gradient of its list, in one order; for a parameter "
                                    "this rank's batch did not use, give zeros; one that no "
                                    "rank trains (frozen) stays out of the list on every rank")
                _types.reject_not_an_array(g, f"grads[{i}]", where,
                                           "gradients are reduced in place")
                if isinstance(g, np.ndarray) and not g.flags.writeable:
                    raise ValueError(f"{where}: grads[{i}] is read-only")
                reject_masked(g, f"grads[{i}]", where)
            # (cupy's: the gradients of a bucket are packed into one buffer)
            the_one_gpu(grads, "grads", where, "a rank's gradients are packed together, "
                        "on one GPU: reduce each GPU's in a call of its own")
            layout = tuple([(type(g), g.shape, g.dtype) for g in grads])
        code = op_code(op, where)
        plan, check, places = _plan_and_check(grads, layout, code,
                                              int(bucket_mb * 1024 * 1024), where)
        # All packed before the first call: a rank that fails here (out of memory, say)
        # says so in that call, instead of leaving the others' later buckets unpaired.
        shared = _overlapping(grads, plan)
        flats = [_flat(grads, indices, shared, where_they_go[-1][2])
                 for indices, where_they_go in zip(plan, places)]
    except Exception as error:  # (an array-like without .flags: AttributeError, say)
        rejected, check = error, _CHECK_OF_REJECTED
    outcome = "no rank made this call's all-reduces"
    # The first bucket's call carries a hash of what must agree (a rank with no bucket,
    # or that rejected its arguments, makes an empty call instead), so agreeing costs no
    # exchange of its own. Where ranks differ, every rank raises CheckedCallsMismatch,
    # and then they take the time to find out what differs, and who.
    try:
        if flats and rejected is None:
            ring._allreduce_checked(flats[0][0], op, check)
        else:
            ring._allreduce_checked(np.empty(0, np.int64), "sum", check)
    except CollectiveTimeoutError as error:
        if rejected is not None:  # (nothing was reduced: its own error says what to mend)
            raise _types.told_in_vain(rejected, error) from None
        raise _not_completed(error, where) from error
    except CheckedCallsMismatch as error:
        texts = None if rejected is not None else [_signature(grads), OPS[code], repr(plan)]
        agree_or_raise(ring, where, _WHAT_MUST_AGREE, texts, rejected, outcome, (0, "grads"))
        if rejected is None:
            # (what the core says, where the crc32s agree after all)
            raise _as_ours(error) from None
    except MismatchError as error:
        # Some rank made another call, or rejected its arguments to this one in the
        # call itself (a plain MismatchError on every rank: none goes on to agree):
        # a rank that rejected its own says so itself, as the docs promise.
        if rejected is not None:
            raise rejected from None
        raise _as_ours(error) from None
    if rejected is not None:
        raise rejected
    # The others one after another, each once the one before is done: a call on the
    # caller's thread costs less than a hand-off to the worker thread (on 2 cores, 8 x
    # 4 KiB took 120-170 us queued against 24-40 us blocking). All of them before any
    # unpacking, so that an error there cannot leave this rank's calls short of the
    # others'.
    made = 1  # calls made; None once one of them raised (the others' call raised too)
    try:
        while made < len(flats):
            try:
                ring._allreduce_checked(flats[made][0], op, check)
            except BaseException:
                made = None
                raise
            made += 1
    except BaseException as error:
        # Raised between calls (Ctrl-C): the other ranks make the calls still to come,
        # and would pair them with this rank's next ones (they carry the same check),
        # so this rank makes them too.
        if made is not None:
            for flat, _ in flats[made:]:
                try:
                    ring._allreduce_checked(flat, op, check)
                except Exception:
                    break
        if isinstance(error, CollectiveTimeoutError):
            raise _not_completed(error, where) from error
        if isinstance(error, MismatchError):
            raise _as_ours(error) from None
        raise
    for indices, where_they_go, (flat, copied) in zip(plan, places, flats):
        if copied:
            _unpack(grads, indices, where_they_go, flat)
    return grads
