"""numpy or cupy, whichever an array belongs to (cupy only where installed), and the
GPU a cupy array is on; and the arrays that must outlive a collective after which this
rank left its communicator."""
import contextlib
from collections.abc import Mapping

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


def as_list_of_arrays(items, argument: str, where: str, each: str) -> list:
    """`items`, given where a list of arrays belongs (`each`: "one per parameter"), as a
    list; TypeError where it is one array instead (iterating a 1-D one gives numpy
    scalars, which cannot be written back in place; a 2-D one, its rows), nothing
    iterable, or a mapping (iterating it gives its keys). A list of its own: the caller's
    may change later."""
    if isinstance(items, Mapping):
        raise TypeError(f"{where}: {argument} must be a list of arrays ({each}), got a "
                        f"{type(items).__name__}; "
                        f"pass its arrays in an order every rank shares, e.g. [{argument}[k] "
                        f"for k in sorted({argument})] (arrays of one shape in another order "
                        "would mix unnoticed)")
    if (hasattr(items, "__array_interface__") or hasattr(items, "__cuda_array_interface__")
            or not hasattr(items, "__iter__")):
        raise TypeError(f"{where}: {argument} must be a list of arrays ({each}), got "
                        f"{type(items).__name__}; for one array {argument[0]}, pass [{argument[0]}]")
    return list(items)


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


# cupy makes new arrays, and runs kernels, on the thread's current GPU, not on the GPU
# of the arrays they come from: a model made under `with cupy.cuda.Device(1)` and
# stepped outside it got its optimizer state and buckets on GPU 0, and then cupy raised
# (GPUs without peer access), or read across the bus. So whatever ringreduce makes or
# computes for an array is made under on_gpu_of(it).
_NOWHERE = contextlib.nullcontext()


def gpu_of(a) -> int | None:
    """The GPU a cupy array lives on; None for a host array (or anything not cupy's)."""
    if isinstance(a, np.ndarray) or not hasattr(a, "__cuda_array_interface__"):
        return None
    return a.device.id if array_module(a) is not np else None


def on_gpu(gpu: int | None):
    """A context in which cupy allocates and computes on GPU `gpu` (a fresh Device each
    time: cupy's keeps the GPU to go back to in the object, so one shared between
    threads would hand one thread's to another); for None (host arrays), nothing."""
    if gpu is None:
        return _NOWHERE
    import cupy
    return cupy.cuda.Device(gpu)


def on_gpu_of(a):
    """on_gpu() of the GPU a lives on."""
    return on_gpu(gpu_of(a))


def copy_where_it_is(a):
    """a.copy() on a's own GPU (cupy's copy() copies to the current one)."""
    with on_gpu_of(a):
        return a.copy()


def the_one_gpu(arrays, name: str, who: str, why: str) -> int | None:
    """The GPU of the cupy arrays among arrays (None for none), or a ValueError naming
    the first (called name[i]) that is on another GPU than the first; why: why they
    must share one."""
    first = None
    for i, a in enumerate(arrays):
        gpu = gpu_of(a)
        if gpu is None:
            continue
        if first is None:
            first = i, gpu
        elif gpu != first[1]:
            raise ValueError(f"{who}: {name}[{i}] is on GPU {gpu}, but {name}[{first[0]}] is "
                             f"on GPU {first[1]}; {why}")
    return None if first is None else first[1]
