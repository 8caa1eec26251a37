"""allreduce_gradients' helpers in the core, one process: pack_gradients() and
unpack_gradients() (memcpy of the common case, False for anything else, with nothing
copied) and numpy_layout() (the key to its cache of plans); and grad_ready()'s
copy_gradient() (the same for one gradient and its place in a bucket)."""
import ctypes
import pickle

import numpy as np
import pytest

from ringreduce import _core
from ringreduce.gradients import byte_bounds, pack_plan, span_of


def arrays():
    return [np.arange(6, dtype=np.float32).reshape(2, 3), np.full((), -1, np.float32),
            np.zeros(0, np.float32), np.arange(10, 14, dtype=np.float32)]


def test_pack_and_unpack_copy_the_arrays_in_the_order_given():
    grads = arrays()
    order = [3, 0, 2, 1]
    flat = np.full(11, np.nan, np.float32)
    assert _core.pack_gradients(grads, order, flat) is True
    np.testing.assert_array_equal(flat, np.concatenate([grads[i].ravel() for i in order]))
    flat *= 2
    assert _core.unpack_gradients(flat, grads, order) is True
    np.testing.assert_array_equal(grads[0], np.arange(6).reshape(2, 3) * 2)
    np.testing.assert_array_equal(grads[1], -2)
    np.testing.assert_array_equal(grads[3], np.arange(10, 14) * 2)
    assert grads[0].shape == (2, 3) and grads[1].shape == ()


def test_a_subset_of_the_list_is_packed_and_the_rest_left_alone():
    grads = arrays()
    flat = np.empty(10, np.float32)
    assert _core.pack_gradients(grads, [0, 3], flat)
    flat[:] = 7
    assert _core.unpack_gradients(flat, grads, [0, 3])
    assert (grads[0] == 7).all() and (grads[3] == 7).all() and grads[1] == -1


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (np.matrix's own)
def test_subclasses_and_equal_dtypes_spelt_differently_are_packed():
    grads = [np.matrix([[1, 2], [3, 4]], dtype=np.int64), np.array([5], dtype="q"),
             np.array([6], dtype="l")]
    flat = np.empty(6, np.int64)
    assert _core.pack_gradients(grads, [0, 1, 2], flat)
    assert flat.tolist() == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("case", [
    "strided", "fortran", "other dtype", "byte-swapped", "swapped flat", "short flat",
    "long flat", "2-d flat", "strided flat", "read-only flat", "object", "index past the end",
    "negative index", "index not an int", "huge index", "grads a tuple", "indices a tuple",
    "not an array", "flat not an array"])
def test_anything_but_the_common_case_copies_nothing(case):
    grads = [np.arange(4, dtype=np.float64), np.arange(4, 8, dtype=np.float64)]
    indices = [0, 1]
    flat = np.full(8, -1.0)
    if case == "strided":
        grads[1] = np.arange(8, dtype=np.float64)[::2]
    elif case == "fortran":
        grads[1] = np.asfortranarray(np.arange(4, dtype=np.float64).reshape(2, 2))
    elif case == "other dtype":
        grads[1] = grads[1].astype(np.int64)
    elif case == "byte-swapped":
        grads[1] = grads[1].astype(">f8" if np.little_endian else "<f8")
    elif case == "swapped flat":
        flat = flat.astype(">f8" if np.little_endian else "<f8")
        grads = [g.astype(flat.dtype) for g in grads]
    elif case == "short flat":
        flat = flat[:7]
    elif case == "long flat":
        flat = np.full(9, -1.0)
    elif case == "2-d flat":
        flat = flat.reshape(2, 4)
    elif case == "strided flat":
        flat = np.full(16, -1.0)[::2]
    elif case == "read-only flat":
        flat.flags.writeable = False
    elif case == "object":
        grads = [g.astype(object) for g in grads]
        flat = flat.astype(object)
    elif case == "index past the end":
        indices = [0, 2]
    elif case == "negative index":
        indices = [0, -1]
    elif case == "index not an int":
        indices = [0, 1.0]
    elif case == "huge index":
        indices = [0, 1 << 80]
    elif case == "grads a tuple":
        grads = tuple(grads)
    elif case == "indices a tuple":
        indices = (0, 1)
    elif case == "not an array":
        grads[1] = [4.0, 5.0, 6.0, 7.0]
    elif case == "flat not an array":
        flat = [-1.0] * 8
    before = [np.array(g, copy=True) for g in grads]
    flat_before = list(np.asarray(flat, dtype=object).ravel())
    assert _core.pack_gradients(grads, indices, flat) is False
    assert list(np.asarray(flat, dtype=object).ravel()) == flat_before
    if not isinstance(flat, np.ndarray) or flat.flags.writeable:
        assert _core.unpack_gradients(flat, grads, indices) is False
    for g, b in zip(grads, before):
        np.testing.assert_array_equal(g, b)


def test_unpack_copies_nothing_where_one_array_is_read_only():
    grads = arrays()
    grads[3].flags.writeable = False
    flat = np.ones(11, np.float32)
    assert _core.pack_gradients(grads, [0, 1, 2, 3], flat)  # (reading is fine)
    flat[:] = 9
    assert _core.unpack_gradients(flat, grads, [0, 1, 2, 3]) is False
    assert (grads[0] != 9).all()


def places(*shapes, dtype=np.float64):
    """Parameters of these shapes, and each one's place (its target) in one flat
    buffer, as DistributedOptimizer's buckets make them; and the buffer."""
    params = [np.zeros(shape, dtype) for shape in shapes]
    flat = np.full(sum(p.size for p in params), -1, dtype)
    targets, offset = [], 0
    for p in params:
        targets.append(flat[offset:offset + p.size].reshape(p.shape))
        offset += p.size
    return params, targets, flat


@pytest.mark.parametrize("nbytes", [0, 8, 1000, 64 << 10, (1 << 20) + 8])
def test_copy_gradient_copies_a_gradient_into_its_place_alone(nbytes):
    # (From 64 KiB the copy runs without the GIL.)
    params, targets, flat = places(5, nbytes // 8, (2, 3))
    grad = np.random.default_rng(1).standard_normal(nbytes // 8)
    assert _core.copy_gradient(params, targets, 1, grad) is True
    np.testing.assert_array_equal(targets[1], grad)
    assert (targets[0] == -1).all() and (targets[2] == -1).all()
    matrix = np.arange(6.0).reshape(2, 3)
    assert _core.copy_gradient(params, targets, 2, matrix) is True
    np.testing.assert_array_equal(flat[-6:], np.arange(6.0))


def test_copy_gradient_copies_an_overlapping_gradient_as_numpy_assigns_it():
    # (A gradient that is a view of the bucket itself: the averages of a step before.)
    params, targets, flat = places(4, 4)
    flat[:] = np.arange(8.0)
    expected = flat.copy()
    expected[4:] = expected[2:6]  # (numpy copies as if through a temporary)
    assert _core.copy_gradient(params, targets, 1, flat[2:6]) is True
    np.testing.assert_array_equal(flat, expected)
    assert _core.copy_gradient(params, targets, 1, targets[1]) is True  # (itself)
    np.testing.assert_array_equal(flat, expected)


def test_copy_gradient_takes_a_read_only_gradient_and_equal_dtypes_spelt_differently():
    params, targets, _ = places(3, dtype=np.int64)
    grad = np.array([1, 2, 3], dtype="q" if np.dtype("q") == np.int64 else "l")
    grad.flags.writeable = False
    assert _core.copy_gradient(params, targets, 0, grad) is True
    assert targets[0].tolist() == [1, 2, 3]


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (np.matrix's own)
@pytest.mark.parametrize("case", [
    "strided", "fortran", "other dtype", "byte-swapped", "other shape", "same size, other shape",
    "a subclass", "a masked array", "not an array", "a bool index", "a numpy index",
    "a float index", "negative index", "index past the end", "huge index", "no target",
    "target of another shape", "read-only target", "strided target", "target a subclass",
    "object", "params a tuple", "targets a tuple", "param reshaped since",
    "fewer dimensions", "param of as many dimensions, other shape",
    "target of as many dimensions, other shape", "targets shorter than params"])
def test_copy_gradient_copies_nothing_but_the_common_case(case):
    params, targets, flat = places((2, 2), (2, 2))
    index, grad = 1, np.arange(4.0).reshape(2, 2)
    if case == "strided":
        grad = np.arange(8.0).reshape(2, 4)[:, ::2]
    elif case == "fortran":
        grad = np.asfortranarray(grad)
    elif case == "other dtype":
        grad = grad.astype(np.float32)
    elif case == "byte-swapped":
        grad = grad.astype(">f8" if np.little_endian else "<f8")
    elif case == "other shape":
        grad = np.arange(6.0).reshape(2, 3)
    elif case == "same size, other shape":
        grad = grad.reshape(4, 1)
    elif case == "a subclass":
        grad = np.matrix(grad)
    elif case == "a masked array":
        grad = np.ma.masked_array(grad, mask=[[1, 0], [0, 0]])
    elif case == "not an array":
        grad = grad.tolist()
    elif case == "a bool index":
        index = True
    elif case == "a numpy index":
        index = np.int64(1)
    elif case == "a float index":
        index = 1.0
    elif case == "negative index":
        index = -1
    elif case == "index past the end":
        index = 2
    elif case == "huge index":
        index = 1 << 80
    elif case == "no target":
        targets[1] = None
    elif case == "target of another shape":
        targets[1] = targets[1].reshape(4)
    elif case == "read-only target":
        targets[1].flags.writeable = False
    elif case == "strided target":
        targets[1] = np.full((2, 4), -1.0)[:, ::2]
    elif case == "target a subclass":
        targets[1] = np.matrix(targets[1])
    elif case == "object":
        params = [p.astype(object) for p in params]
        targets = [t.astype(object) for t in targets]
        grad = grad.astype(object)
    elif case == "params a tuple":
        params = tuple(params)
    elif case == "targets a tuple":
        targets = tuple(targets)
    elif case == "param reshaped since":
        params[1].shape = (4,)
    # (Each dimension is compared, not the count or the size alone: a (2,) gradient's one
    # dimension is the (2, 2) parameter's first.)
    elif case == "fewer dimensions":
        grad = np.arange(2.0)
    elif case == "param of as many dimensions, other shape":
        params[1].shape = (1, 4)
    elif case == "target of as many dimensions, other shape":
        targets[1] = targets[1].reshape(1, 4)
    elif case == "targets shorter than params":
        # (CPython keeps the popped item's pointer past the list's end, where 4 appends
        # made room for 4: read there, it is a live target of the right shape.)
        params, targets, flat = places((2, 2), (2, 2), (2, 2), (2, 2))
        index, popped = 3, targets.pop()  # (popped, a view of flat, checked below)
    before = [None if t is None else np.array(t, copy=True) for t in targets]
    flat_before = flat.copy()
    assert _core.copy_gradient(params, targets, index, grad) is False
    for t, b in zip(targets, before):
        np.testing.assert_array_equal(t, b)
    np.testing.assert_array_equal(flat, flat_before)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (np.matrix's own)
def test_numpy_layout_tells_layouts_apart_and_names_equal_ones_alike():
    a, b = np.zeros((2, 3)), np.zeros(6)
    key = _core.numpy_layout([a, b])
    assert isinstance(key, bytes)
    assert _core.numpy_layout([np.ones((2, 3)), np.ones(6)]) == key
    for other in ([b, a], [a], [a, b, b], [a, np.zeros(6, np.float32)], [a, np.zeros(7)],
                  [np.zeros((3, 2)), b], [a, np.zeros((6, 1))], [np.zeros((2, 3, 1)), b]):
        assert _core.numpy_layout(other) != key
    # (The dimensions' count comes first: (2, 3) then (4,) is not (2,) then (3, 4).)
    assert _core.numpy_layout([np.zeros((2, 3)), np.zeros(4)]) != \
        _core.numpy_layout([np.zeros(2), np.zeros((3, 4))])
    assert _core.numpy_layout([]) == b""


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (np.matrix's own)
def test_numpy_layout_is_none_unless_every_one_is_a_plain_writeable_numpy_array():
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    assert _core.numpy_layout([np.zeros(3), read_only]) is None
    assert _core.numpy_layout([np.zeros(3), [1.0]]) is None
    # (Subclasses too: a masked array's mask is for the caller to look at.)
    assert _core.numpy_layout([np.zeros(3), np.ma.masked_array(np.zeros(3))]) is None
    assert _core.numpy_layout([np.asmatrix(np.zeros((2, 3)))]) is None
    assert _core.numpy_layout((np.zeros(3),)) is None
    assert _core.numpy_layout(np.zeros(3)) is None


def test_numpy_layout_names_equal_dtype_objects_alike():
    # numpy makes dtype objects equal to its own anew (unpickled arrays, ctypes', ones with
    # metadata): keyed by their own addresses, gradients made afresh each step would miss
    # the plan cache on every call. Those it cannot name by numpy's own: None (the caller
    # then keys by the dtypes' equality).
    a = np.zeros((2, 3), np.float32)
    key = _core.numpy_layout([a])
    for same in (pickle.loads(pickle.dumps(a)),
                 np.ctypeslib.as_array((ctypes.c_float * 3 * 2)()),
                 np.zeros((2, 3), np.dtype(np.float32, metadata={"m": 1}))):
        assert same.dtype is not a.dtype and _core.numpy_layout([same]) == key
    for other in (np.zeros((2, 3), ">f4" if np.little_endian else "<f4"),
                  np.zeros((2, 3), "M8[s]"), np.zeros((2, 3), "V4"), np.zeros((2, 3), "U1"),
                  np.zeros((2, 3), [("x", np.float32)])):
        assert _core.numpy_layout([other]) is None, other.dtype


def test_pack_plan_fills_a_bucket_to_exactly_its_size():
    # (From a review.) A bucket takes arrays up to bucket_bytes, that many included:
    # two 32-byte arrays fill a 64-byte bucket, and each goes alone in a 63-byte one.
    two = [np.zeros(4), np.zeros(4)]  # (32 bytes each)
    assert pack_plan(two, 64) == [[1, 0]]
    assert pack_plan(two, 63) == [[1], [0]]
    assert pack_plan(two + [np.zeros(4)], 64) == [[2, 1], [0]]
    assert pack_plan([np.zeros(8), np.zeros(4)], 64) == [[1], [0]]  # (32 + 64 > 64)


class _GpuArrayLike:
    """A GPU array as span_of() reads it: its __cuda_array_interface__ alone."""

    def __init__(self, like: np.ndarray):
        self.__cuda_array_interface__ = {
            "data": (like.ctypes.data, False), "shape": like.shape,
            "typestr": like.dtype.str, "version": 3,
            "strides": None if like.flags.c_contiguous else like.strides}


VIEWS = {"contiguous": lambda a: a, "reversed": lambda a: a[::-1],
         "every other, backwards": lambda a: a[50:3:-2],
         "rows reversed": lambda a: a.reshape(6, 10)[::-1, 2:7],
         "columns backwards": lambda a: a.reshape(6, 10)[1:5, ::-3],
         "transposed, reversed": lambda a: a.reshape(6, 10).T[::-1],
         "empty": lambda a: a[7:7]}


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_span_of_a_gpu_array_is_what_numpy_finds_for_the_same_strides(view):
    # A GPU array's span (which gradients it may share memory with) comes from its
    # shape and strides, and must reach as far as numpy's byte_bounds does for a host
    # array laid out alike: negative strides reach down from the first element.
    host = VIEWS[view](np.zeros(60))
    lo, hi = byte_bounds(host)
    assert span_of(_GpuArrayLike(host)) == ((lo, lo) if host.size == 0 else (lo, hi))
