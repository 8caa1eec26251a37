"""reduce_scatter, allgather and broadcast."""
import os
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import communicator, reference

from helpers import (BFLOAT16, COMBOS, DTYPES, around_inline_limit, bitwise_equal,
                     check_against_float64, combo_id, exact_integer_reduce, random_bits,
                     rank_data, result_and_peak_allocated, same_on_every_rank)

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
# Small calls ride in the header exchange; around_inline_limit() adds the sizes on
# either side of where the ring takes over.
SIZES = sorted({0, 1, max(SIZE - 1, 1), SIZE, 2 * SIZE + 1, 517})


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_reduce_scatter_gives_this_ranks_array_split_block(combo, small_chunks, world):
    dtype, op = combo
    for n in around_inline_limit(small_chunks, dtype.itemsize, SIZES):
        x = rank_data(dtype, n, op, salt=1)
        part = small_chunks.reduce_scatter(x, op=op)
        full = small_chunks.allreduce(x, op=op)
        block = np.array_split(full, SIZE)[RANK]
        assert bitwise_equal(part, block), f"n={n}"
        assert bitwise_equal(part, reference.reduce_scatter(x, op, world))
        everyone = world.allgather(x)
        expected_full = (exact_integer_reduce(everyone, op) if dtype.kind in "iub" else None)
        if expected_full is not None:
            np.testing.assert_array_equal(part, np.array_split(expected_full, SIZE)[RANK])
        else:
            check_against_float64(part, [np.array_split(a, SIZE)[RANK] for a in everyone], op)


def test_reduce_scatter_ravels_any_shape_and_fills_out(comm, world):
    x = rank_data(np.dtype(np.float64), 60).reshape(3, 4, 5)
    expected = np.array_split(sum(world.allgather(x)).ravel(), SIZE)[RANK]
    part = comm.reduce_scatter(x)
    assert part.ndim == 1
    np.testing.assert_allclose(part, expected, rtol=1e-12, atol=1e-12)
    out = np.empty(len(expected))
    assert comm.reduce_scatter(x, out=out) is out
    np.testing.assert_array_equal(out, part)
    np.testing.assert_allclose(rr.reduce_scatter(x, op="avg"), expected / SIZE, rtol=1e-12)


def test_reduce_scatter_out_of_the_wrong_length_is_rejected(comm):
    x = np.arange(10.0)
    wrong = np.empty(len(np.array_split(x, SIZE)[RANK]) + 1)
    with pytest.raises(ValueError, match="shape"):
        comm.reduce_scatter(x, out=wrong)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.int16),
                                   np.dtype(np.complex128)] + ([BFLOAT16] if BFLOAT16 else []),
                         ids=str)
def test_allgather_concatenates_along_axis_0(dtype, small_chunks, world):
    for rows in around_inline_limit(small_chunks, 6 * dtype.itemsize, (0, 1, 5)):
        x = rank_data(dtype, rows * 6, salt=2).reshape(rows, 2, 3)
        g = small_chunks.allgather(x)
        expected = np.concatenate(world.allgather(x), axis=0)
        assert bitwise_equal(g, expected)
        assert bitwise_equal(g, reference.allgather(x, world))


def test_allgather_ranks_may_differ_in_rows(small_chunks, world):
    x = rank_data(np.dtype(np.float64), 3 * RANK + 1, salt=3)  # 1, 4, 7, 10 rows
    g = small_chunks.allgather(x)
    assert bitwise_equal(g, np.concatenate(world.allgather(x)))
    assert same_on_every_rank(g)
    with rr.Communicator(chunk_bytes=1 << 20) as ring:  # one chunk per segment
        assert bitwise_equal(ring.allgather(x), g)


def uneven_shapes(edge):
    """This rank's x shape for a series of allgathers whose ranks differ in rows: totals
    that the ranks do not divide, fewer elements in all than ranks, ranks with none,
    and rows on either side of `edge`, the most elements that ride in the header
    exchange (rank 0's alone past it: the ring for all; the last rank's alone, and the
    ring passes empty segments), and rows of 3 elements."""
    counts = [RANK % 2, int(RANK == SIZE - 1), 2 * RANK + 1, SIZE - 1 - RANK,
              edge - RANK, edge + 1 - RANK, edge + 3 * RANK + 1,
              (edge + 1) * (RANK == SIZE - 1)]
    return [(max(c, 0),) for c in counts] + [(2 * RANK + 1, 3), (edge // 3 + 1 - RANK % 2, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allgather_of_every_dtype_and_uneven_rows_gives_the_reference_bits(dtype, small_chunks,
                                                                           world):
    # (The test above holds four dtypes to the reference, with as many rows on every
    # rank.) Every dtype, ranks that differ in rows, in the header exchange and in
    # chunks of 64 bytes (a few elements: complex128's 4) around the ring. Random bytes:
    # the result is a copy, so every bit of every element (a NaN's payload, a bool's
    # byte) must come through as the reference's ring passes it, and as mpi4py's
    # allgather does (which holds the reference to the same).
    edge = around_inline_limit(small_chunks, dtype.itemsize)[0]
    for shape in uneven_shapes(edge):
        x = random_bits(dtype, int(np.prod(shape)), [RANK, *shape, 31]).reshape(shape)
        got = small_chunks.allgather(x)
        want = reference.allgather(x, world)
        assert bitwise_equal(got, want), shape
        assert bitwise_equal(want, np.concatenate(world.allgather(x))), shape


def test_allgather_of_rows_of_no_bytes_as_many_as_an_array_can_have(comm):
    # Rank 0's 2**62 empty rows: the FastPath's guess at the result, its rows times the
    # ranks, overflowed int64; numpy refused the negative shape there, before the header
    # exchange, so the others' calls paired with rank 0's next one. The result is made
    # once the ranks' rows are known. Where they add up past what an array can have,
    # every rank raises, naming the call, and the communicator goes on. (float64:
    # the guess's rows times 8 bytes passed what numpy takes, and its ValueError was
    # raised before the exchange, as the overflow had been; from a review.)
    for dtype, most in ((np.uint8, 2**62), (np.float64, 2**59)):
        rows = most if RANK == 0 else 1
        for call in (comm.allgather, lambda x: comm.allgather_async(x).wait()):
            got = call(np.empty((rows, 0), dtype))
            assert got.shape == (most + SIZE - 1, 0) and got.dtype == dtype
    if SIZE > 1:  # (2**60 float64 rows are more than numpy makes; see the next test too)
        with pytest.raises(ValueError, match=rf"ringreduce\.allgather \(rank {RANK} of {SIZE}\): "
                                             r"the ranks' rows add up to \d+, more than an array"):
            comm.allgather(np.empty((2**59, 0), np.float64))
    assert comm.allreduce(np.ones(2))[0] == SIZE


def test_allgather_of_rows_that_add_up_past_int64_raises_everywhere(comm):
    # (From a review.) The core added the ranks' rows in int64, which wraps: on 3 ranks
    # 20 + 2 * (2**63 - 1) rows came to 18, so an out= of 18 rows passed the check and
    # rank 0 (whose few rows took the FastPath) returned 18 rows, the others raising.
    rows = 20 if RANK == 0 else 2**63 - 1
    for out in (None, np.empty((18, 0), np.uint8)):
        if SIZE == 1:
            assert comm.allgather(np.empty((rows, 0), np.uint8)).shape == (20, 0)
            continue
        with pytest.raises(rr.MismatchError, match=r"the ranks' rows add up to more than "
                           r"2\*\*63 - 1, more than an array can have \(x\.shape\[0\]: 20 on "
                           r"rank 0; 9223372036854775807 on ranks? 1"):
            comm.allgather(np.empty((rows, 0), np.uint8), out=out)
    assert comm.allreduce(np.ones(2))[0] == SIZE


def test_allgather_with_rows_in_and_out_of_the_header_exchange(small_chunks, world):
    # Rank 0's rows fit in its header, the others' don't: all take the ring.
    edge = around_inline_limit(small_chunks, 8, ())[0]
    x = rank_data(np.dtype(np.float64), edge + RANK * 3, salt=8)
    g = small_chunks.allgather(x)
    assert bitwise_equal(g, np.concatenate(world.allgather(x)))
    # In place, on either side of the limit.
    for rows in (edge, edge + 1):
        x = rank_data(np.dtype(np.float64), rows, salt=9)
        out = np.zeros(rows * SIZE)
        out[RANK * rows:(RANK + 1) * rows] = x
        assert small_chunks.allgather(out[RANK * rows:(RANK + 1) * rows], out=out) is out
        assert bitwise_equal(out, np.concatenate(world.allgather(x))), f"rows={rows}"


def test_the_common_calls_never_reach_the_general_path(world, monkeypatch):
    # Once the general path has validated a dtype and op, the core's FastPath serves a
    # contiguous numpy array (and for allreduce a strided one) with out= None, x itself
    # or a plain array: the general
    # path (Communicator._call, recorded here, and still run) is never called.
    general = []
    with rr.Communicator() as ring:
        call = ring._call
        monkeypatch.setattr(ring, "_call", lambda name, *args, **kwargs:
                            general.append(name) or call(name, *args, **kwargs))
        x = np.arange(6, dtype=np.float32) + RANK
        total = sum(world.allgather(x))
        np.testing.assert_array_equal(ring.allreduce(x), total)  # (validates float32, "sum")
        general.clear()
        np.testing.assert_array_equal(ring.allreduce(x, out=np.empty_like(x)), total)
        y = x.copy()
        assert ring.allreduce(y, out=y) is y
        np.testing.assert_array_equal(y, total)
        block = np.array_split(total, SIZE)[RANK]
        np.testing.assert_array_equal(ring.reduce_scatter(x), block)
        np.testing.assert_array_equal(ring.reduce_scatter(x, out=np.empty_like(block)), block)
        gathered = np.concatenate(world.allgather(x))
        np.testing.assert_array_equal(ring.allgather(x), gathered)
        np.testing.assert_array_equal(ring.allgather(x, out=np.empty_like(gathered)), gathered)
        np.testing.assert_array_equal(ring.broadcast(x.copy(), root=SIZE - 1), x + SIZE - 1 - RANK)
        # Rows too big to ride in the header exchange: the ring, into the guessed
        # result when the ranks' rows add up to it, else into one of the right size.
        # 80 KiB on up to 13 ranks (a result below 1 MiB: no confirmation), over any
        # inline limit (16 KiB).
        n = min(20000, (1 << 18) // SIZE - 16)
        big = rank_data(np.dtype(np.float32), n, salt=12)
        for rows in (n, n - RANK):
            gathered = np.concatenate(world.allgather(big[:rows]))
            assert bitwise_equal(ring.allgather(big[:rows]), gathered), rows
            assert bitwise_equal(ring.allgather(big[:rows], out=np.empty_like(gathered)),
                                 gathered), rows
        whole = np.arange(20000, dtype=np.float32) + RANK  # (sums exact in any order)
        block = np.array_split(sum(world.allgather(whole)), SIZE)[RANK]
        np.testing.assert_array_equal(ring.reduce_scatter(whole), block)
        np.testing.assert_array_equal(ring.reduce_scatter(whole, out=np.empty_like(block)), block)
        ring.allreduce(x[::2])  # strided: copied by the FastPath (since 2026-12-06)
        assert general == []
        ring.allreduce(x.astype(x.dtype.newbyteorder()))  # the general path's
        assert general == ["allreduce"]


@pytest.mark.skipif(SIZE == 1, reason="one rank has no header exchange")
def test_small_allgather_is_one_step_when_the_ranks_rows_match_the_guess(world, monkeypatch):
    # The fast path allocates the result for as many rows on every rank as on this
    # one (or takes out=); if right, the exchange that brings the rows fills it. If
    # not, a second step makes a result of the right size (from _Results.empty, patched
    # before the Communicator, whose fast path holds it) and copies them there. The
    # same for allgather_async, whose guess is remade on the worker thread.
    remade = []
    empty = communicator._Results.empty
    monkeypatch.setattr(communicator._Results, "empty",
                        lambda self, shape, dtype: remade.append(shape) or empty(self, shape, dtype))
    with rr.Communicator() as ring:
        for rows, out in ((3, None), (3, np.empty((3 * SIZE, 2))),
                          (RANK + 1, None), (RANK + 1, np.empty((SIZE * (SIZE + 1) // 2, 2)))):
            x = rank_data(np.dtype(np.float64), rows * 2, salt=10).reshape(rows, 2)
            total = sum(world.allgather(rows))
            one_step = out is not None or rows * SIZE == total  # out= has the true size
            for call in (ring.allgather, lambda x, out: ring.allgather_async(x, out=out).wait()):
                remade.clear()
                g = call(x, out=out)
                assert bitwise_equal(g, np.concatenate(world.allgather(x)))
                assert out is None or g is out
                assert remade == ([] if one_step else [(total, 2)]), (rows, out is None)


@pytest.mark.skipif(SIZE == 1, reason="one rank has no header exchange")
def test_allgather_with_out_takes_part_in_the_others_confirmation(world, monkeypatch):
    # Rank 0 passes an out= of the right size; the others guess wrong (their rows
    # differ) and allocate after the exchange. Results of _CONFIRM_BYTES or more are
    # then confirmed by every rank, so rank 0 must not finish in one step there, or the
    # others would wait for its confirmation (here: raise after the timeout). Lowered,
    # to put small calls on either side of it.
    total = SIZE * (SIZE + 1) // 2
    monkeypatch.setattr(communicator, "_CONFIRM_BYTES", total * 16)
    with rr.Communicator(timeout=10) as ring:
        for row_elems in (1, 4):  # results below, then above the confirmed size
            x = rank_data(np.dtype(np.float64), (RANK + 1) * row_elems, salt=11)
            x = x.reshape(RANK + 1, row_elems)
            out = np.empty((total, row_elems)) if RANK == 0 else None
            g = ring.allgather(x, out=out)
            assert bitwise_equal(g, np.concatenate(world.allgather(x))), row_elems


@pytest.mark.skipif(SIZE == 1, reason="one rank has no header exchange")
@pytest.mark.parametrize("contiguous", [True, False], ids=["fast_path", "python"])
def test_big_allgather_is_confirmed_only_where_a_rank_allocates_its_result(
        contiguous, world, monkeypatch):
    # From _CONFIRM_BYTES on, every rank confirms that it has its result before the
    # ring (one that could not allocate it would leave the others waiting there), in
    # an exchange of its own; unless every rank held a result of the right size before
    # the call, which its header exchange tells them all: out=, or the one the core's
    # fast path allocates for a guess (as many rows from every rank as from this one).
    # Every mix must take the same steps on every rank (or one would wait for an
    # exchange the others never start), in the fast path (contiguous x) as in Python's
    # (a strided x, copied first, and no guess).
    monkeypatch.setattr(communicator, "_CONFIRM_BYTES", SIZE * 8)
    with rr.Communicator(timeout=10) as ring:
        core = ring._core
        for row_elems in (1, 4096):  # rows that ride in the exchange; rows for the ring
            for rows in (2, RANK + 1):  # guesses right on every rank, or not
                total = sum(world.allgather(rows))
                for givers in ("all", "none", "rank 0", "all but rank 0"):
                    gives = {"all": True, "none": False, "rank 0": RANK == 0,
                             "all but rank 0": RANK != 0}[givers]
                    x = rank_data(np.dtype(np.float64), 2 * rows * row_elems, salt=12)
                    x = x.reshape(2 * rows, row_elems)[:: 1 if contiguous else 2][:rows]
                    out = np.empty((total, row_elems)) if gives else None
                    before = core.exchanges
                    g = ring.allgather(x, out=out)
                    assert bitwise_equal(g, np.concatenate(world.allgather(x))), givers
                    assert out is None or g is out
                    held = gives or (contiguous and rows * SIZE == total)
                    everywhere = all(world.allgather(held))
                    steps = world.allgather(core.exchanges - before)
                    assert steps == [2 - everywhere] * SIZE, (row_elems, rows, givers, steps)
                    assert core.allgather_results_held == everywhere


def test_allgather_of_scalars_and_module_level(comm, world):
    g = comm.allgather(np.float32(RANK + 0.5))
    assert g.shape == (SIZE,)
    np.testing.assert_array_equal(g, np.arange(SIZE, dtype=np.float32) + 0.5)
    np.testing.assert_array_equal(rr.allgather(np.array([RANK])), np.arange(SIZE))


@pytest.mark.parametrize("root", range(SIZE))
def test_broadcast_from_every_root(root, small_chunks, world):
    # Around both limits: the other calls' (16 KiB over shared memory) and broadcast's
    # own (48 KiB: only the root's data rides in the header exchange).
    core = small_chunks._core
    own = max(core.broadcast_inline_capacity // 8, 1)
    for n in around_inline_limit(small_chunks, 8, SIZES) + [own, own + 1]:
        x = rank_data(np.dtype(np.float64), n, salt=4)
        roots_data = world.bcast(x.copy(), root=root)
        sent = core.ring_bytes_sent
        returned = small_chunks.broadcast(x, root=root)
        assert returned is x
        assert bitwise_equal(x, roots_data)
        if SIZE > 1 and RANK == root:  # the header exchange up to the limit, the ring past it
            inline = n * 8 <= core.broadcast_inline_capacity
            assert (core.ring_bytes_sent == sent) == inline, n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast_of_every_dtype_hands_on_the_roots_bits(dtype, small_chunks, world):
    # (The reference has no broadcast: the root's bytes are its result, which mpi4py's
    # bcast hands round.) Every dtype, of random bytes (NaN payloads, bools of any
    # byte: nothing may be computed on the way), from a root that changes with the
    # count, at the sizes of the test above: in the header exchange, in the root's
    # board, and in chunks of 64 bytes down the ring.
    own = max(small_chunks._core.broadcast_inline_capacity // dtype.itemsize, 1)
    for n in around_inline_limit(small_chunks, dtype.itemsize, SIZES) + [own, own + 1]:
        root = n % SIZE
        x = random_bits(dtype, n, [RANK, n, 32])
        roots_data = world.bcast(x.copy(), root=root)
        assert small_chunks.broadcast(x, root=root) is x
        assert bitwise_equal(x, roots_data), (n, root)


def test_broadcast_non_contiguous_and_shapes(comm, world):
    base = rank_data(np.dtype(np.int32), 200, salt=5).reshape(10, 20)
    view = base[:, ::3]
    expected = world.bcast(view.copy(), root=0)
    untouched = base[:, 1::3].copy()
    assert comm.broadcast(view, root=0) is view
    np.testing.assert_array_equal(view, expected)
    np.testing.assert_array_equal(base[:, 1::3], untouched)  # only the view was written
    scalar = np.array(float(RANK))
    comm.broadcast(scalar, root=SIZE - 1)
    assert scalar == SIZE - 1
    y = rank_data(np.dtype(np.float32), 1000, salt=6)
    expected = world.bcast(y.copy(), root=0)
    rr.broadcast(y)
    assert bitwise_equal(y, expected)


def test_broadcast_many_chunks_large(world):
    x = rank_data(np.dtype(np.float32), 1 << 20, salt=7)
    expected = world.bcast(x.copy(), root=SIZE // 2)
    with rr.Communicator(chunk_bytes=8192) as ring:
        ring.broadcast(x, root=SIZE // 2)
    assert bitwise_equal(x, expected)


# The collectives past SHM_MAX_BYTES (8 MiB), where every call goes by MPI messages
# whatever rank 0's tuner says: until now held to the reference only inside random
# sequences (test_random_sequences.py), which reach there now and then. One call of
# each, 1 MiB past the limit and an odd number of elements more: the ranks' segments
# differ in length, and no segment is a whole number of the default 256 KiB chunks
# (copy-only phases send chunks 64 times larger over MPI: one a segment). float32 sums
# (whose bits tell the order of summing, on 3 ranks and more) and an integer product
# (which wraps: the exact answer, in any order).
BIG_COUNT_BYTES = rr._core.SHM_MAX_BYTES + (1 << 20)


@pytest.mark.parametrize("combo", [(np.dtype(np.float32), "sum"), (np.dtype(np.int16), "prod")],
                         ids=combo_id)
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "broadcast"])
def test_one_call_past_the_shared_memory_limit_gives_the_reference_bits(collective, combo, comm,
                                                                        world):
    dtype, op = combo
    n = BIG_COUNT_BYTES // dtype.itemsize + 2 * SIZE + 1
    core = comm._core
    shm_before, ring_before = core.shm_bytes_sent, core.ring_bytes_sent
    if collective == "allgather":  # (ranks differ in rows; the result is past the limit)
        x = rank_data(dtype, n // SIZE + RANK, op, salt=33)
        got, want = comm.allgather(x), reference.allgather(x, world)
    elif collective == "broadcast":
        x = rank_data(dtype, n, op, salt=33)
        want = x.copy()
        world.Bcast(want, root=SIZE // 2)  # (the root's bytes are the result)
        got = comm.broadcast(x, root=SIZE // 2)
    else:
        x = rank_data(dtype, n, op, salt=33)
        got = getattr(comm, collective)(x, op=op)
        want = getattr(reference, collective)(x, op, world)
    assert got.nbytes >= BIG_COUNT_BYTES // (SIZE if collective == "reduce_scatter" else 1)
    assert bitwise_equal(got, want), (collective, n)
    # Past the limit indeed: the ring ran (on some rank: the one left of a broadcast's
    # root passes nothing on), and not through shared memory.
    assert core.shm_bytes_sent == shm_before
    assert SIZE == 1 or sum(world.allgather(core.ring_bytes_sent - ring_before)) > 0


def test_allgather_into_out_and_in_place(comm, world):
    rows = [(r % 3) + 1 for r in range(SIZE)]
    offset = sum(rows[:RANK])
    x = np.arange(rows[RANK] * 6, dtype=np.float32).reshape(rows[RANK], 2, 3) + 100 * RANK
    expected = np.concatenate(world.allgather(x))
    out = np.full((sum(rows), 2, 3), -1, np.float32)
    assert comm.allgather(x, out=out) is out
    np.testing.assert_array_equal(out, expected)
    # in place: x is this rank's own block of out
    out = np.zeros_like(expected)
    out[offset:offset + rows[RANK]] = x
    assert comm.allgather(out[offset:offset + rows[RANK]], out=out) is out
    np.testing.assert_array_equal(out, expected)
    big = np.full((1 << 16, 4), RANK, np.float64)  # 2 MiB per rank, more than one chunk
    out = np.empty((SIZE << 16, 4))
    comm.allgather(big, out=out)
    np.testing.assert_array_equal(out[::1 << 16, 0], np.arange(SIZE))


def test_reduce_scatter_into_out_in_place_and_overlapping(comm, world):
    n = 1000 + SIZE
    offset, count = rr._core.segment_of(RANK, SIZE, n)
    x = rank_data(np.dtype(np.float64), n, salt=9)
    expected = reference.reduce_scatter(x, "sum", world)
    # in place: out is x's own block, which the ring writes straight into
    inplace = x.copy()
    block = inplace[offset:offset + count]
    assert comm.reduce_scatter(inplace, out=block) is block
    assert bitwise_equal(block, expected)
    if SIZE == 1:
        # The block is all of x: out can overlap it only shifted (and allgather's too,
        # which one rank serves as a copy, like this).
        for call in (comm.reduce_scatter, comm.allgather):
            both = np.append(x, 0.0)
            assert call(both[:n], out=both[1:]).base is both
            assert bitwise_equal(both[1:], expected), call
        return
    # out overlapping x one element off its own block: x must all be read first
    shifted = x.copy()
    start = offset + 1 if offset + 1 + count <= n else offset - 1
    other = shifted[start:start + count]
    assert comm.reduce_scatter(shifted, out=other) is other
    assert bitwise_equal(other, expected)


# (From a review.) The test above stays within the header exchange, which copies
# anyway: only a call large enough for the ring shows whether an out overlapping x,
# other than as x's own block, gets the block only after all of x has been read.
@pytest.mark.skipif(SIZE < 2, reason="one rank's block is all of x: nothing to shift it by")
@pytest.mark.parametrize("step", [1, -1])
def test_reduce_scatter_into_out_overlapping_a_large_input(step, comm, world):
    n = 100_000 + SIZE
    offset, count = rr._core.segment_of(RANK, SIZE, n)
    x = rank_data(np.dtype(np.float64), n, salt=19)
    expected = reference.reduce_scatter(x, "sum", world)
    start = offset + step
    if not 0 <= start <= n - count:  # (the first block cannot move back, the last on)
        start = offset - step
    shifted = x.copy()
    other = shifted[start:start + count]
    assert comm.reduce_scatter(shifted, out=other) is other
    assert bitwise_equal(other, expected)
    handle_x = x.copy()
    other = handle_x[start:start + count]
    assert comm.reduce_scatter_async(handle_x, out=other).wait() is other
    assert bitwise_equal(other, expected)


def test_fast_and_general_paths_meet_in_one_call(comm, world):
    # Even ranks pass contiguous arrays (the Python fast paths), odd ranks strided views
    # (the general paths): the core must see the same call from both.
    n = 100
    base = rank_data(np.dtype(np.float64), 2 * n, salt=11)
    x = base[:n].copy() if RANK % 2 == 0 else base[::2]
    plain = np.ascontiguousarray(x)
    assert bitwise_equal(comm.reduce_scatter(x), reference.reduce_scatter(plain, "sum", world))
    assert bitwise_equal(comm.allgather(x), np.concatenate(world.allgather(plain)))
    expected = world.bcast(plain, root=SIZE - 1)
    assert comm.broadcast(x, root=SIZE - 1) is x
    assert bitwise_equal(np.ascontiguousarray(x), expected)


def test_broadcast_from_a_read_only_strided_root(comm, world):
    root = SIZE - 1
    base = rank_data(np.dtype(np.float64), 40, salt=14)
    x = base[::2]
    if RANK == root:
        x.flags.writeable = False  # the root only reads
    expected = world.bcast(np.ascontiguousarray(x), root=root)
    assert comm.broadcast(x, root=root) is x
    assert bitwise_equal(np.ascontiguousarray(x), expected)


def test_small_calls_on_non_native_byte_order(comm, world):
    # Big-endian x: the fast paths leave it to the general ones, which convert it.
    x = rank_data(np.dtype(np.float64), 10, salt=12).astype(">f8")
    native = x.astype(np.float64)
    assert bitwise_equal(comm.reduce_scatter(x), reference.reduce_scatter(native, "sum", world))
    assert bitwise_equal(comm.allgather(x), np.concatenate(world.allgather(native)))
    assert bitwise_equal(comm.allreduce(x), reference.allreduce(native, "sum", world))


def test_ranks_may_differ_in_byte_order_in_the_reference_as_in_the_core(comm, world):
    # Every rank's x is read in its own byte order, and the results come in the
    # machine's: the reference's ring passes raw bytes, and once read a big-endian rank's
    # bytes as the others' little-endian numbers (and returned big-endian results).
    for n in sorted({10, comm._core.inline_capacity // 8 + 1}):  # (the header; the ring)
        plain = rank_data(np.dtype(np.float64), n, salt=13)
        x = plain.astype(">f8" if RANK % 2 == 0 else "<f8")  # (one rank: big-endian too)
        for call, ref in ((comm.allreduce, reference.allreduce),
                          (comm.reduce_scatter, reference.reduce_scatter)):
            want = ref(plain, "max", world)
            assert bitwise_equal(ref(x, "max", world), want), (n, call.__name__)
            assert bitwise_equal(call(x, op="max"), want), (n, call.__name__)
        gathered = np.concatenate(world.allgather(plain))
        assert bitwise_equal(reference.allgather(x, world), gathered), n
        assert bitwise_equal(comm.allgather(x), gathered), n


WIRES = (rr._core.WIRE_SHM, rr._core.WIRE_MPI, rr._core.WIRE_SHM_STREAMING)


def as_if_fastest(core, collective, nbytes, fast):
    """Rank 0's tuner, as if `fast` had been much the fastest wire lately for calls of
    nbytes (three times of each wire)."""
    if RANK == 0:
        for _ in range(3):
            for wire in WIRES:
                core.record_wire_time(collective, nbytes, wire, 1e-9 if wire == fast else 1.0)


def streamed(fast):
    """What shm_streaming says after a call through the slots on wire `fast`."""
    return fast == rr._core.WIRE_SHM_STREAMING and rr._core.STREAMING_STORES


def test_rank_0_picks_the_wire_for_every_rank(world):
    with rr.Communicator() as ring:
        if ring.transport != "shared memory":
            pytest.skip("needs ranks that share memory")
        if os.environ.get("RINGREDUCE_SHM"):
            pytest.skip("RINGREDUCE_SHM fixes the wire")
        x = rank_data(np.dtype(np.float32), (1 << 20) // 4, salt=13)
        rs = rr._core.COLLECTIVES["reduce_scatter"]
        core = ring._core
        for fast in (rr._core.WIRE_MPI, rr._core.WIRE_SHM, rr._core.WIRE_SHM_STREAMING,
                     rr._core.WIRE_SHM):
            as_if_fastest(core, rs, x.nbytes, fast)
            shm_before, all_before = core.shm_bytes_sent, core.ring_bytes_sent
            assert bitwise_equal(ring.reduce_scatter(x), reference.reduce_scatter(x, "sum", world))
            assert core.ring_bytes_sent > all_before
            if fast == rr._core.WIRE_MPI:
                assert core.shm_bytes_sent == shm_before
            else:
                assert core.shm_bytes_sent > shm_before
                assert core.shm_streaming == streamed(fast)
        # allgather: rank 0 proposes its wire before it knows every rank's rows
        rows = rank_data(np.dtype(np.float32), (1 << 20) // 4 // SIZE, salt=15)
        ag = rr._core.COLLECTIVES["allgather"]
        for fast in WIRES:
            as_if_fastest(core, ag, rows.nbytes * SIZE, fast)
            shm_before = core.shm_bytes_sent
            assert bitwise_equal(ring.allgather(rows), np.concatenate(world.allgather(rows)))
            assert (core.shm_bytes_sent > shm_before) == (fast != rr._core.WIRE_MPI)
            if fast != rr._core.WIRE_MPI:
                assert core.shm_streaming == streamed(fast)
        with pytest.raises(ValueError, match="wire must be one of"):
            core.record_wire_time(rs, x.nbytes, True, 1.0)  # (a bool: the old argument)



@pytest.mark.parametrize("setting", ["1", "stream"])
def test_the_environment_can_fix_the_wire(setting, world, monkeypatch):
    monkeypatch.setenv("RINGREDUCE_SHM", setting)  # (read as a Communicator is made)
    with rr.Communicator() as ring:
        if ring.transport != "shared memory" or SIZE == 1:
            pytest.skip("needs ranks that share memory")
        core = ring._core
        x = rank_data(np.dtype(np.float32), (1 << 20) // 4, salt=14)
        expected = reference.allreduce(x, "sum", world)
        for _ in range(2 * rr._core.WireTuner.EXPLORE_EVERY):  # (never a look elsewhere)
            shm_before, all_before = core.shm_bytes_sent, core.ring_bytes_sent
            assert bitwise_equal(ring.allreduce(x), expected)
            assert core.shm_bytes_sent - shm_before == core.ring_bytes_sent - all_before > 0
            assert core.shm_streaming == (setting == "stream" and rr._core.STREAMING_STORES)


def test_broadcast_runs_down_the_shared_memory_slots_and_over_mpi_alike(world):
    # Past the root's board, broadcast goes down the ring: through the shared-memory
    # slots (64 KiB each, 8 per rank, so 1 MiB wraps them twice; written with ordinary
    # or streaming stores) unless rank 0's tuner says MPI. Every wire, three roots, sizes
    # around a slot (fewer than WireTuner.EXPLORE_EVERY calls of a size class: the
    # tuner never tries another wire).
    with rr.Communicator() as ring:
        if ring.transport != "shared memory":
            pytest.skip("needs ranks that share memory")
        if os.environ.get("RINGREDUCE_SHM"):
            pytest.skip("RINGREDUCE_SHM fixes the wire")
        core = ring._core
        bc = rr._core.COLLECTIVES["broadcast"]
        slot = 64 << 10
        for nbytes in (core.broadcast_inline_capacity + 8, slot, slot + 8, 3 * slot - 8,
                       (1 << 20) + 24):
            for fast in WIRES:
                shm = fast != rr._core.WIRE_MPI
                as_if_fastest(core, bc, nbytes, fast)
                for root in sorted({0, SIZE // 2, SIZE - 1}):
                    x = rank_data(np.dtype(np.float64), nbytes // 8, salt=root)
                    roots_data = world.bcast(x.copy(), root=root)
                    shm_before, all_before = core.shm_bytes_sent, core.ring_bytes_sent
                    assert ring.broadcast(x, root=root) is x
                    assert bitwise_equal(x, roots_data), (nbytes, fast, root)
                    # every rank but the one left of the root passes the data on
                    passes_on = SIZE > 1 and (RANK - root) % SIZE != SIZE - 1
                    moved = core.ring_bytes_sent - all_before
                    assert moved == (nbytes if passes_on else 0), (nbytes, fast, root)
                    assert core.shm_bytes_sent - shm_before == (moved if shm else 0)
                    if shm and SIZE > 1:
                        assert core.shm_streaming == streamed(fast)


def test_big_results_reuse_only_buffers_nothing_else_holds(world, monkeypatch):
    # Results without out= from MIN_BYTES on come from kept buffers (lowered here to
    # keep the test small, before the Communicator that reads it is made). A buffer is
    # reused only once every result, view and buffer export of it is gone: results the
    # caller keeps must never change.
    monkeypatch.setattr(communicator._Results, "MIN_BYTES", 1 << 12)
    with rr.Communicator() as comm:
        _reuse_only_buffers_nothing_else_holds(comm, world)


@pytest.mark.skipif(SIZE == 1, reason="one rank gathers only its own rows")
def test_a_wrong_guess_at_a_big_allgather_leaves_the_kept_buffers_alone(world, monkeypatch):
    # The core's fast path allocates a result without out= for as many rows from every
    # rank as from this one, before it knows. Not one as big as the kept buffers'
    # (MIN_BYTES on, lowered here): a wrong guess would push out the idle buffer that
    # the result of the true size would have reused, page faults and all.
    monkeypatch.setattr(communicator._Results, "MIN_BYTES", 1 << 12)
    with rr.Communicator() as comm:
        x = np.arange(1024 * (RANK + 1), dtype=np.float32) + RANK  # rows differ by rank
        expected = np.concatenate(world.allgather(x))
        first = comm.allgather(x)
        np.testing.assert_array_equal(first, expected)
        buffer = weakref.ref(first.base)
        del first
        second = comm.allgather(x)
        np.testing.assert_array_equal(second, expected)
        assert second.base is buffer()


def _reuse_only_buffers_nothing_else_holds(comm, world):
    last_handed_out = lambda: comm._results.buffers[-1]  # noqa: E731
    kept = []
    for step in range(6):
        x = np.arange(1 << 16, dtype=np.float32) + RANK + 1000 * step  # too big for the header
        gathered = comm.allgather(x)
        assert gathered.base is last_handed_out()
        summed = comm.allreduce(x)
        assert summed.base is last_handed_out()
        async_sum = comm.allreduce_async(x).wait()
        assert async_sum.base is last_handed_out()
        part = comm.reduce_scatter(x)
        assert part.base is last_handed_out()
        expected_gather = np.concatenate(world.allgather(x))
        np.testing.assert_array_equal(summed, sum(world.allgather(x)))
        np.testing.assert_array_equal(async_sum, summed)
        np.testing.assert_array_equal(part, np.array_split(summed, SIZE)[RANK])
        # Kept whole, as a view, as a memoryview: each must keep its buffer out of use.
        kept.append((gathered if step % 3 == 0 else gathered[1:] if step % 3 == 1
                     else memoryview(gathered),
                     expected_gather[1:] if step % 3 == 1 else expected_gather))
        del gathered, summed, async_sum, part
    for held, expected in kept:
        np.testing.assert_array_equal(np.asarray(held), expected)
    # A dropped result's buffer is handed out again. (Held: the other kept buffer's
    # result, so that the dropped one's is the only idle one.)
    held = comm.allreduce(x)
    summed = comm.allreduce(x)
    assert len(comm._results.buffers) == communicator._Results.KEEP == 2
    buffer = weakref.ref(summed.base)
    del summed
    assert comm.allreduce(x).base is buffer()
    assert held.base is not buffer()
    small = comm.allreduce(np.ones(3))  # below MIN_BYTES: np.empty as before
    assert small.flags.owndata


def test_results_hands_out_a_buffer_again_only_when_it_is_alone():
    results = communicator._Results()
    big = results.MIN_BYTES // 8
    address = lambda a: a.__array_interface__["data"][0]  # noqa: E731
    a = results.empty((big,), np.float64)
    a[:] = 7.0
    b = results.empty((2, big // 2), np.int64)  # as many bytes: a's buffer is in use
    assert not np.shares_memory(a, b) and b.shape == (2, big // 2) and b.dtype == np.int64
    view = a[::2]
    del a
    c = results.empty(big, np.float64)  # the view holds a's buffer, b holds b's
    assert not np.shares_memory(c, view) and not np.shares_memory(c, b)
    assert len(results.buffers) == results.KEEP  # a's buffer is let go (the view keeps it)
    b_address = address(b)
    del b
    d = results.empty((big,), np.int64)
    assert address(d) == b_address  # nothing held b's buffer any more
    assert not np.shares_memory(d, view)
    assert (view == 7.0).all()  # a's buffer was never handed out again
    # A result of another size: a new buffer, and the idle ones of other sizes go.
    del c, d
    e = results.empty(big * 2, np.float64)
    assert [buffer.nbytes for buffer in results.buffers] == [e.nbytes]
    # Beyond MAX_BYTES nothing is kept: a plain new array.
    huge = results.empty(results.MAX_BYTES // 8 + 1, np.float64)
    assert huge.flags.owndata and len(results.buffers) == 1


def test_the_transport_says_why_it_is_mpi(world, monkeypatch):
    monkeypatch.delenv("RINGREDUCE_SHM", raising=False)  # (this module also runs with 0)
    with rr.Communicator() as ring:
        if SIZE == 1:
            assert (ring.transport, ring.transport_reason) == ("MPI", "one rank: no ring")
        elif ring.transport == "shared memory":
            assert ring.transport_reason == ""
    if SIZE > 1:
        # One rank turns shared memory off: every rank uses MPI, and says who did.
        if RANK == SIZE - 1:
            monkeypatch.setenv("RINGREDUCE_SHM", "0")
        with rr.Communicator() as ring:
            assert ring.transport == "MPI"
            assert ring.transport_reason == f"RINGREDUCE_SHM=0 on rank {SIZE - 1}"
            np.testing.assert_array_equal(ring.allreduce(np.ones(1 << 16)), SIZE)


def _placed(buffer, address_mod_4k, nbytes):
    """nbytes of `buffer` (uint8) starting at the given address modulo 4 KiB."""
    start = (address_mod_4k - buffer.ctypes.data) % 4096
    return buffer[start:start + nbytes]


@pytest.mark.parametrize("gap", [1, 16, 63, 64, 2048])
def test_copies_between_buffers_a_few_bytes_apart_modulo_4k(comm, world, gap):
    # The core copies such pairs in pieces (csrc/copy.h: memcpy is 10-17x slower there
    # on some CPUs). Every size around the piece and the limits, odd ones included,
    # with out's own block `gap` bytes past x modulo 4 KiB.
    sizes = (2047, 2048, 2049, 12001, 300_003, (512 << 10) - 1, 600_001)
    # out (SIZE times the largest x, from 1 MiB on) must fit whole on any number of ranks
    # (4 MiB held it on up to 5 only: on 6 or more out came back short, and the call
    # rightly raised MismatchError)
    arena = np.empty((1 << 20) + max(3 << 20, SIZE * max(sizes) + 4096), np.uint8)
    for nbytes in sizes:
        x = _placed(arena[:1 << 20], 100, nbytes)
        x[:] = rank_data(np.dtype(np.uint8), nbytes, salt=gap)
        expected = np.concatenate(world.allgather(x))
        # out's own block starts RANK * nbytes into out
        out = _placed(arena[1 << 20:], (100 + gap - RANK * nbytes) % 4096, SIZE * nbytes)
        assert comm.allgather(x, out=out) is out
        assert bitwise_equal(out, expected), nbytes
        # reduce_scatter: one rank copies x into out; more take the ring
        xs = np.frombuffer(x[:nbytes - nbytes % 4], np.float32)
        xs[:] = rank_data(np.dtype(np.float32), xs.size, salt=gap)
        offset, count = rr._core.segment_of(RANK, SIZE, xs.size)
        block = np.frombuffer(_placed(arena[3 << 20:], (xs.ctypes.data + offset * 4 + gap)
                                      % 4096, count * 4), np.float32)
        assert comm.reduce_scatter(xs, out=block) is block
        assert bitwise_equal(block, reference.reduce_scatter(xs, "sum", world)), nbytes
        # allreduce: one rank copies x into out
        summed = np.frombuffer(_placed(arena[2 << 20:], (xs.ctypes.data + gap) % 4096,
                                       xs.nbytes), np.float32)
        assert comm.allreduce(xs, out=summed) is summed
        assert bitwise_equal(summed, reference.allreduce(xs, "sum", world)), nbytes
        # broadcast writes the root's data (inline or from the ring) into x
        root_data = world.bcast(x.copy(), root=0)
        comm.broadcast(x, root=0)
        assert bitwise_equal(x, root_data), nbytes


@pytest.mark.parametrize("layout", ["strided", "byte-swapped", "2-D column"])
def test_reduce_scatter_and_allgather_of_a_strided_x_of_odd_sizes(layout, small_chunks, world):
    # A strided (or byte-swapped) x goes straight into the workspace (reduce_scatter)
    # or its rows of the result (allgather) rather than into a copy of its own: the
    # same bits as for a contiguous x, at sizes on either side of the header exchange's
    # limit and ones that leave the ranks' blocks uneven.
    def strided(a):
        if layout == "strided":
            return np.repeat(a, 2)[::2] if a.size else a[::1]  # (a view with stride 2)
        if layout == "byte-swapped":
            return a.astype(a.dtype.newbyteorder())
        column = np.repeat(a.reshape(-1, 1), 3, axis=1)[:, 1]  # (a 2-D array's column)
        return column
    for n in around_inline_limit(small_chunks, 8, [1, SIZE + 2, 517, 4099]):
        plain = rank_data(np.dtype(np.float64), n, salt=21)
        x = strided(plain)
        assert bitwise_equal(np.ascontiguousarray(x).astype(np.float64), plain)
        if n > 1 and layout != "byte-swapped":
            assert not x.flags.c_contiguous
        want = reference.reduce_scatter(plain, "sum", world)
        assert bitwise_equal(small_chunks.reduce_scatter(x), want), n
        out = np.full(want.shape, np.nan)
        assert small_chunks.reduce_scatter(x, out=out) is out
        assert bitwise_equal(out, want), n
        assert bitwise_equal(small_chunks.reduce_scatter_async(x).wait(), want), n
        rows = n + RANK  # (ranks differ in rows: uneven blocks of the result)
        plain_rows = rank_data(np.dtype(np.float64), rows, salt=22)
        x_rows = strided(plain_rows)
        gathered = np.concatenate(world.allgather(plain_rows))
        assert bitwise_equal(small_chunks.allgather(x_rows), gathered), n
        out = np.full(gathered.shape, np.nan)
        assert small_chunks.allgather(x_rows, out=out) is out
        assert bitwise_equal(out, gathered), n
        assert bitwise_equal(small_chunks.allgather_async(x_rows).wait(), gathered), n
        assert bitwise_equal(np.ascontiguousarray(x_rows).astype(np.float64), plain_rows)


def test_allgather_of_a_strided_x_inside_out_gives_the_right_answer(comm, world):
    # x a strided view of out itself: copied first (the ring overwrites out's other
    # rows while x would still be read).
    n = 20_000 + RANK
    rows = world.allgather(n)
    total = sum(rows)
    out = rank_data(np.dtype(np.float64), total, salt=23)
    x = out[::2][:n] if 2 * n <= total else out[-n:]
    gathered = np.concatenate(world.allgather(x.copy()))
    assert comm.allgather(x, out=out) is out
    assert bitwise_equal(out, gathered)


def test_a_strided_x_costs_no_copy_of_its_own_in_reduce_scatter_or_allgather(comm, world):
    # reduce_scatter copies a strided x into its workspace (kept by the Communicator:
    # allocated by the first call only), allgather into its rows of the result: no
    # array of x's size at every call (it had cost one each). Counted by tracemalloc,
    # which sees numpy's allocations (the core's own buffers, a few chunks, are not
    # numpy's). 8 MiB: not a kept result. (One rank has no ring: reduce_scatter copies
    # x there, and keeps no workspace.)
    n = 1 << 20
    base = rank_data(np.dtype(np.float64), 2 * n, salt=24)
    x = base[::2]
    nbytes = x.nbytes
    want_part = reference.reduce_scatter(x.copy(), "sum", world)
    want_all = np.concatenate(world.allgather(x.copy()))
    part = np.empty_like(want_part)
    gathered = np.empty_like(want_all)
    comm.reduce_scatter(x, out=part)  # (the workspace, made once)
    assert bitwise_equal(part, want_part)
    calls = [("reduce_scatter out=", lambda: comm.reduce_scatter(x, out=part), 0, want_part),
             ("reduce_scatter new", lambda: comm.reduce_scatter(x), want_part.nbytes,
              want_part),
             ("allgather out=", lambda: comm.allgather(x, out=gathered), 0, want_all),
             ("allgather new", lambda: comm.allgather(x), want_all.nbytes, want_all)]
    for what, call, result_bytes, want in calls[2 * (SIZE == 1):]:
        got, peak = result_and_peak_allocated(call)
        assert peak < result_bytes + nbytes // 4, (what, peak)
        assert bitwise_equal(got, want), what
        del got
