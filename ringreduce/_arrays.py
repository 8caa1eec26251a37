"""numpy or cupy, whichever an array belongs to (cupy only where installed)."""
import numpy as np


def array_module(a):
    if isinstance(a, np.ndarray):
        return np
    try:
        import cupy
    except ImportError:
        return np
    return cupy.get_array_module(a)
