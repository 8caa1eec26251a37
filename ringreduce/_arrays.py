"""numpy or cupy, whichever an array belongs to (cupy only where installed); and the
arrays that must outlive a collective after which this rank left its communicator."""
import numpy as np

# After a call that made this rank leave the communicator (a timeout, an error in the
# ring), MPI may still read the arrays of that call (its pending sends, or device
# pointers handed to a CUDA-aware MPI) whenever a late rank comes, so they are kept
# here for good. (The core keeps the numpy arrays it was handed itself.)
_outliving: list = []


def keeping_on_departure(core, run, *arrays):
    """run(); if it raises and core's rank left the communicator meanwhile, keeps run
    (and what its closure holds) and arrays alive for as long as the process lives."""
    departed = core.departed
    try:
        return run()
    except BaseException:
        if core.departed and not departed:
            _outliving.append((run, arrays))
        raise


def not_a_list_of_arrays(items) -> bool:
    """Whether `items`, given where a list of arrays belongs (gradients, parameters), is
    one array instead (iterating a 1-D one gives numpy scalars, which cannot be written
    back in place; a 2-D one, its rows) or nothing iterable."""
    return (hasattr(items, "__array_interface__") or hasattr(items, "__cuda_array_interface__")
            or not hasattr(items, "__iter__"))


def array_module(a):
    if isinstance(a, np.ndarray):
        return np
    try:
        import cupy
    except ImportError:
        return np
    return cupy.get_array_module(a)


def plain(a):
    """a as a plain array: a view of an ndarray subclass's data (np.matrix, whose * is a
    matrix product, saved again as one), anything else as it is."""
    return a.view(np.ndarray) if isinstance(a, np.ndarray) and type(a) is not np.ndarray else a
