"""Bad input gets a clear error naming the argument, the value and the rank; ranks
that disagree all raise MismatchError; and the communicator stays usable after."""
import gc
import re
import time
import warnings
from unittest import mock

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import reference
from ringreduce.reference import segment_bounds
from ringreduce.optim import SGD, DistributedOptimizer

from helpers import NumpyWithoutMemory, TorchTensor as Tensor

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
needs_two = pytest.mark.skipif(SIZE < 2, reason="needs at least two ranks to disagree")


def still_works(comm):
    x = np.arange(7.0) + RANK
    np.testing.assert_allclose(comm.allreduce(x), SIZE * np.arange(7.0) + SIZE * (SIZE - 1) / 2)


def test_unknown_op_names_it_and_the_valid_ones(comm):
    with pytest.raises(ValueError) as info:
        comm.allreduce(np.ones(3), op="mean")
    message = str(info.value)
    assert "'mean'" in message and f"rank {RANK} of {SIZE}" in message
    for name in ("'sum'", "'prod'", "'min'", "'max'", "'avg'"):
        assert name in message
    for bad in (None, 3, "su"):  # (any ValueError passed, from a review)
        with pytest.raises(ValueError, match=rf"op {re.escape(repr(bad))} is not one of"):
            comm.allreduce(np.ones(3), op=bad)
    # mpi4py's ops by name (their repr is an address), and the ones that work
    with pytest.raises(ValueError, match=r"op MPI.LAND is not one of .* \(or MPI.SUM, MPI.PROD"
                                         r".*MPI.LAND is taken for bool arrays only \(where "
                                         r"it is op='min'\), and x has dtype float64$"):
        comm.allreduce(np.ones(3), op=MPI.LAND)
    flags = [np.ones(3, bool)]  # (allreduce_gradients takes op names before the arrays)
    with pytest.raises(ValueError, match=r"MPI.LOR is taken .* by the collectives: here, "
                                         r"pass op='max', which on bools is the same$"):
        rr.allreduce_gradients(flags, op=MPI.LOR, comm=comm)
    rr.allreduce_gradients(flags, op="max", comm=comm)
    assert flags[0].all()
    for op in (MPI.LXOR, MPI.BXOR, MPI.MAXLOC):  # (no kernel for these, bools or not)
        with pytest.raises(ValueError, match=r"is not one of .*MPI.BAND\)$"):
            comm.allreduce(np.ones(3, bool), op=op)
    still_works(comm)


def test_user_defined_mpi_ops_and_minloc_are_refused_by_name(comm):
    # api.md, Coming from mpi4py: "No user-defined MPI.Op, MPI.MAXLOC/MINLOC or MPI.LXOR".
    # (An Op's repr is an address: the message says what it is instead.)
    mine = MPI.Op.Create(lambda a, b, datatype: None, commute=True)
    try:
        for op, shown in ((mine, r"\(a user-defined MPI.Op\)"), (MPI.MINLOC, "MPI.MINLOC")):
            for x in (np.ones(3), np.ones(3, bool)):
                with pytest.raises(ValueError, match=rf"^ringreduce\.allreduce \(rank {RANK} of "
                                                     rf"{SIZE}\): op {shown} is not one of"):
                    comm.allreduce(x, op=op)
    finally:
        mine.Free()
    # MPI.OP_NULL (what a freed Op becomes) is no op at all, not a user-defined one.
    for op in (MPI.OP_NULL, mine):
        with pytest.raises(ValueError, match=rf"^ringreduce\.allreduce \(rank {RANK} of "
                                             rf"{SIZE}\): op MPI\.OP_NULL is not one of"):
            comm.allreduce(np.ones(3), op=op)
    still_works(comm)


def test_what_a_program_ported_from_mpi4py_passes_is_refused_saying_what_to_pass(comm):
    # (From a review.) numpy read MPI.IN_PLACE and MPI.BOTTOM as empty arrays: a result
    # of no elements, with no error. Buffer specs and out= in op's place got numpy's or
    # the op check's words, which did not say what to write instead.
    x = np.arange(4.0)
    in_place = "is MPI.IN_PLACE, which ringreduce does not take: for a call in place pass the " \
               r"buffer as both x and out \(comm.allreduce(_async)?\(buf, out=buf\)\)"
    for call, said in [
            (lambda: comm.allreduce(MPI.IN_PLACE), "x " + in_place),
            (lambda: rr.allreduce(MPI.IN_PLACE), "x " + in_place),
            (lambda: comm.allreduce_async(MPI.IN_PLACE), "x " + in_place),
            (lambda: comm.allreduce(MPI.BOTTOM), "x is MPI.BOTTOM"),
            (lambda: comm.allreduce(x, out=MPI.IN_PLACE), "out " + in_place),
            (lambda: comm.allreduce([x, MPI.DOUBLE]), r"x is an mpi4py buffer spec \(\[buf, "
                                                      r"MPI.FLOAT\], say\), which ringreduce "
                                                      "does not take: pass the array itself"),
            (lambda: comm.allreduce((x, 4, MPI.DOUBLE)), "x is an mpi4py buffer spec"),
            (lambda: comm.allreduce(x, np.empty(4)), r"op is an array: the second argument is "
                                                     "op; pass the result's buffer as out="),
            (lambda: comm.allreduce(x, np.empty(4), MPI.SUM), "op is an array")]:
        with pytest.raises(TypeError, match=r"^ringreduce\.\w+ \(rank \d+ of \d+\): " + said):
            call()
    assert comm.allreduce(x)[1] == SIZE  # (every rank raised: the next call pairs up)


def test_what_is_said_instead_of_in_place_or_of_out_as_op_is_the_calls_own_way(comm):
    # (Helper 239.) Both hints gave allreduce's way whatever the call: reduce_scatter(buf,
    # out=buf), as told, raised again (out is the block's shape), and allreduce_gradients
    # and the reference, told to pass out=..., take none.
    x = np.arange(4.0 * SIZE) + RANK
    lo, hi = segment_bounds(x.size, SIZE)[RANK]
    rows = r"\(comm\.allgather{}\(buf\[lo:hi\], out=buf\), lo, hi: the rows"
    for call, kind, said in [
            (lambda: comm.reduce_scatter(MPI.IN_PLACE), TypeError,
             r"x is MPI\.IN_PLACE, which ringreduce does not take: for a call in place pass "
             r"the buffer as x and this rank's block of it as out \(comm\.reduce_scatter\("
             r"buf, out=buf\[lo:hi\]\), lo, hi = ringreduce\.reference\.segment_bounds\("
             r"buf\.size, comm\.size\)\[comm\.rank\]\)"),
            (lambda: comm.reduce_scatter_async(x, out=MPI.IN_PLACE), TypeError,
             r"out is MPI\.IN_PLACE, .* \(comm\.reduce_scatter_async\(buf, out=buf\[lo:hi\]\)"),
            (lambda: comm.allgather(MPI.IN_PLACE, out=x), TypeError,
             r"x is MPI\.IN_PLACE, which ringreduce does not take: for a call in place pass "
             r"out's own block of rows as x " + rows.format("")),
            (lambda: comm.allgather_async(MPI.IN_PLACE), TypeError, rows.format("_async")),
            (lambda: comm.allreduce_async(MPI.IN_PLACE), TypeError,
             r"pass the buffer as both x and out \(comm\.allreduce_async\(buf, out=buf\)\)"),
            (lambda: comm.reduce_scatter(x, np.empty(hi - lo)), TypeError,
             r"op is an array: the second argument is op; pass the result's buffer as "
             r"out=\.\.\. \(comm\.reduce_scatter\(x, out=buf\)\)"),
            (lambda: comm.reduce_scatter_async(x, np.empty(hi - lo)), TypeError,
             r"\(comm\.reduce_scatter_async\(x, out=buf\)\)"),
            (lambda: rr.allreduce_gradients([x.copy()], np.empty(1), comm=comm), TypeError,
             r"op is an array: the second argument is op \(ringreduce\.allreduce_gradients "
             r"takes no out=\)$"),
            (lambda: reference.allreduce(x, np.empty(1)), TypeError,
             r"op is an array: the second argument is op \(ringreduce\.reference\.allreduce "
             r"takes no out=\)$")]:
        with pytest.raises(kind, match=r"^ringreduce\.[\w.]+( \(rank \d+ of \d+\))?: .*" + said):
            call()
    # What they say works.
    buf = x.copy()
    assert comm.reduce_scatter(buf, out=buf[lo:hi]) is not None
    np.testing.assert_array_equal(buf[lo:hi], reference.reduce_scatter(x))
    rows_before = 2 * RANK
    buf = np.zeros(2 * SIZE)
    buf[rows_before:rows_before + 2] = RANK
    comm.allgather(buf[rows_before:rows_before + 2], out=buf)
    np.testing.assert_array_equal(buf, np.repeat(np.arange(float(SIZE)), 2))


def test_an_out_of_mpi4pys_layouts_is_refused_saying_what_takes_it(comm):
    # (From the same review.) mpi4py takes any buffer of as many elements, a Fortran
    # array in place, and a (size, n) Allgather buffer; the errors now say what does here.
    x = np.arange(6.0)
    with pytest.raises(ValueError, match=r"expected \(6,\); of as many elements, "
                                         r"out.reshape\(\(6,\)\) is a view that takes it"):
        comm.allreduce(x, out=np.empty((2, 3)))
    block = comm.reduce_scatter(np.arange(4.0 * SIZE)).shape  # (out's shape, not x's)
    with pytest.raises(ValueError, match=rf"out.reshape\({re.escape(str(block))}\)"):
        comm.reduce_scatter(np.arange(4.0 * SIZE), out=np.empty((2, 2)))
    fortran = np.asfortranarray(np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"to reduce a Fortran-ordered array in place, pass "
                                         r"its transpose, which is C-contiguous, as x and out"):
        comm.allreduce(fortran, out=fortran)
    assert comm.allreduce(fortran.T, out=fortran.T) is not None and (fortran == SIZE).all()
    with pytest.raises(ValueError, match=r"for a \(ranks, n\) result from 1-D x, gather "
                                         r"x\[np.newaxis\]"):
        comm.allgather(np.ones(3), out=np.empty((SIZE, 3)))
    np.testing.assert_array_equal(comm.allgather(np.ones(3)[np.newaxis]), np.ones((SIZE, 3)))
    with pytest.raises(TypeError, match=r"got bytearray; np.frombuffer\(x, np.uint8\) is a "
                                        "writeable array over its bytes"):
        comm.broadcast(bytearray(8))


def test_op_names_are_case_insensitive_and_mpi_ops_work(comm):
    x = np.arange(4.0)
    np.testing.assert_array_equal(comm.allreduce(x, op="MAX"), x)
    np.testing.assert_array_equal(comm.allreduce(x, op=MPI.MIN), x)


@pytest.mark.parametrize("x", [np.array([b"a", b"b"]), np.array(["a", "b"]),
                               np.array([object()]), np.ones(2, np.longdouble),
                               np.array([1, 2], "datetime64[s]")],
                         ids=["bytes", "str", "object", "longdouble", "datetime"])
def test_unsupported_dtype_names_it_and_the_supported_ones(x, comm):
    with pytest.raises(TypeError) as info:
        comm.allreduce(x)
    message = str(info.value)
    assert str(x.dtype) in message and "float32" in message and "int8" in message
    assert f"rank {RANK}" in message
    still_works(comm)


def test_the_errors_of_the_library_are_the_built_in_kinds_api_md_names(comm):
    # So that `except RuntimeError` and `except TimeoutError` catch them.
    assert issubclass(rr.MismatchError, RuntimeError)
    assert issubclass(rr.MPIError, RuntimeError)
    assert issubclass(rr.CollectiveTimeoutError, TimeoutError)
    assert issubclass(rr.UnsupportedOpError, TypeError)
    assert issubclass(rr.UnsupportedOpError, ValueError)
    if SIZE > 1:
        with pytest.raises(RuntimeError) as info:
            comm.allreduce(np.ones(3 + RANK))
        assert type(info.value) is rr.MismatchError
    still_works(comm)


@pytest.mark.parametrize("dtype,op", [(np.complex64, "min"), (np.complex128, "max"),
                                      (np.int32, "avg"), (np.uint8, "avg"), (np.bool_, "avg")])
def test_op_without_meaning_for_the_dtype(dtype, op, comm):
    with pytest.raises(TypeError, match=op) as info:
        comm.allreduce(np.ones(3, dtype), op=op)
    assert isinstance(info.value, ValueError) and isinstance(info.value, rr.UnsupportedOpError)
    assert np.dtype(dtype).name in str(info.value)
    with pytest.raises(rr.UnsupportedOpError, match=np.dtype(dtype).name):
        comm.reduce_scatter(np.ones(3, dtype), op=op)
    still_works(comm)


def test_bad_out_says_what_is_wrong(comm):
    x = np.ones((4, 5), np.float32)
    cases = [
        (np.empty((5, 4), np.float32), ValueError, "shape"),
        (np.empty((4, 5), np.float64), TypeError, "dtype"),
        (np.empty((5, 8), np.float32)[:4, :5], ValueError, "contiguous"),
        (np.empty((4, 5), np.float32, order="F"), ValueError, "contiguous"),
        ([[0.0] * 5] * 4, TypeError, "ndarray"),
    ]
    readonly = np.empty((4, 5), np.float32)
    readonly.flags.writeable = False
    cases.append((readonly, ValueError, "read-only"))
    for out, error, word in cases:
        with pytest.raises(error, match=word) as info:
            comm.allreduce(x, out=out)
        assert f"rank {RANK}" in str(info.value) and "out" in str(info.value)
    still_works(comm)


@pytest.mark.parametrize("n", [8, 100_000])
def test_a_read_only_x_in_place_is_refused_after_the_fast_path_has_seen_its_kind(n, comm):
    # (From a review: a mutant of the FastPath's own check survived.) The first call of
    # a dtype and op takes the general path, which refuses it; the later ones went
    # through the FastPath, whose check no test reached: written there, the read-only
    # array would have been overwritten.
    comm.allreduce(np.ones(n))  # (float64 sums seen: the FastPath takes the next)
    x = np.ones(n)
    x.flags.writeable = False
    for call in (comm.allreduce, comm.allreduce_async):
        with pytest.raises(ValueError, match=r"out is read-only"):
            call(x, out=x)
        assert (x == 1).all()
    still_works(comm)


def test_gpu_like_arrays_get_a_clear_error(comm):
    class FakeDeviceArray:
        __cuda_array_interface__ = {"shape": (3,), "typestr": "<f4", "data": (0, False),
                                    "version": 3}

    with pytest.raises(TypeError, match="GPU"):
        comm.allreduce(FakeDeviceArray())
    still_works(comm)


@needs_two
@pytest.mark.parametrize("call", ["allreduce", "allreduce_async"])
@pytest.mark.parametrize("what", ["count", "dtype", "op"])
def test_ranks_that_disagree_all_raise_mismatch(what, call, comm):
    count = 10 + (RANK if what == "count" else 0)
    dtype = np.float64 if (what == "dtype" and RANK == SIZE - 1) else np.float32
    op = "max" if (what == "op" and RANK == 0) else "sum"
    with pytest.raises(rr.MismatchError) as info:
        if call == "allreduce":
            comm.allreduce(np.ones(count, dtype), op=op)
        else:
            handle = comm.allreduce_async(np.ones(count, dtype), op=op)
            try:
                handle.wait()
            except rr.MismatchError as first:  # every wait raises the same error
                with pytest.raises(rr.MismatchError) as again:
                    handle.wait()
                assert again.value is first
                raise
    message = str(info.value)
    # (The core names the collective it ran, allreduce; the error, the call made.)
    assert message.startswith(f"ringreduce.{call}: ranks disagree (raised on rank {RANK} "
                              f"of {SIZE}): "), message
    assert what in message
    if what == "count":
        assert "10 on rank 0" in message and f"{10 + SIZE - 1} on rank {SIZE - 1}" in message
    if what == "dtype":
        assert "float64 on rank" in message and "float32 on rank" in message
    if what == "op":
        assert "'max' on rank 0" in message and "'sum' on rank" in message
    still_works(comm)


@needs_two
@pytest.mark.parametrize("path", ["fast", "general"])
@pytest.mark.parametrize("call", ["allreduce", "allreduce_async"])
def test_what_out_holds_after_a_mismatch(call, path):
    # docs/api.md: a call that fails before any data moves leaves out= as it was, but for
    # an allreduce of a strided (or byte-swapped) x, which is copied straight into out=
    # first: out= then holds that copy of x, not the result.
    with rr.Communicator() as ring:
        if path == "general":
            ring._fast = None
        ring.allreduce(np.ones(4))  # (validates float64 and "sum" for the FastPath)
        n = 8 + RANK
        for what, x in (("contiguous", np.arange(n, dtype=np.float64)),
                        ("strided", np.arange(2.0 * n)[::2]),
                        ("byte-swapped", np.arange(n, dtype=np.float64).astype(">f8"))):
            out = np.full(n, -1.0)
            with pytest.raises(rr.MismatchError, match="count"):
                if call == "allreduce":
                    ring.allreduce(x, out=out)
                else:
                    ring.allreduce_async(x, out=out).wait()
            want = np.full(n, -1.0) if what == "contiguous" else x.astype(np.float64)
            assert np.array_equal(out, want), (what, out)
        still_works(ring)


@needs_two
def test_an_async_error_keeps_the_exception_the_caller_was_handling(comm):
    # wait() puts allreduce_async in the core's error's place; a wait() made while the
    # caller handles an exception of its own must still chain to it, as any raise does
    # ("During handling of the above exception ..."), on the first wait and later ones.
    handle = comm.allreduce_async(np.ones(3 + RANK))
    for _ in range(2):
        try:
            raise KeyError("the caller's own")
        except KeyError as own:
            with pytest.raises(rr.MismatchError, match=r"^ringreduce\.allreduce_async: ") as info:
                handle.wait()
            assert info.value.__context__ is own
            assert not info.value.__suppress_context__
    still_works(comm)


@needs_two
def test_small_and_large_counts_on_different_ranks(comm):
    # Rank 0's call is small enough to travel inside the header message, the others'
    # are not; the mismatch is still caught, not misread as data.
    count = 3 if RANK == 0 else 100_000
    with pytest.raises(rr.MismatchError, match="count"):
        comm.allreduce(np.ones(count, np.float32))
    still_works(comm)


@needs_two
def test_messages_on_a_sub_communicator_say_where_its_ranks_are_in_the_world(comm):
    # The communicator's rank 1 is another process than mpiexec's rank 1: say which.
    count = 3 if RANK == 0 else 4
    with pytest.raises(rr.MismatchError) as on_world:
        comm.allreduce(np.ones(count, np.float32))
    assert "MPI_COMM_WORLD" not in str(on_world.value)
    backwards = MPI.COMM_WORLD.Split(0, key=-RANK)  # its rank 0 is the world's last
    try:
        with rr.Communicator(backwards) as ring:
            with pytest.raises(rr.MismatchError) as on_sub:
                ring.allreduce(np.ones(count, np.float32))
        where = ", ".join(f"{r} is {SIZE - 1 - r}" for r in range(SIZE))
        assert str(on_sub.value).endswith(
            f" [ranks of this communicator; in MPI_COMM_WORLD: {where}]"), str(on_sub.value)
    finally:
        backwards.Free()
    still_works(comm)


@needs_two
def test_different_collectives_are_a_mismatch(comm):
    with pytest.raises(rr.MismatchError, match="collective"):
        if RANK == 0:
            comm.allreduce(np.ones(3))
        else:
            comm.broadcast(np.ones(3))
    still_works(comm)


@needs_two
def test_broadcast_root_and_allgather_shape_mismatch(comm):
    with pytest.raises(rr.MismatchError, match="root"):
        comm.broadcast(np.ones(3), root=RANK)
    others = "rank 1" if SIZE == 2 else f"ranks 1-{SIZE - 1}" if SIZE > 3 else "ranks 1, 2"
    with pytest.raises(rr.MismatchError,
                       match=rf"x.shape\[1:\]: \(3,\) on rank 0; \(2,\) on {others}"):
        comm.allgather(np.ones((2, 3 if RANK == 0 else 2)))
    # The same number of elements per row, in another shape; and shapes shown only by
    # their element count.
    with pytest.raises(rr.MismatchError, match=r"\(2, 3\) on rank 0; \(3, 2\) on"):
        comm.allgather(np.ones((1, 2, 3) if RANK == 0 else (1, 3, 2)))
    with pytest.raises(rr.MismatchError, match="a shape of 6 elements .with more than 3"):
        comm.allgather(np.ones((1, 1, 1, 2, 3) if RANK == 0 else (1, 1, 1, 3, 2)))
    with pytest.raises(rr.MismatchError, match="count"):
        comm.reduce_scatter(np.ones(4 + RANK))
    still_works(comm)


@needs_two
def test_one_rank_with_bad_arguments_does_not_hang_the_others(comm):
    # Rank 1 passes an unknown op; it raises ValueError, every other rank raises
    # MismatchError naming rank 1, and the next call works everywhere.
    if RANK == 1:
        with pytest.raises(ValueError, match="'bogus'"):
            comm.allreduce(np.ones(3), op="bogus")
    else:
        with pytest.raises(rr.MismatchError, match="rank 1 rejected its arguments"):
            comm.allreduce(np.ones(3))
    if RANK == 0:
        with pytest.raises(TypeError):
            comm.allgather(np.ones(2, np.longdouble))
    else:
        with pytest.raises(rr.MismatchError, match="rank 0 rejected"):
            comm.allgather(np.ones(2))
    still_works(comm)


@needs_two
def test_a_buffer_the_core_refuses_does_not_hang_the_others(comm):
    # Below the Python layer, which never passes such buffers: the binding itself still
    # announces a refusal to the other ranks before raising.
    core, x = comm._core, np.ones(50_000)
    code = rr._types.dtype_code(x.dtype, "x", "test")
    work = np.empty(10 if RANK == 1 else x.size)
    if RANK == 1:
        with pytest.raises(ValueError, match="work or out"):
            core.reduce_scatter(x, work, code, 0, comm.chunk_bytes)
    else:
        with pytest.raises(rr.MismatchError, match="rank 1 rejected"):
            core.reduce_scatter(x, work, code, 0, comm.chunk_bytes)
    rows = x[:8] if RANK == 1 else x[:10]  # rank 1 claims 10 rows but holds 8
    if RANK == 1:
        with pytest.raises(ValueError, match="rows"):
            core.allgather_counts(10, 1, 0, code, comm.chunk_bytes, x=rows)
    else:
        with pytest.raises(rr.MismatchError, match="rank 1 rejected"):
            core.allgather_counts(10, 1, 0, code, comm.chunk_bytes, x=rows)
    still_works(comm)


@pytest.mark.parametrize("call", ["allreduce", "reduce_scatter", "allgather", "broadcast"])
def test_masked_arrays_are_refused_rather_than_reduced_without_their_mask(call, comm):
    x = np.ma.masked_array(np.full(4, RANK + 1.0), mask=[0, 1, 0, 0])
    with pytest.raises(TypeError, match="masked array with masked elements"):
        getattr(comm, call)(x)
    # Nothing masked: only its data, which is what reduces.
    plain = np.ma.masked_array(np.full(4, RANK + 1.0))
    expected = {"allreduce": np.full(4, SIZE * (SIZE + 1) / 2), "broadcast": np.ones(4),
                "allgather": np.repeat(np.arange(1.0, SIZE + 1), 4)}
    if call in expected:
        np.testing.assert_array_equal(getattr(comm, call)(plain), expected[call])
    else:
        comm.reduce_scatter(plain)
    still_works(comm)


@pytest.mark.parametrize("call", ["allreduce", "allreduce_async", "reduce_scatter",
                                  "allgather"])
def test_a_masked_out_is_refused_rather_than_written_under_its_mask(call, comm):
    # (From a review.) Its data was written and its mask kept: results at the masked
    # places stayed hidden.
    x = np.full(SIZE * 2, RANK + 1.0)
    size = {"reduce_scatter": 2, "allgather": SIZE * SIZE * 2}.get(call, SIZE * 2)
    mask = np.zeros(size, bool)
    mask[1] = True
    out = np.ma.masked_array(np.zeros(size), mask=mask)
    with pytest.raises(TypeError, match="out is a masked array with masked elements"):
        result = getattr(comm, call)(x, out=out)
        if call == "allreduce_async":
            result.wait()
    assert not out.data.any()
    unmasked = np.ma.masked_array(np.zeros(size))  # (nothing masked: its data is written)
    result = getattr(comm, call)(x, out=unmasked)
    if call == "allreduce_async":
        result.wait()
    assert unmasked.data.all()
    still_works(comm)


def test_bad_broadcast_arguments(comm):
    for root, error in ((SIZE, ValueError), (-1, ValueError), ("0", TypeError), (True, TypeError)):
        with pytest.raises(error, match="root"):
            comm.broadcast(np.ones(3), root=root)
    with pytest.raises(TypeError, match="ndarray"):
        comm.broadcast([1.0, 2.0])
    with pytest.raises(TypeError, match="non-native byte order"):
        comm.broadcast(np.ones(3, ">f4"))
    readonly = np.ones(3)
    readonly.flags.writeable = False
    if SIZE > 1:
        if RANK != 0:
            with pytest.raises(ValueError, match="read-only"):
                comm.broadcast(readonly, root=0)
        else:
            with pytest.raises(rr.MismatchError):
                comm.broadcast(readonly.copy(), root=0)
    # The root only reads: a read-only array there is fine.
    source = np.arange(3.0) + 7
    source.flags.writeable = False
    target = source if RANK == 0 else np.zeros(3)
    assert comm.broadcast(target, root=0) is target
    np.testing.assert_array_equal(target, np.arange(3.0) + 7)
    still_works(comm)


def test_bad_communicators_and_settings():
    with pytest.raises(TypeError, match="mpi4py communicator"):
        rr.Communicator("world")
    with pytest.raises(ValueError, match="COMM_NULL"):
        rr.Communicator(MPI.COMM_NULL)
    freed = MPI.COMM_WORLD.Dup()
    freed.Free()  # (From a review: the error did not say why a freed one is COMM_NULL.)
    with pytest.raises(ValueError, match=r"comm is MPI\.COMM_NULL: a communicator already "
                                         r"Free\(\)d"):
        rr.Communicator(freed)
    # The module-level functions, which make a Communicator, name themselves.
    x = np.ones(3)
    for call, name in [(lambda comm: rr.allreduce(x, comm=comm), "allreduce"),
                       (lambda comm: rr.allgather(x, comm=comm), "allgather"),
                       (lambda comm: rr.allreduce_gradients([x], comm=comm),
                        "allreduce_gradients"),
                       (lambda comm: DistributedOptimizer(SGD([x], lr=0.1), comm=comm),
                        "DistributedOptimizer")]:
        with pytest.raises(ValueError, match=rf"^ringreduce\.{name}: comm is MPI\.COMM_NULL"):
            call(MPI.COMM_NULL)
        with pytest.raises(TypeError, match=rf"^ringreduce\.{name}: comm must be an mpi4py "
                           r"communicator \(such as MPI\.COMM_WORLD\) or a ringreduce "
                           r"Communicator, got str"):
            call("world")
    # A setting's error names where it was given and the rank (every rank prints it).
    made = rf"ringreduce\.Communicator \(rank {RANK} of {SIZE}\): chunk_bytes must be"
    with pytest.raises(ValueError, match=made):
        rr.Communicator(chunk_bytes=0)
    with pytest.raises(TypeError, match=made):
        rr.Communicator(chunk_bytes=1.5)
    with rr.Communicator() as ring:
        for bad, error in ((0, ValueError), (1.5, TypeError)):
            with pytest.raises(error, match=rf"ringreduce\.Communicator\.chunk_bytes "
                                            rf"\(rank {RANK} of {SIZE}\): chunk_bytes must"):
                ring.chunk_bytes = bad


def test_x_none_is_named_as_none():
    # (From a review.) np.asarray(None) is an array of one object: the error said "x has
    # dtype object", where the script had passed None (a gradient never computed, say).
    with rr.Communicator() as ring:
        for name in ("allreduce", "allreduce_async", "reduce_scatter", "reduce_scatter_async",
                     "allgather", "allgather_async"):
            with pytest.raises(TypeError, match=rf"^ringreduce\.{name} \(rank {RANK} of "
                               rf"{SIZE}\): x is None: give an array"):
                getattr(ring, name)(None)
        np.testing.assert_array_equal(ring.allreduce(np.ones(2)), SIZE)  # still usable


def test_a_misspelt_setting_is_refused_not_kept():
    # (From a review.) comm.timout = 5 made a new attribute that no call reads: the
    # timeout stayed as it was, without a word. rank and size, plain attributes, could
    # be overwritten, and repr() and every error then named the wrong rank.
    with rr.Communicator(timeout=30) as ring:
        for name in ("timout", "chunk_size", "transport_reason_", "name"):
            with pytest.raises(AttributeError, match=rf"^ringreduce\.Communicator \(rank "
                               rf"{RANK} of {SIZE}\): Communicator has no setting "
                               rf"'{name}' \(its settings are timeout and chunk_bytes\)"):
                setattr(ring, name, 5)
        for name in ("rank", "size", "ring", "transport", "closed"):
            # (Python 3.11's words; 3.9's and 3.10's: "can't set attribute")
            with pytest.raises(AttributeError, match="has no setter|can't set attribute"):
                setattr(ring, name, 1)
        assert (ring.rank, ring.size, ring.timeout) == (RANK, SIZE, 30)
        ring.timeout, ring.chunk_bytes = 20, 4096  # (the settings themselves)
        assert (ring.timeout, ring.chunk_bytes) == (20, 4096)
        # A method patched on the instance (a test's mock.patch.object) goes through.
        with mock.patch.object(ring, "allreduce_async", side_effect=RuntimeError("mocked")):
            with pytest.raises(RuntimeError, match="mocked"):
                ring.allreduce_async(np.ones(2))
        np.testing.assert_array_equal(ring.allreduce(np.ones(2)), SIZE)

    class Named(rr.Communicator):  # a subclass keeps what it adds
        def __init__(self):
            super().__init__()
            self.name = "mine"

    with Named() as named:
        assert named.name == "mine" and named.rank == RANK


# What one rank gets wrong in making a Communicator: the argument, the error it raises
# there, and how that error begins.
BAD_MAKINGS = {
    "chunk_bytes": ({"chunk_bytes": 0}, ValueError, "chunk_bytes must be in [1, "),
    "timeout": ({"timeout": "soon"}, TypeError, "timeout must be a number of seconds"),
    "setting": ({}, ValueError, "RINGREDUCE_SHM must be 0 (no shared memory)"),
}


def make_with_bad(what, monkeypatch, comm=None):
    """Makes a Communicator with BAD_MAKINGS[what] on this rank; returns the error and
    how long it took to come."""
    kwargs, _, _ = BAD_MAKINGS[what]
    if what == "setting":
        monkeypatch.setenv("RINGREDUCE_SHM", "off")
    start = time.monotonic()
    with pytest.raises((TypeError, ValueError)) as info:
        rr.Communicator(comm, **kwargs)
    monkeypatch.undo()
    return info.value, time.monotonic() - start


@needs_two
@pytest.mark.parametrize("what", BAD_MAKINGS)
def test_a_bad_argument_on_one_rank_makes_every_rank_raise_at_once(what, monkeypatch):
    # Making a Communicator is collective. The rank with the bad argument used to raise
    # before it came, and the others waited out their timeout for it (here 60 s, by
    # default 1800) in a making that could never finish. It now joins the making to
    # tell them, and every rank raises at once: it its own error, the others why.
    _, error_type, begins = BAD_MAKINGS[what]
    bad = SIZE - 1
    if RANK == bad:
        error, took = make_with_bad(what, monkeypatch)
        assert type(error) is error_type
        assert str(error).startswith(f"ringreduce.Communicator (rank {RANK} of {SIZE}): {begins}")
    else:
        start = time.monotonic()
        with pytest.raises(ValueError) as info:
            rr.Communicator(timeout=60)
        error, took = info.value, time.monotonic() - start
        assert str(error).startswith(
            f"ringreduce.Communicator (rank {RANK} of {SIZE}): rank {bad} was passed a bad "
            f"argument or setting, so no rank made this Communicator: "
            f"{error_type.__name__}: {begins}"), str(error)
    assert took < 30, f"raised after {took:.1f} s"
    with rr.Communicator(timeout=30) as ring:  # nothing left behind: the next one works
        still_works(ring)


@needs_two
@pytest.mark.parametrize("pad", ["", "x"])
def test_the_others_hear_of_a_long_bad_setting_cut_between_characters(pad, monkeypatch):
    # What they hear is cut to 1 KiB; cut inside a two-byte character, it did not decode
    # (UnicodeDecodeError, with neither rank nor reason).
    if RANK == SIZE - 1:
        monkeypatch.setenv("RINGREDUCE_SHM", pad + "\u00e9" * 600)
    with pytest.raises(ValueError) as info:
        rr.Communicator(timeout=60)
    monkeypatch.undo()
    assert type(info.value) is ValueError
    if RANK != SIZE - 1:
        assert f"rank {SIZE - 1} was passed a bad argument" in str(info.value)
        assert str(info.value).endswith("\u00e9")


@pytest.mark.skipif(SIZE < 3, reason="needs two ranks with bad arguments and one without")
def test_the_others_hear_of_the_lowest_rank_with_a_bad_argument_on_a_sub_communicator(
        monkeypatch):
    # In reverse order: world's last rank is the sub-communicator's rank 0, and messages
    # name both (mpiexec labels output by MPI_COMM_WORLD's ranks).
    reverse = MPI.COMM_WORLD.Split(0, SIZE - 1 - RANK)
    try:
        rank = reverse.Get_rank()
        if rank == 0:
            error, _ = make_with_bad("chunk_bytes", monkeypatch, reverse)
            assert "chunk_bytes must be" in str(error)
        elif rank == 1:
            error, _ = make_with_bad("timeout", monkeypatch, reverse)
            assert type(error) is TypeError
        else:
            with pytest.raises(ValueError) as info:
                rr.Communicator(reverse, timeout=60)
            me = "" if rank == RANK else f" ({RANK} in MPI_COMM_WORLD)"
            assert str(info.value).startswith(
                f"ringreduce.Communicator (rank {rank}{me} of {SIZE}): rank 0 ({SIZE - 1} in "
                "MPI_COMM_WORLD) (and at least one more) was passed a bad argument or "
                "setting, so no rank made this Communicator: ValueError: chunk_bytes must be")
        with rr.Communicator(reverse, timeout=30) as ring:
            still_works(ring)
    finally:
        reverse.Free()


@pytest.mark.parametrize("variable", ["RINGREDUCE_SHM", "RINGREDUCE_CUDA_AWARE"])
def test_an_unknown_setting_is_refused(variable, monkeypatch):
    # Only 0 and 1 (and RINGREDUCE_SHM's stream) mean something; "off" must not
    # silently mean "on" (as the core, which takes anything but 0 for 1, would read it).
    values = ("off", "false", "yes", "2") + (("stream",) if variable != "RINGREDUCE_SHM" else
                                              ("Stream", "streaming"))
    for value in values:
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=rf"\(rank {RANK} of {SIZE}\): {variable} must be 0"):
            rr.Communicator()  # (on every rank: each raises its own error)
        monkeypatch.delenv(variable)


def test_closed_communicator_says_so():
    ring = rr.Communicator()
    ring.close()
    ring.close()  # twice is fine
    assert ring.closed
    with pytest.raises(ValueError, match="closed"):
        ring.allreduce(np.ones(2))


def test_a_communicator_dropped_unclosed_warns():
    ring = rr.Communicator()
    with pytest.warns(ResourceWarning, match="never closed.*close\\(\\) on every rank") as record:
        del ring
        gc.collect()
    # The warning's record holds the Communicator (as its source), which so comes back:
    # as closed, not half torn down (before, its calls still ran, after its ranks had
    # been told that it makes no more).
    back = next(w.source for w in record if w.source is not None)
    assert back.closed
    with pytest.raises(ValueError, match="has been closed"):
        back.allreduce(np.ones(2))
    back.close()  # (does nothing)
    del back, record
    # A closed one goes quietly, and a bad chunk size is refused, leaving nothing behind.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        closed = rr.Communicator()
        closed.close()
        del closed
        with pytest.raises(ValueError, match="chunk_bytes"):
            rr.Communicator(chunk_bytes=0)
        gc.collect()


def test_chunk_size_of_rank_0_wins(world):
    # Ranks asking for different chunk sizes still agree (rank 0's is used).
    with rr.Communicator(chunk_bytes=64 + 8 * RANK) as ring:
        x = np.arange(1000.0) * (RANK + 1)
        np.testing.assert_allclose(ring.allreduce(x), np.arange(1000.0) * SIZE * (SIZE + 1) / 2)



@needs_two
@pytest.mark.parametrize("call", ["allgather", "allgather_async"])
@pytest.mark.parametrize("others", ["guess_wrong", "give_out", "guess_right"])
def test_a_rank_that_cannot_allocate_allgathers_output_does_not_hang_the_others(
        others, call, comm, monkeypatch):
    # Rank 1 allocates its result after the exchange (Python's np.empty, made to fail
    # here): as its rows differ from the others' (no guess at the size is right), or
    # as its x is strided (no guess is made). The others must wait for its
    # confirmation rather than go on into the ring, also where they hold their result
    # already: out=, or a guess that was right (the core's fast path allocates it
    # before the exchange). allgather_async remakes its result on the worker thread.
    from ringreduce import communicator

    rows = 1024 + (RANK == 1 and others != "guess_right")
    x = np.full((rows, 256), RANK, np.float32)  # 1 MiB per rank: the output is confirmed
    if RANK == 1 and others == "guess_right":
        x = np.repeat(x, 2, axis=0)[::2]
    total = 1024 * SIZE + (others != "guess_right")
    out = np.empty((total, 256), np.float32) if others == "give_out" and RANK != 1 else None
    if RANK == 1:
        monkeypatch.setattr(communicator, "np", NumpyWithoutMemory())
    with pytest.raises(MemoryError, match=rf"^ringreduce\.{call}\b.*rank 1 could not allocate"):
        if call == "allgather":
            comm.allgather(x, out=out)
        else:
            comm.allgather_async(x, out=out).wait()
    monkeypatch.undo()
    still_works(comm)
    every_rows = MPI.COMM_WORLD.allgather(len(x))
    np.testing.assert_array_equal(comm.allgather(x)[:, 0], np.repeat(np.arange(SIZE), every_rows))


class _NumpyInterrupted(NumpyWithoutMemory):
    """numpy, except that np.empty meets Ctrl-C."""

    @staticmethod
    def empty(*args, **kwargs):
        raise KeyboardInterrupt("test: Ctrl-C in np.empty")


@needs_two
@pytest.mark.parametrize("call", ["allgather", "allgather_async"])
def test_ctrl_c_while_a_rank_makes_a_big_allgather_result_is_raised_there(
        call, comm, monkeypatch):
    # Rank 1's rows differ from the others' (every rank's guess at the result is wrong),
    # and Ctrl-C comes while it makes the result after the exchange. It still takes
    # part in the confirmation, as one without the memory does, so that the others
    # raise instead of waiting for it in the ring; but it raises KeyboardInterrupt, not
    # the confirmation's error.
    from ringreduce import communicator

    rows = 1024 + (RANK == 1)
    x = np.full((rows, 256), RANK, np.float32)  # 1 MiB per rank: the output is confirmed
    if RANK == 1:
        monkeypatch.setattr(communicator, "np", _NumpyInterrupted())
    start = getattr(comm, call)
    expected = (KeyboardInterrupt, "test: Ctrl-C") if RANK == 1 else \
        (MemoryError, rf"^ringreduce\.{call}\b.*rank 1 could not allocate")
    with pytest.raises(expected[0], match=expected[1]):
        result = start(x)
        if call == "allgather_async":
            result.wait()
    monkeypatch.undo()
    still_works(comm)


@needs_two
@pytest.mark.parametrize("call", ["allgather", "allgather_async", "python"])
def test_a_rank_that_cannot_make_a_small_allgather_result_leaves_not_hangs_the_others(
        call, monkeypatch):
    # A result below the size that is confirmed, of rows too big to come with the row
    # counts: the others go on into the ring, where they need rank 0. It could not make
    # its result (numpy's MemoryError here; a signal handler's error alike) and raised,
    # and the others waited for it until their timeout, as did its next call for them.
    # It leaves the communicator instead, so that they raise at once, naming it; its
    # own later calls say why. (The fast path, its async form on the worker, and a
    # strided x, which takes the Python layer's path.)
    from ringreduce import communicator

    ring = rr.Communicator(timeout=30)
    rows = RANK + 1  # (every guess but one on 3 ranks is wrong: rows differ)
    x = np.full((2 * rows, 3000), RANK, np.float64)  # 24 KB rows: beyond the header
    x = x[::2] if call == "python" else x[:rows]
    if RANK == 0:
        monkeypatch.setattr(communicator, "np", NumpyWithoutMemory())
    start = time.monotonic()
    with pytest.raises(BaseException) as raised:
        if call == "allgather_async":
            ring.allgather_async(x).wait()
        else:
            ring.allgather(x)
    monkeypatch.undo()
    if RANK == 0:
        assert raised.type is MemoryError and "np.empty refused" in str(raised.value)
        with pytest.raises(RuntimeError, match="allgather's result could not be made on this "
                                               r"rank \(MemoryError"):
            ring.allreduce(np.ones(3))
    else:
        assert raised.type is rr.CollectiveTimeoutError and "rank 0" in str(raised.value), \
            raised.value
        assert time.monotonic() - start < 15, "waited for its timeout"


@needs_two
@pytest.mark.parametrize("call", ["allgather", "allreduce", "reduce_scatter"])
def test_a_small_call_that_cannot_allocate_its_result_does_not_hang_the_others(
        call, monkeypatch, world):
    # Rank 1 cannot allocate its result. Small rows ride in the header exchange, so the
    # others need nothing more from it there: they finish, it raises after the
    # exchange. The reductions allocate before it, so the others raise MismatchError
    # naming rank 1 instead of waiting for it. (Results come from _Results here,
    # lowered to take every size, as the fast path's own allocation cannot be made to
    # fail from Python; a failure there takes the same way, the general path.)
    from ringreduce import communicator

    if RANK == 1:
        monkeypatch.setattr(communicator._Results, "MIN_BYTES", 0)
    with rr.Communicator() as comm:  # (made after: the fast path reads MIN_BYTES once)
        x = np.full((4, 2), RANK, np.float32)
        # The dtype and op known to the fast path, as in a loop (another size: a kept
        # result buffer of x's size would be reused).
        comm.allreduce(np.ones(1000, np.float32))
        if RANK == 1:
            monkeypatch.setattr(communicator, "np", NumpyWithoutMemory())
            with pytest.raises(MemoryError, match="np.empty refused"):
                getattr(comm, call)(x)
            monkeypatch.undo()
        elif call == "allgather":
            g = comm.allgather(x)
            np.testing.assert_array_equal(g[::4, 0], np.arange(SIZE))
        else:
            with pytest.raises(rr.MismatchError, match="rank 1 failed to prepare this call"):
                getattr(comm, call)(x)
        still_works(comm)


@needs_two
def test_a_rank_without_the_rings_workspace_does_not_hang_the_others(monkeypatch):
    # A reduce_scatter too big to ride in the header exchange needs a workspace as big
    # as x; rank 1 cannot get one (patched before the Communicator, whose fast path
    # holds the method it had then), and says so in the exchange.
    from ringreduce import communicator

    refused = []
    get = communicator._Scratch.get

    def get_unless_refused(self, nbytes):
        if refused:
            raise MemoryError("test: no workspace")
        return get(self, nbytes)

    monkeypatch.setattr(communicator._Scratch, "get", get_unless_refused)
    with rr.Communicator() as comm:
        x = np.ones(1 << 15)  # 256 KiB
        comm.reduce_scatter(x)  # (validates float64 and "sum")
        if RANK == 1:
            refused.append(True)
            with pytest.raises(MemoryError, match="test: no workspace"):
                comm.reduce_scatter(x)
            refused.clear()
        else:
            with pytest.raises(rr.MismatchError, match="rank 1 failed to prepare"):
                comm.reduce_scatter(x)
        still_works(comm)
        np.testing.assert_array_equal(comm.reduce_scatter(x), SIZE)


def _copying_x_fails(communicator, monkeypatch):
    monkeypatch.setattr(communicator.t, "readable_copy",
                        lambda a: (_ for _ in ()).throw(MemoryError("test: no copy")))


def _no_workspace(communicator, monkeypatch):
    def get(self, nbytes):
        raise MemoryError("test: no workspace")

    monkeypatch.setattr(communicator._Scratch, "get", get)


def _copying_x_into_the_workspace_fails(communicator, monkeypatch):
    # (reduce_scatter copies a strided x into its workspace, as the call runs.)
    def get(self, nbytes):
        return np.empty(nbytes, np.uint8).view(_NoRoomToCopyInto)

    monkeypatch.setattr(communicator._Scratch, "get", get)


@needs_two
@pytest.mark.parametrize("call,fail", [("allreduce", _copying_x_fails),
                                       ("allreduce_async", _copying_x_fails),
                                       ("allgather", _copying_x_fails),
                                       ("broadcast", _copying_x_fails),
                                       ("reduce_scatter", _copying_x_into_the_workspace_fails),
                                       ("reduce_scatter", _no_workspace)])
def test_a_memory_error_while_preparing_a_call_does_not_hang_the_others(call, fail, comm,
                                                                        monkeypatch):
    # (The copy of a strided x is made as the call runs, on the worker thread for an
    # async one, after the header exchange has begun on the other ranks.)
    from ringreduce import communicator

    def run(x):
        if call == "allreduce_async":
            return comm.allreduce_async(x, out=out).wait()
        if call == "allreduce":
            return comm.allreduce(x, out=out)
        return getattr(comm, call)(x)

    x = np.ones((8, 8))[:, ::2]  # not contiguous: the call copies it first
    out = None
    if call.startswith("allreduce"):
        # allreduce copies a strided x straight into its result, unless out= overlaps x;
        # and the FastPath copies a strided x of a validated dtype itself.
        buf = np.ones(33)
        x, out = buf.view(buf.dtype.newbyteorder())[:32:2], buf[1:17]
    if RANK == 1:
        fail(communicator, monkeypatch)
        with pytest.raises(MemoryError, match="test"):
            run(x)
    else:
        with pytest.raises(rr.MismatchError, match="rank 1 failed to prepare"):
            run(x)
    monkeypatch.undo()
    still_works(comm)


class _NoRoomToCopyInto(np.ndarray):
    """An out= whose filling fails for want of memory, as numpy's temporary does where
    out is x's own bytes in another layout (out=a, x=a.T; out=a, x=a.view('>f8'))."""

    def __setitem__(self, key, value):
        raise MemoryError("test: no room for the copy into out")


@needs_two
@pytest.mark.parametrize("call", ["allreduce", "allreduce_async"])
def test_a_memory_error_copying_a_strided_x_into_out_does_not_hang_the_others(call):
    # allreduce copies a strided x straight into out= as the call runs; a rank that
    # fails to (out of memory) says so in the header exchange, as for a copy of x, instead
    # of leaving the others to wait out their timeout.
    with rr.Communicator(timeout=20) as ring:
        x = np.arange(16.0)[::2]
        out = np.zeros(8)
        if RANK == 1:
            out = out.view(_NoRoomToCopyInto)  # (not the FastPath's: a subclass)

        def run():
            if call == "allreduce_async":
                return ring.allreduce_async(x, out=out).wait()
            return ring.allreduce(x, out=out)

        started = time.monotonic()
        if RANK == 1:
            with pytest.raises(MemoryError, match="no room for the copy into out"):
                run()
        else:
            with pytest.raises(rr.MismatchError, match="rank 1 failed to prepare"):
                run()
        assert time.monotonic() - started < 10
        still_works(ring)


@needs_two
def test_allgather_out_with_the_wrong_rows_raises_on_every_rank(comm):
    x = np.ones((2, 3))
    out = np.empty((2 * SIZE + (1 if RANK == 1 else 0), 3))
    with pytest.raises(rr.MismatchError, match=f"out= on rank 1 does not have the {2 * SIZE} "
                       f"rows the ranks gather \\(out.shape\\[0\\]: {2 * SIZE + 1} on rank 1"):
        comm.allgather(x, out=out)
    still_works(comm)


def test_allgather_out_checked_before_anything_moves(comm):
    x = np.ones((2, 3))
    with pytest.raises(TypeError, match="dtype"):
        comm.allgather(x, out=np.empty((2 * SIZE, 3), np.float32))
    with pytest.raises(ValueError, match=r"rows of shape \(3,\)"):
        comm.allgather(x, out=np.empty((2 * SIZE, 4)))
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.allgather(x, out=np.empty((2 * SIZE, 6))[:, ::2])
    with pytest.raises(TypeError, match="numpy.ndarray"):
        comm.allgather(x, out=[[0.0] * 3] * (2 * SIZE))
    still_works(comm)


def test_allgather_with_out_on_some_ranks_only(comm, world):
    # Big enough that the ranks allocating their result confirm they could: those with
    # out= must take part in that confirmation too, or the two groups wait on each other.
    x = np.full((1 << 15, 8), RANK, np.float32)  # 1 MiB per rank
    out = np.empty((SIZE << 15, 8), np.float32) if RANK % 2 == 0 else None
    result = comm.allgather(x, out=out)
    assert out is None or result is out
    np.testing.assert_array_equal(result[::1 << 15, 0], np.arange(SIZE))


def test_an_interrupt_while_making_a_result_is_raised_not_swallowed(monkeypatch):
    # The fast path takes a result it cannot allocate (MemoryError) to the general path;
    # anything else raised there, as Ctrl-C's KeyboardInterrupt from the signal handler,
    # is the caller's, at once. (Results from _Results here, lowered to take every size;
    # both patched before the Communicator, whose fast path holds what they were then.)
    from ringreduce import communicator

    empty, interrupts = communicator._Results.empty, []

    def interrupted_once(self, shape, dtype):
        if interrupts:
            raise interrupts.pop()
        return empty(self, shape, dtype)

    monkeypatch.setattr(communicator._Results, "MIN_BYTES", 0)
    monkeypatch.setattr(communicator._Results, "empty", interrupted_once)
    with rr.Communicator() as comm:
        x = np.arange(5.0) + RANK
        comm.allreduce(x[::-1])  # (validates float64 and "sum"; on the general path)
        interrupts.append(KeyboardInterrupt("test: Ctrl-C"))
        with pytest.raises(KeyboardInterrupt, match="test: Ctrl-C"):
            comm.allreduce(x)
        still_works(comm)


@pytest.mark.parametrize("call", ["allreduce", "allreduce_async", "reduce_scatter",
                                  "allgather", "broadcast"])
def test_numpys_memory_error_names_the_call_and_the_rank(call, comm):
    # A result, workspace or copy of x that numpy cannot allocate raised numpy's own
    # MemoryError ("Unable to allocate 32.0 TiB for an array ..."), the one error of a
    # call that named neither the call nor the rank.
    if call == "broadcast" and SIZE > 1:
        pytest.skip("the ranks other than the root need a writeable x of 32 TiB")
    huge = np.broadcast_to(np.float64(1), (1 << 42,))  # 32 TiB, strided: copied first
    run = {"allreduce": lambda: comm.allreduce(huge),
           "allreduce_async": lambda: comm.allreduce_async(huge).wait(),
           "reduce_scatter": lambda: comm.reduce_scatter(huge),
           "allgather": lambda: comm.allgather(huge),
           "broadcast": lambda: comm.broadcast(huge, root=0)}[call]
    named = rf"^ringreduce\.{call} \(rank {RANK} of {SIZE}\): Unable to allocate"
    if call == "allgather":  # (x goes into the result: its allocation fails, confirmed)
        named = (r"^ringreduce\.allgather: ranks? [\d, -]+ could not allocate "
                 rf".*\(raised on rank {RANK}\)")
    with pytest.raises(MemoryError, match=named):
        run()
    still_works(comm)


class _GpuArrayWithoutAGpu:
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f8", "data": (0, False),
                                "version": 3}


def _read_only(a):
    a.flags.writeable = False
    return a


def _out_size(call):
    """The size of call's result for an x of 8 elements (at least 2 on up to 4 ranks)."""
    return {"allgather": 8 * SIZE, "reduce_scatter": len(np.array_split(range(8), SIZE)[RANK])
            }.get(call, 8)


def _masked(size):
    return np.ma.masked_array(np.ones(size), mask=np.arange(size) == 1)


# Each argument error of the table in docs/api.md: the case, which calls take it, what
# to pass for a call (given its result's size), the error, and what its message must
# show besides the call and the rank (the argument and its value).
_REDUCTIONS = ("allreduce", "allreduce_async", "reduce_scatter")
_ALL = _REDUCTIONS + ("allgather",)
_BAD_ARGUMENTS = {
    "unknown op": (_REDUCTIONS, lambda n: (np.ones(8), {"op": "mean"}), ValueError,
                   r"op 'mean' is not one of 'sum', 'prod', 'min', 'max', 'avg'"),
    "unsupported dtype": (_ALL, lambda n: (np.ones(8, object), {}), TypeError,
                          r"x has dtype object, which is not supported; supported dtypes: "
                          r"float16, .*float32"),
    "masked x": (_ALL, lambda n: (_masked(8), {}), TypeError,
                 r"x is a masked array with masked elements"),
    "masked out": (_ALL, lambda n: (np.ones(8), {"out": _masked(n)}), TypeError,
                   r"out is a masked array with masked elements"),
    "op undefined for the dtype": (_REDUCTIONS, lambda n: (np.ones(8, np.int32), {"op": "avg"}),
                                   rr.UnsupportedOpError,
                                   r"op 'avg' is not supported for dtype int32"),
    "out of the wrong dtype": (_ALL, lambda n: (np.ones(8), {"out": np.ones(n, np.float32)}),
                               TypeError, r"out has dtype float32, expected float64"),
    "out not an ndarray": (_ALL, lambda n: (np.ones(8), {"out": [0.0] * n}), TypeError,
                           r"out must be a numpy.ndarray, got list"),
    "out a torch tensor": (_ALL, lambda n: (np.ones(8), {"out": Tensor(n)}), TypeError,
                           r"out must be a numpy.ndarray, got torch.Tensor; a tensor on the "
                           r"CPU has a numpy array over its own memory, to pass instead: "
                           r"t.numpy\(\)"),
    "x a bfloat16 torch tensor": (_ALL, lambda n: (Tensor(8, "torch.bfloat16"), {}), TypeError,
                                  r"x cannot be read as an array: Got unsupported ScalarType "
                                  r"BFloat16; a bfloat16 tensor on the CPU reads as ml_dtypes' "
                                  r"bfloat16, over its own memory: t.view\(torch.int16\)"),
    "out a bfloat16 torch tensor": (_ALL,
                                    lambda n: (np.ones(8), {"out": Tensor(n, "torch.bfloat16")}),
                                    TypeError, r"got torch.Tensor; a bfloat16 tensor on the "
                                    r"CPU reads as ml_dtypes' bfloat16"),
    # (allgather's rows are the ranks' agreement: a wrong number is a MismatchError on
    # every rank, tested above; rows of the wrong shape are this rank's own error.)
    "out of the wrong shape": (_REDUCTIONS, lambda n: (np.ones(8), {"out": np.ones(n + 1)}),
                               ValueError, r"out has shape \((\d+),\), expected"),
    "out rows of the wrong shape": (("allgather",),
                                    lambda n: (np.ones(8), {"out": np.ones((n, 2))}),
                                    ValueError, r"out .*rows of shape \(\)"),
    "out not C-contiguous": (_ALL, lambda n: (np.ones(8), {"out": np.ones(2 * n)[::2]}),
                             ValueError, r"out is not C-contiguous \(strides \(16,\)\)"),
    "out read-only": (_ALL, lambda n: (np.ones(8), {"out": _read_only(np.ones(n))}),
                      ValueError, r"out is read-only"),
    "GPU array without a GPU": (_ALL, lambda n: (_GpuArrayWithoutAGpu(), {}), TypeError,
                                r"x is a GPU array \(_GpuArrayWithoutAGpu\)"),
}


@pytest.mark.parametrize("module_level", [False, True], ids=["method", "module-level"])
@pytest.mark.parametrize("call", ["allreduce", "allreduce_async", "reduce_scatter", "allgather"])
@pytest.mark.parametrize("case", list(_BAD_ARGUMENTS))
def test_every_argument_error_names_the_call_the_argument_the_value_and_the_rank(
        case, call, module_level, comm):
    # api.md's Errors: "Every message names the call, the argument, the value, and the
    # rank", for every call (the module-level functions name themselves, not the
    # Communicator they use). Every rank passes the same bad argument.
    calls, arguments, error, shows = _BAD_ARGUMENTS[case]
    if call not in calls:
        pytest.skip(f"{call} takes no such argument")
    if case == "GPU array without a GPU" and rr.cuda_available():
        pytest.skip("this process has a GPU")  # (benchmarks/gpu_check.sh runs these there)
    x, kwargs = arguments(_out_size(call))
    if module_level:
        kwargs["comm"] = comm
    run = getattr(rr if module_level else comm, call)
    with pytest.raises(error) as info:
        result = run(x, **kwargs)
        if call == "allreduce_async":
            result.wait()
    message = str(info.value)
    assert message.startswith(f"ringreduce.{call} (rank {RANK} of {SIZE}): "), message
    assert re.search(shows, message), (shows, message)
    still_works(comm)


@pytest.mark.parametrize("module_level", [False, True], ids=["method", "module-level"])
def test_every_broadcast_argument_error_names_the_call_the_argument_the_value_and_the_rank(
        module_level, comm):
    run = rr.broadcast if module_level else comm.broadcast
    extra = {"comm": comm} if module_level else {}
    cases = [((np.ones(3),), {"root": SIZE}, ValueError, rf"root {SIZE} is not a rank"),
             ((np.ones(3),), {"root": -1}, ValueError, r"root -1 is not a rank"),
             ((np.ones(3),), {"root": "0"}, TypeError, r"root must be an int, got str"),
             ((np.ones(3, ">f4"),), {}, TypeError, r"x has non-native byte order \(>f4\)"),
             (([1.0],), {}, TypeError, r"x must be a numpy.ndarray .*got list"),
             ((Tensor(3),), {}, TypeError, r"x must be a numpy.ndarray .*got torch.Tensor; "
              r"a tensor on the CPU has a numpy array over its own memory"),
             ((np.ones(3, object),), {}, TypeError, r"x has dtype object"),
             ((np.float64(1),), {}, TypeError, r"x is a numpy scalar \(float64\), but "
              r"broadcast works in place; pass a 0-d array"),
             ((np.ma.masked_array(np.ones(3), mask=[0, 1, 0]),), {}, TypeError,
              r"x is a masked array with masked elements")]
    if not rr.cuda_available():  # (with a GPU, the fake array is read as a GPU array)
        cases.append(((_GpuArrayWithoutAGpu(),), {}, TypeError, r"x is a GPU array"))
    for args, kwargs, error, shows in cases:
        with pytest.raises(error) as info:
            run(*args, **kwargs, **extra)
        message = str(info.value)
        assert message.startswith(f"ringreduce.broadcast (rank {RANK} of {SIZE}): "), message
        assert re.search(shows, message), (shows, message)
    if SIZE > 1:  # read-only x where it is written: on the ranks other than the root
        if RANK == 0:  # (the root only reads: it hears of the others' refusal)
            others = ("rank 1 rejected its" if SIZE == 2 else "ranks 1, 2 rejected their"
                      if SIZE == 3 else f"ranks 1-{SIZE - 1} rejected their")
            with pytest.raises(rr.MismatchError, match=rf"\(raised on rank 0 of {SIZE}\): "
                                                       rf"{others} arguments"):
                run(np.ones(3), root=0, **extra)
        else:
            with pytest.raises(ValueError) as info:
                run(_read_only(np.ones(3)), root=0, **extra)
            assert str(info.value).startswith(
                f"ringreduce.broadcast (rank {RANK} of {SIZE}): x is read-only"), info.value
    still_works(comm)
