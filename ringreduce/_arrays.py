"""numpy or cupy, whichever an array belongs to (cupy only where installed); and the
arrays that must outlive a collective that timed out."""
import numpy as np

from . import _core

# After a timeout, MPI may still read the arrays of the call that gave up (its pending
# sends, or device pointers handed to a CUDA-aware MPI) whenever the late rank comes,
# so they are kept here for good. (The core keeps the numpy arrays it was handed itself.)
_outliving: list = []


def keeping_on_timeout(run, *arrays):
    """run(); if it raises CollectiveTimeoutError, keeps run (and what its closure
    holds) and arrays alive for as long as the process lives."""
    try:
        return run()
    except _core.CollectiveTimeoutError:
        _outliving.append((run, arrays))
        raise


def array_module(a):
    if isinstance(a, np.ndarray):
        return np
    try:
        import cupy
    except ImportError:
        return np
    return cupy.get_array_module(a)
