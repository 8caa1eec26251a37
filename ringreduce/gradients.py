"""rr.allreduce_gradients: average a list of gradient arrays across ranks, in place,
packed into a few large all-reduces instead of one small call per array."""
from __future__ import annotations

import numpy as np

from ._arrays import array_module

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


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
        raise ValueError(f"{who}: bucket_mb must be a number of megabytes > 0, got {bucket_mb!r}")


def allreduce_gradients(grads, op: str = "avg", comm=None, bucket_mb: float = 25.0):
    """Reduce every array in ``grads`` across ranks, in place; returns ``grads``.

    Arrays of one dtype are packed into flat buffers of about ``bucket_mb`` MB, each
    all-reduced in one call (all in flight at once), then unpacked.
    """
    from ._shortcuts import _communicator

    check_bucket_mb(bucket_mb, "allreduce_gradients")
    ring = _communicator(comm)
    grads = list(grads)
    for i, g in enumerate(grads):
        if not hasattr(g, "shape") or not hasattr(g, "dtype"):
            raise TypeError(f"allreduce_gradients: grads[{i}] is a {type(g).__name__}, "
                            "not an array")
        if array_module(g) is np and not g.flags.writeable:
            raise ValueError(f"allreduce_gradients: grads[{i}] is read-only")
    pending = []
    for indices in pack_plan(grads, int(bucket_mb * 1024 * 1024)):
        xp = array_module(grads[indices[0]])
        flat = xp.concatenate([grads[i].reshape(-1) for i in indices])
        pending.append((indices, flat, ring.allreduce_async(flat, op=op, out=flat)))
    for indices, flat, handle in pending:
        handle.wait()
        offset = 0
        for i in indices:
            g = grads[i]
            g[...] = flat[offset:offset + g.size].reshape(g.shape)
            offset += g.size
    return grads
