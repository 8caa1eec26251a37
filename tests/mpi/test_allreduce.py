"""allreduce on every dtype x op, every awkward size, in place and out of place."""
import os

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import reference

from helpers import (BFLOAT16, COMBOS, DTYPES, around_inline_limit, bitwise_equal,
                     check_against_float64, combo_id, exact_integer_reduce, on_one_machine,
                     pretended_machines, rank_data, result_and_peak_allocated,
                     same_on_every_rank, supported, tied_values)

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
# 0..1000 elements: over MPI messages, 64, 65, 256 and 257 straddle the size (256 bytes)
# up to which the payload rides in the header exchange (no ring) and beyond which the
# ring runs, for every element size.
SIZES = sorted({0, 1, max(SIZE - 1, 1), SIZE, 3 * SIZE + 1, 64, 65, 256, 257, 1000})


def test_the_inline_limit_is_where_the_ring_starts(comm):
    x = np.ones(comm._core.inline_capacity // 4, np.float32)
    steps = comm._core.ring_steps
    comm.allreduce(x)
    assert comm._core.ring_steps == steps  # inside the header exchange
    comm.allreduce(np.ones(x.size + 1, np.float32))
    assert comm._core.ring_steps == steps + 2 * (SIZE - 1)


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_every_dtype_and_op_matches_reference_and_float64(combo, small_chunks, world):
    dtype, op = combo
    for n in around_inline_limit(small_chunks, dtype.itemsize, SIZES):
        x = rank_data(dtype, n, op)
        before = x.copy()
        y = small_chunks.allreduce(x, op=op)
        assert bitwise_equal(x, before), "x was modified"
        assert y.shape == x.shape and y.dtype == x.dtype
        # The core and the numpy reference agree bit for bit.
        assert bitwise_equal(y, reference.allreduce(x, op, world)), f"n={n}"
        assert same_on_every_rank(y)
        everyone = world.allgather(x)
        if dtype.kind in "iub":
            np.testing.assert_array_equal(y, exact_integer_reduce(everyone, op))
        else:
            check_against_float64(y, everyone, op)


@pytest.mark.skipif(SIZE < 2, reason="one rank sums nothing")
@pytest.mark.parametrize("chunked", [False, True])
def test_each_segment_is_summed_in_the_order_explain_prints(chunked, comm, small_chunks, world):
    # `python -m ringreduce explain` tells a learner in what order each segment's terms
    # are added ("S0 = x0+(x3+(x2+x1))"): float32 sums of those expressions, evaluated
    # here by numpy, are the core's results bit for bit, whatever the chunk size, in
    # the header exchange and in the ring.
    from ringreduce.explain import explain

    ring = small_chunks if chunked else comm
    for n in around_inline_limit(ring, 4, [SIZE, 1000, 100_003]):
        rng = np.random.default_rng([RANK, n])
        # Magnitudes far apart, so that another order rounds otherwise.
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 7, n)).astype(np.float32)
        y = ring.allreduce(x)
        terms = world.allgather(x)
        e = explain(SIZE, n, ring=list(ring.ring))  # (another order on several machines)
        reordered = 0
        for (first, count), order in zip(e.segments, e.orders):
            part = slice(first, first + count)
            named = {f"x{r}": terms[r][part] for r in range(SIZE)}
            expected = eval(order, {}, named)
            assert bitwise_equal(y[part], expected), (n, order)
            in_rank_order = sum(terms[r][part] for r in range(1, SIZE))
            reordered += np.count_nonzero(terms[0][part] + in_rank_order != expected)
        if SIZE > 2 and n >= 1000:  # (the check can fail: another order differs)
            assert reordered > 0


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.kind == "f" or d == BFLOAT16], ids=str)
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_and_max_break_ties_as_the_reference_on_every_rank(dtype, op, small_chunks, world):
    # Ranks holding +0 and -0 (equal values) or NaNs: which one the result keeps is the
    # reference's rule (the first operand), so every byte matches it and every rank's.
    # numpy's own np.minimum takes one or the other by dtype (and CPU).
    for n in around_inline_limit(small_chunks, dtype.itemsize, SIZES):
        x = tied_values(dtype, n, [RANK, n])
        for call, ref in ((small_chunks.allreduce, reference.allreduce),
                          (small_chunks.reduce_scatter, reference.reduce_scatter)):
            y = call(x, op=op)
            assert bitwise_equal(y, ref(x, op, world)), f"{call.__name__}, n={n}"
            if call == small_chunks.allreduce:  # (reduce_scatter's blocks differ by rank)
                assert same_on_every_rank(y)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int64)],
                         ids=str)
def test_result_does_not_depend_on_chunk_size(dtype, comm):
    x = rank_data(dtype, 10_007)
    results = []
    for chunk_bytes in (1, 8, 100, 4096, rr._core.DEFAULT_CHUNK_BYTES):
        with rr.Communicator(chunk_bytes=chunk_bytes) as ring:
            results.append(ring.allreduce(x))
    assert all(bitwise_equal(r, results[0]) for r in results)


@pytest.mark.parametrize("wire", ["shared memory", "MPI"])
@pytest.mark.parametrize("combo", [(np.dtype(np.float32), "sum"), (np.dtype(np.float32), "avg"),
                                   (np.dtype(np.float16), "sum")], ids=combo_id)
def test_results_are_the_same_bits_on_every_rank_and_chunk_size_over_either_wire(
        combo, wire, monkeypatch):
    # api.md: "bitwise identical on every rank and does not depend on chunk_bytes", for
    # reduce_scatter as for allreduce, and over MPI messages as through shared memory
    # (the test above leaves the wire to rank 0's timing, and reduces only). Segments of
    # several chunks at each size but the default.
    dtype, op = combo
    x = rank_data(dtype, 3000 * SIZE + 7, op)
    results = []
    for chunk_bytes in (64, 100, 4096, rr._core.DEFAULT_CHUNK_BYTES):
        monkeypatch.setenv("RINGREDUCE_SHM", "1" if wire == "shared memory" else "0")
        ring = rr.Communicator(chunk_bytes=chunk_bytes)
        monkeypatch.delenv("RINGREDUCE_SHM")
        if ring.transport != wire:  # (one rank: no ring; or not one machine)
            ring.close()
            pytest.skip(f"no {wire}: {ring.transport_reason}")
        with ring:
            results.append((ring.allreduce(x, op=op), ring.reduce_scatter(x, op=op)))
    for reduced, block in results:
        assert bitwise_equal(reduced, results[0][0]) and bitwise_equal(block, results[0][1])
    assert same_on_every_rank(results[0][0])
    check_against_float64(results[0][0], MPI.COMM_WORLD.allgather(x), op)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.kind == "f" or d == BFLOAT16], ids=str)
def test_the_wire_and_the_header_exchange_do_not_change_the_bits(dtype, comm, monkeypatch):
    # api.md: "nor on the wire ... nor on whether the call rode in the header exchange",
    # which is what makes a job run again, whichever wire rank 0's timing picks, give the
    # same bits. Communicators side by side in one job: `comm`'s wire is tuned, the others
    # fixed; between 256 bytes and 16 KiB a call rides in the header through shared
    # memory but runs the ring over MPI messages, so there the two paths meet.
    wires = {"tuned": comm}
    for setting in ("0", "1", "stream"):
        monkeypatch.setenv("RINGREDUCE_SHM", setting)
        wires[setting] = rr.Communicator()
    monkeypatch.delenv("RINGREDUCE_SHM")
    try:
        if wires["1"].transport != "shared memory":  # (one rank, or not one machine)
            pytest.skip(f"no shared memory: {wires['1'].transport_reason}")
        assert wires["0"].transport == "MPI"
        header_only, ring_too = wires["1"]._core.inline_capacity, wires["0"]._core.inline_capacity
        sizes = {1, SIZE, ring_too // dtype.itemsize + 1, header_only // dtype.itemsize,
                 header_only // dtype.itemsize + 1, 3000 * SIZE + 7}
        for n in sorted(sizes):
            for op in ("sum", "avg", "prod"):
                x = rank_data(dtype, n, op)
                results = {}
                for name, ring in wires.items():
                    steps = ring._core.ring_steps
                    out, in_place = np.empty_like(x), x.copy()
                    results[name] = (ring.allreduce(x, op=op),
                                     ring.allreduce(x, op=op, out=out),
                                     ring.allreduce(in_place, op=op, out=in_place),
                                     ring.allreduce_async(x, op=op).wait(),
                                     ring.reduce_scatter(x, op=op))
                    rode_in_header = ring._core.ring_steps == steps
                    assert rode_in_header == (n * dtype.itemsize <= ring._core.inline_capacity)
                first = results["tuned"][0]
                for name, got in results.items():
                    assert all(bitwise_equal(y, first) for y in got[:4]), (n, op, name)
                    assert bitwise_equal(got[4], results["tuned"][4]), (n, op, name)
                assert same_on_every_rank(first)
    finally:
        for setting in ("0", "1", "stream"):
            wires[setting].close()


@pytest.fixture(scope="module")
def odd_chunks():
    """Chunks of a byte count that no element size divides."""
    with rr.Communicator(chunk_bytes=12345) as ring:
        yield ring


def order_telling_data(dtype, n, op):
    """Rank-dependent data whose reduction's bits depend on the order of its operands:
    for min and max, ties of +0 and -0 and NaNs of either sign (the first of two equal
    values is kept); for sums, magnitudes far apart (each order rounds otherwise)."""
    if dtype.kind in "iub" or op == "prod":
        return rank_data(dtype, n, op, salt=7)
    if op in ("min", "max"):
        return tied_values(dtype, n, [RANK, n, 7])
    rng = np.random.default_rng([RANK, n, 7])
    top = 3 if dtype == np.float16 else 6  # (float16 sums stay below its 65504)

    def part():
        return rng.standard_normal(n) * 10.0 ** rng.integers(-top, top + 1, n)

    return (part() + 1j * part() if dtype.kind == "c" else part()).astype(dtype)


# Every op on some dtype, every float dtype with an op whose bits tell the order.
EVERY_WAY_COMBOS = [(np.dtype(d) if d != "bfloat16" else BFLOAT16, op) for d, op in [
    ("float16", "avg"), ("bfloat16", "sum"), ("bfloat16", "min"), ("float32", "min"),
    ("float32", "prod"), ("float64", "max"), ("float64", "avg"), ("complex64", "prod"),
    ("complex128", "avg"), ("int8", "prod"), ("bool", "min")]
    if d != "bfloat16" or BFLOAT16 is not None]


@pytest.mark.parametrize("combo", EVERY_WAY_COMBOS, ids=combo_id)
def test_every_way_of_calling_gives_the_reference_bits(combo, comm, odd_chunks, world):
    # api.md: the bits do not depend "on chunk_bytes ..., nor on the wire ..., nor on
    # whether the call rode in the header exchange, nor on out=, in place or _async: it
    # is reference.allreduce's, bit for bit". The tests above hold plain calls to it in
    # chunks of 64 bytes; these, every way of making a call, in the default chunks (a
    # segment of more than one 64 KiB shared-memory slot), and plain calls in chunks of
    # a byte count no element size divides. Sums and products show the order of
    # summing, min and max the order of each step's two operands (of +0 and -0 the first
    # is kept): reduced the other way round anywhere, into out= say, the bits differ.
    dtype, op = combo
    slot = rr._core.SHM_SLOT_BYTES
    for n in sorted({max(comm._core.inline_capacity // dtype.itemsize, 1),
                     (slot // dtype.itemsize + 3) * SIZE + 1}):
        x = order_telling_data(dtype, n, op)
        want = reference.allreduce(x, op, world)
        offset, count = rr._core.segment_of(RANK, SIZE, n)
        want_block = want[offset:offset + count]  # (reference.reduce_scatter's: one ring)
        spread = np.zeros(2 * n, dtype)
        strided = spread[::2]
        strided[...] = x
        out, in_place, block_in_place = np.empty_like(x), x.copy(), x.copy()
        block = np.empty(count, dtype)
        ways = {"new": comm.allreduce(x, op=op),
                "out=": comm.allreduce(x, op=op, out=out),
                "in place": comm.allreduce(in_place, op=op, out=in_place),
                "async": comm.allreduce_async(x, op=op).wait(),
                "strided": comm.allreduce(strided, op=op),
                "odd chunks": odd_chunks.allreduce(x, op=op)}
        blocks = {"new": comm.reduce_scatter(x, op=op),
                  "out=": comm.reduce_scatter(x, op=op, out=block),
                  "in place": comm.reduce_scatter(
                      block_in_place, op=op, out=block_in_place[offset:offset + count]),
                  "async": comm.reduce_scatter_async(x, op=op).wait(),
                  "strided": comm.reduce_scatter(strided, op=op),
                  "odd chunks": odd_chunks.reduce_scatter(x, op=op)}
        for way, got in ways.items():
            assert bitwise_equal(got, want), (n, "allreduce", way)
        for way, got in blocks.items():
            assert bitwise_equal(got, want_block), (n, "reduce_scatter", way)
        assert bitwise_equal(x, order_telling_data(dtype, n, op)), "x was modified"
        assert bitwise_equal(strided, x), "the strided x was modified"


# test_result_does_not_depend_on_chunk_size compares chunk_bytes=1 with other chunk
# sizes only. A chunk_bytes below one element's size makes chunks of one element
# (RingCommunicator::chunk_elems), here 1 and 3 bytes against 8- and 16-byte elements:
# held to the reference's bits, and for every collective. The data tell the order of
# summing (magnitudes far apart) and of each step's operands (ties of +0 and -0, NaNs
# of either sign, which max keeps the first of), so a chunk reduced out of turn shows.
@pytest.mark.parametrize("chunk_bytes", [1, 3])
@pytest.mark.parametrize("combo", [(np.dtype(np.float64), "sum"), (np.dtype(np.float64), "max"),
                                   (np.dtype(np.complex128), "prod"),
                                   (np.dtype(np.complex128), "avg")], ids=combo_id)
def test_chunks_smaller_than_one_element_give_the_reference_bits(combo, chunk_bytes, world):
    dtype, op = combo
    with rr.Communicator(chunk_bytes=chunk_bytes) as ring:
        own = max(ring._core.broadcast_inline_capacity // dtype.itemsize, 1)
        for n in around_inline_limit(ring, dtype.itemsize, [1, max(SIZE - 1, 1), 3 * SIZE + 1,
                                                            own + 1]):
            x = order_telling_data(dtype, n, op)
            # The reference's bits as raw bytes: NaNs of either sign must match too
            # (bitwise_equal compares bytes; assert_array_equal would take any NaN).
            assert bitwise_equal(ring.allreduce(x, op=op), reference.allreduce(x, op, world)), n
            assert bitwise_equal(ring.reduce_scatter(x, op=op),
                                 reference.reduce_scatter(x, op, world)), n
            rows = x[:n - RANK % 2]  # (ranks differ in rows)
            assert bitwise_equal(ring.allgather(rows), reference.allgather(rows, world)), n
            roots_data = world.bcast(x, root=n % SIZE)
            assert bitwise_equal(ring.broadcast(x.copy(), root=n % SIZE), roots_data), n


def test_a_few_mib_default_and_small_chunks(comm, world):
    x = rank_data(np.dtype(np.float32), 3 * 1024 * 1024 // 4 + 3)  # 3 MiB and change
    y = comm.allreduce(x)
    assert bitwise_equal(y, reference.allreduce(x, "sum", world))
    with rr.Communicator(chunk_bytes=4096) as ring:  # ~200 chunks per segment
        assert bitwise_equal(ring.allreduce(x), y)
    check_against_float64(y, world.allgather(x), "sum")


@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (1,), (3, 4, 5), (2, 1, 7)], ids=str)
def test_any_shape_keeps_shape(shape, small_chunks, world):
    x = rank_data(np.dtype(np.float64), int(np.prod(shape))).reshape(shape)
    y = small_chunks.allreduce(x)
    assert y.shape == shape
    np.testing.assert_allclose(y, sum(world.allgather(x)), rtol=1e-12, atol=1e-12)


def test_in_place_equals_out_of_place(small_chunks):
    x = rank_data(np.dtype(np.float32), 777)
    expected = small_chunks.allreduce(x, op="avg")
    buf = x.copy()
    returned = small_chunks.allreduce(buf, op="avg", out=buf)
    assert returned is buf
    assert bitwise_equal(buf, expected)


def test_out_is_filled_and_returned(small_chunks):
    x = rank_data(np.dtype(np.int32), 501).reshape(3, 167)
    out = np.full_like(x, 7)
    returned = small_chunks.allreduce(x, op="max", out=out)
    assert returned is out
    np.testing.assert_array_equal(out, small_chunks.allreduce(x, op="max"))


def test_non_contiguous_input_is_copied_not_modified(small_chunks, world):
    base = rank_data(np.dtype(np.float64), 600).reshape(20, 30)
    for x in (base[::2], base.T, base[:, 3], base[::-1, ::3]):
        before = base.copy()
        y = small_chunks.allreduce(x)
        assert y.shape == x.shape and y.flags.c_contiguous
        np.testing.assert_allclose(y, sum(world.allgather(np.ascontiguousarray(x))), rtol=1e-12,
                                   atol=1e-12)
        assert bitwise_equal(base, before)


def test_out_overlapping_input_gives_the_right_answer(small_chunks, world):
    buf = rank_data(np.dtype(np.float64), 101)
    x, out = buf[:100], buf[1:]  # same shape, overlapping by all but one element
    expected = sum(world.allgather(x.copy()))
    small_chunks.allreduce(x, out=out)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


# (From a review.) 100 elements ride in the header exchange, which copies them anyway:
# only a call large enough for the ring shows whether an out overlapping x (but not
# the same buffer) is copied first, as the ring would otherwise read its own writes.
@pytest.mark.parametrize("n", [100, 100_000])
@pytest.mark.parametrize("shift", ["out after x", "out before x"])
@pytest.mark.parametrize("call", ["allreduce", "allreduce_async"])
def test_out_overlapping_input_at_any_size_gives_the_right_answer(call, shift, n, comm, world):
    buf = rank_data(np.dtype(np.float64), n + 1, salt=n)
    x, out = (buf[:n], buf[1:]) if shift == "out after x" else (buf[1:], buf[:n])
    expected = sum(world.allgather(x.copy()))
    if call == "allreduce":
        assert comm.allreduce(x, out=out) is out
    else:
        assert comm.allreduce_async(x, out=out).wait() is out
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_integer_sum_and_prod_wrap_like_numpy(small_chunks, world):
    x = np.array([127, -128, 100, 3], dtype=np.int8) + np.int8(world.Get_rank())
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(small_chunks.allreduce(x), exact_integer_reduce(
            world.allgather(x), "sum"))
        np.testing.assert_array_equal(small_chunks.allreduce(x, op="prod"), exact_integer_reduce(
            world.allgather(x), "prod"))
    u = np.array([2**64 - 1, 2**63], dtype=np.uint64)
    np.testing.assert_array_equal(small_chunks.allreduce(u),
                                  u * np.uint64(SIZE))  # wraps modulo 2**64


@pytest.mark.parametrize("op", ["min", "max", "sum"])
def test_nan_propagates(op, small_chunks, world):
    x = rank_data(np.dtype(np.float32), 50)
    if world.Get_rank() == SIZE - 1:
        x[[0, 17, 49]] = np.nan
    y = small_chunks.allreduce(x, op=op)
    assert np.isnan(y[[0, 17, 49]]).all()
    assert not np.isnan(np.delete(y, [0, 17, 49])).any()


@pytest.mark.parametrize("n", [12, 3000])  # (in the header exchange; by the ring)
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_and_max_pass_on_a_nan_from_any_rank(op, n, small_chunks, world):
    # MPICH's MPI_MAX and MPI_MIN keep a NaN only from some ranks (on 2 ranks: from
    # rank 1, not rank 0); the docs promise np.maximum's NaN from whichever rank holds it.
    # Element k has a NaN on rank k % SIZE only, among infinities that must not win.
    x = rank_data(np.dtype(np.float32), n)
    x[1::2] = np.inf if op == "max" else -np.inf
    nan_here = np.arange(n) % 4 == RANK
    x[nan_here] = np.nan
    y = small_chunks.allreduce(x, op=op)
    held = np.arange(n) % 4 < SIZE  # (elements whose NaN rank exists)
    assert np.isnan(y[held]).all()
    assert not np.isnan(y[~held]).any()
    assert same_on_every_rank(y)


def test_one_rank_returns_x_itself_bit_for_bit(comm, world):
    # On one rank every reduction of x is x, avg too (x / 1): a strided x (the general
    # path, through the core), a contiguous one (the short path, a copy in Python) and
    # the reference must give the same bits, a signalling NaN's included.
    if SIZE > 1:
        pytest.skip("one rank only")
    x = np.array([0x7F800001, 0xFFC00002, 0x3F800000], np.uint32).view(np.float32)
    strided = np.repeat(x, 2)[::2]
    for call, ref in ((comm.allreduce, reference.allreduce),
                      (comm.reduce_scatter, reference.reduce_scatter)):
        for op in ("avg", "sum", "max"):
            assert bitwise_equal(call(strided, op=op), x), (call, op)
            assert bitwise_equal(call(x, op=op), x), (call, op)
            assert bitwise_equal(ref(x, op, world), x), (ref, op)


def test_float16_rounds_once_per_step_like_the_reference(small_chunks, world):
    # Values whose float16 sums round at every step: a float32 accumulator would differ.
    x = (np.full(64, 1.0 + world.Get_rank() * 2.0 ** -10) * 1000).astype(np.float16)
    y = small_chunks.allreduce(x)
    assert bitwise_equal(y, reference.allreduce(x, "sum", world))


def test_array_likes_are_accepted(comm):
    assert comm.allreduce([1.0, 2.0]).tolist() == [1.0 * SIZE, 2.0 * SIZE]
    y = comm.allreduce(3)
    assert y.shape == () and int(y) == 3 * SIZE


def test_big_endian_input(comm, world):
    x = rank_data(np.dtype(np.float64), 33).astype(">f8")
    np.testing.assert_allclose(comm.allreduce(x), sum(world.allgather(x.astype("<f8"))),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(BFLOAT16 is None, reason="ml_dtypes not installed")
def test_bfloat16_is_supported(small_chunks, world):
    x = rank_data(BFLOAT16, 300)
    y = small_chunks.allreduce(x)
    assert y.dtype == BFLOAT16
    assert bitwise_equal(y, reference.allreduce(x, "sum", world))


def test_copies_between_buffers_that_alias_in_a_page_land_whole():
    # copy_bytes (csrc/copy.h) copies in 2 KiB pieces where the destination lies 1-63
    # bytes past the source modulo 4 KiB (4K aliasing) and the copy is 2 KiB to 512 KiB:
    # every piece, the last partial one too, must land, and nothing past the ends. A
    # Communicator of one rank copies x into out=.
    rng = np.random.default_rng(5)
    source = np.empty(600_000, np.uint8)
    target = np.empty(600_000 + 2 * 4096, np.uint8)
    base_gap = (target.ctypes.data - source.ctypes.data) % 4096
    with rr.Communicator(MPI.COMM_SELF) as one:
        for gap in (1, 17, 63, 64, 0):
            for nbytes in (2048, 2049, 4095, 6145, 100_003, 524_287, 524_288):
                x = source[:nbytes]
                x[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
                shift = 4096 + (gap - base_gap) % 4096  # (room before it, to check)
                target[:] = 0
                out = target[shift:shift + nbytes]
                assert (out.ctypes.data - x.ctypes.data) % 4096 == gap
                assert one.allreduce(x, "max", out=out) is out
                assert np.array_equal(out, x), (gap, nbytes)
                assert not target[:shift].any() and not target[shift + nbytes:].any()


def test_module_level_shortcuts(world):
    x = rank_data(np.dtype(np.float64), 40)
    expected = sum(world.allgather(x))
    np.testing.assert_allclose(rr.allreduce(x), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rr.allreduce(x, comm=MPI.COMM_WORLD), expected, rtol=1e-12,
                               atol=1e-12)
    np.testing.assert_allclose(rr.allreduce_async(x, op="avg").wait(), expected / SIZE,
                               rtol=1e-12, atol=1e-12)
    out = np.empty_like(x)
    assert rr.allreduce(x, out=out) is out


def test_module_level_functions_keep_one_communicator_per_mpi_communicator(world):
    # A new mpi4py object for the same communicator at every call (as petsc4py's
    # tompi4py() gives) used to make a new Communicator every time, each a collective
    # making and a duplicate that was never freed: MPI ran out of them after some 2000.
    from ringreduce._shortcuts import _communicator

    first = _communicator(world, "allreduce")
    x = rank_data(np.dtype(np.float64), 10)
    expected = sum(world.allgather(x))
    for _ in range(10):
        assert _communicator(MPI.Intracomm(world), "allreduce") is first
        assert _communicator(MPI.Comm(world), "allreduce") is first  # (an intracomm too)
        np.testing.assert_allclose(rr.allreduce(x, comm=MPI.Intracomm(world)), expected,
                                   rtol=1e-12, atol=1e-12)
    # A duplicate is another communicator; one made after it is freed (perhaps at its
    # handle) finds nothing of it.
    dup = world.Dup()
    try:
        of_dup = _communicator(dup, "allreduce")
        assert of_dup is not first and of_dup.size == world.Get_size()
    finally:
        dup.Free()
    color = world.Get_rank() % 2
    sub = world.Split(color, key=world.Get_rank())
    try:
        of_sub = _communicator(sub, "allreduce")
        assert of_sub is not of_dup and of_sub.size == sub.Get_size()
        members = world.allgather(color)
        np.testing.assert_allclose(
            rr.allreduce(x, comm=sub),
            sum(a for a, c in zip(world.allgather(x), members) if c == color),
            rtol=1e-12, atol=1e-12)
    finally:
        sub.Free()


def test_the_communicator_kept_for_an_mpi_communicator_the_user_frees_is_let_go(world):
    # (From a review.) Kept for good before: a loop that splits, calls rr.allreduce on
    # the part and frees it kept an MPI communicator (and shared memory) per turn, and
    # MPICH ran out of communicators at turn 2045.
    import gc
    import warnings
    import weakref

    from ringreduce import _shortcuts

    x = rank_data(np.dtype(np.float64), 10)
    color = world.Get_rank() % 2
    members = world.allgather(color)
    expected = sum(a for a, c in zip(world.allgather(x), members) if c == color)
    made_before, kept = len(_shortcuts._made), []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (ours: no ResourceWarning for an unclosed one)
        for _ in range(5):
            sub = world.Split(color, key=world.Get_rank())
            np.testing.assert_allclose(rr.allreduce(x, comm=sub), expected, rtol=1e-12,
                                       atol=1e-12)
            kept.append(weakref.ref(_shortcuts._communicator(sub, "test")))
            sub.Free()
        # The next module-level call lets go of them (not MPI_Comm_free's callback).
        np.testing.assert_allclose(rr.allreduce(x), sum(world.allgather(x)), rtol=1e-12,
                                   atol=1e-12)
        gc.collect()
    assert len(_shortcuts._made) <= made_before + 1  # (COMM_WORLD's, if not made before)
    assert [ref() for ref in kept] == [None] * 5
    world.Barrier()


def test_two_threads_first_module_level_calls_at_once_make_one_communicator(world):
    # Both threads found no Communicator for the communicator and made one each: two
    # collective makings on this rank, against one on a rank whose second thread came
    # once the first had made it (which then waited out the timeout).
    import threading

    from ringreduce import _shortcuts

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("needs MPI_THREAD_MULTIPLE")
    dup = world.Dup()
    made_before = len(_shortcuts._made)
    start, results = threading.Barrier(2), []
    x = rank_data(np.dtype(np.int64), 6)

    def first_call():
        start.wait()
        results.append(rr.allreduce(x, comm=dup))

    try:
        threads = [threading.Thread(target=first_call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 2 and not any(t.is_alive() for t in threads)
        assert len(_shortcuts._made) == made_before + 1
        expected = sum(world.allgather(x))
        assert all(np.array_equal(r, expected) for r in results)
    finally:
        _shortcuts._communicator(dup, "test").close()
        dup.Free()


def test_a_communicator_serves_where_an_mpi4py_one_is_taken(world):
    # api.md: comm.mpi_comm is the mpi4py communicator it was made from; the module-level
    # functions use an rr.Communicator passed as comm= as it is (its chunk size, and
    # once closed it says so); rr.Communicator(ring) makes a new one over ring.mpi_comm.
    backwards = world.Split(0, key=-world.Get_rank())  # (its ranks are not the world's)
    try:
        ring = rr.Communicator(backwards, chunk_bytes=64)
        assert ring.mpi_comm is backwards and not ring.closed
        x = rank_data(np.dtype(np.float64), 100)
        expected = sum(world.allgather(x))
        np.testing.assert_allclose(rr.allreduce(x, comm=ring), expected, rtol=1e-12)
        assert rr.reduce_scatter(x, comm=ring).size == len(
            np.array_split(x, SIZE)[backwards.Get_rank()])
        other = rr.Communicator(ring)
        assert other is not ring and other.mpi_comm is backwards
        assert (other.rank, other.size) == (backwards.Get_rank(), SIZE)
        assert other.chunk_bytes != 64  # (a new one: the default, not ring's)
        ring.close()
        assert ring.closed
        for call in (lambda: rr.allreduce(x, comm=ring), lambda: rr.broadcast(x, comm=ring)):
            with pytest.raises(ValueError, match="has been closed"):
                call()
        with other:
            np.testing.assert_allclose(rr.allreduce(x, comm=other), expected, rtol=1e-12)
        assert other.closed  # (a with block that ends closes it)
    finally:
        backwards.Free()


def test_sub_communicators(world):
    # Two independent rings (even and odd ranks) at the same time.
    color = world.Get_rank() % 2
    sub = world.Split(color, key=world.Get_rank())
    try:
        x = rank_data(np.dtype(np.float64), 99)
        y = rr.allreduce(x, comm=sub)
        members = world.allgather(color)
        expected = sum(a for a, c in zip(world.allgather(x), members) if c == color)
        np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
        with rr.Communicator(sub) as ring:
            assert (ring.rank, ring.size) == (sub.Get_rank(), sub.Get_size())
    finally:
        sub.Free()


def test_ring_traffic_never_mixes_with_the_users(comm, world):
    # A receive the user posted for any source and any tag on the communicator we were
    # given must not catch the ring's messages: they travel on a private duplicate.
    if SIZE == 1:
        pytest.skip("needs a neighbour")
    rank = world.Get_rank()
    incoming = np.zeros(1, np.int64)
    request = world.Irecv(incoming, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    x = rank_data(np.dtype(np.float64), 5000)
    y = comm.allreduce(x)
    np.testing.assert_allclose(y, sum(world.allgather(x)), rtol=1e-12, atol=1e-12)
    world.Send(np.array([1000 + rank], np.int64), dest=(rank + 1) % SIZE, tag=5)
    request.Wait()
    assert incoming[0] == 1000 + (rank - 1) % SIZE


def test_transport_is_shared_memory_on_one_machine(comm):
    expected = "shared memory" if on_one_machine() and SIZE > 1 else "MPI"
    assert comm.transport == expected


def test_the_ring_goes_round_each_machine_in_turn(comm, world):
    # Machine by machine, in the order of their lowest ranks; each one's in rank order.
    machines = pretended_machines() or [None] * SIZE
    expected = tuple(sorted(range(SIZE), key=lambda r: machines.index(machines[r])))
    if os.environ.get("RINGREDUCE_RING") == "ranks":
        expected = tuple(range(SIZE))
    assert comm.ring == expected
    assert reference.ring_order(world) == list(expected)
    if SIZE == 4 and machines == ["a", "b", "a", "b"]:
        assert comm.ring == (0, 2, 1, 3)  # (the sort above, spelled out once)


@pytest.mark.parametrize("long", ["m" * 64, "é" * 32, "é" * 40 + "a"])
def test_the_reference_names_pretended_machines_as_the_core_does(long, world, monkeypatch):
    # The core keeps 64 bytes of a host name (as gethostname gives at most), pretended
    # ones too: names that differ only past that are one machine to both, so the
    # reference goes round the core's ring. Bytes, not characters (from a review: "é"
    # is two), even where the cut falls inside one.
    monkeypatch.setenv("RINGREDUCE_TEST_MACHINE", f"{long}x,{long}y")
    with rr.Communicator() as comm:
        assert comm.ring == tuple(reference.ring_order(world)) == tuple(range(SIZE))
        x = rank_data(np.dtype(np.float32), 1000)
        assert bitwise_equal(comm.allreduce(x), reference.allreduce(x, "sum", world))
    if SIZE > 1:  # (machines apart by their first bytes: the reason names them)
        monkeypatch.setenv("RINGREDUCE_TEST_MACHINE", f"a{long},b{long}")
        with rr.Communicator() as comm:
            assert comm.transport == "MPI" and isinstance(comm.transport_reason, str)
            assert comm.ring == tuple(reference.ring_order(world))


def test_one_rank_asking_for_rank_order_decides_for_all(world, monkeypatch):
    # RINGREDUCE_RING=ranks (bench_placement.py's other ring) on the last rank only:
    # every rank goes round in rank order, and the reference follows.
    if RANK == SIZE - 1:
        monkeypatch.setenv("RINGREDUCE_RING", "ranks")
    with rr.Communicator() as ring:
        assert ring.ring == tuple(range(SIZE))
        assert reference.ring_order(world) == list(range(SIZE))
        x = rank_data(np.dtype(np.float32), 1000 * SIZE + 3)
        assert bitwise_equal(ring.allreduce(x), reference.allreduce(x, "sum", world))
    monkeypatch.setenv("RINGREDUCE_RING", "rank")  # (a typo: refused, on every rank)
    with pytest.raises(ValueError, match="RINGREDUCE_RING must be machines .* got 'rank'"):
        rr.Communicator()


# (From a review.) The reference averages the segment this rank owns after the
# reduce-scatter, which is its rank's, not its place on the ring's: only a ring out of
# rank order tells the two apart.
@pytest.mark.skipif(SIZE < 2, reason="one rank has one ring, in rank order")
@pytest.mark.parametrize("order", ["reversed", "rotated"])
def test_the_reference_averages_on_a_ring_out_of_rank_order(order, world):
    ring = list(range(SIZE))[::-1] if order == "reversed" else list(range(1, SIZE)) + [0]
    x = rank_data(np.dtype(np.float64), 10 * SIZE + 3, salt=21)
    expected = sum(world.allgather(x.copy())) / SIZE
    np.testing.assert_allclose(reference.allreduce(x, "avg", world, ring=ring), expected,
                               rtol=1e-12, atol=1e-12)
    block = np.array_split(expected, SIZE)[RANK]
    np.testing.assert_allclose(reference.reduce_scatter(x, "avg", world, ring=ring), block,
                               rtol=1e-12, atol=1e-12)


# (From a review.) The parameter-server reduction is the ring's contrast in the docs
# and benchmarks: it must give the same result (the mean, for avg), from any root.
@pytest.mark.parametrize("root", sorted({0, SIZE - 1}))
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_the_naive_allreduce_gives_what_the_ring_gives(op, root, world):
    x = rank_data(np.dtype(np.float64), 10 * SIZE + 3, salt=22).reshape(-1, 1)
    naive = reference.naive_allreduce(x, op, world, root=root)
    assert naive.shape == x.shape
    np.testing.assert_allclose(naive, reference.allreduce(x, op, world), rtol=1e-12,
                               atol=1e-12)
    if op == "avg":
        np.testing.assert_allclose(naive, sum(world.allgather(x.copy())) / SIZE, rtol=1e-12,
                                   atol=1e-12)
    assert same_on_every_rank(naive)


def test_every_supported_dtype_is_listed():
    names = {d.name for d in DTYPES}
    assert {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
            "uint16", "uint32", "uint64", "complex64", "complex128"} <= names
    assert all(supported(d, "sum") for d in DTYPES)


def test_bools_reduce_as_any_and_every(comm):
    # max and sum: True where any rank's is; min and prod: where every rank's is. A
    # numpy bool scalar (np.isnan(loss), say) comes back as a 0-d array.
    n = 1000 + 7 * SIZE
    x = np.zeros(n, bool)
    x[RANK::SIZE + 1] = True  # (rank r's Trues: r, r + p + 1, ...; the last index no rank's)
    x[:3] = True  # every rank's
    anyone = np.zeros(n, bool)
    for r in range(SIZE):
        anyone[r::SIZE + 1] = True
    anyone[:3] = True
    everyone = np.zeros(n, bool)
    everyone[:3] = True
    if SIZE == 1:
        everyone = x
    for op, expected in [("max", anyone), ("sum", anyone), ("min", everyone), ("prod", everyone)]:
        np.testing.assert_array_equal(comm.allreduce(x, op=op), expected)
        handle = comm.allreduce_async(x, op=op)
        np.testing.assert_array_equal(handle.wait(), expected)
    # mpi4py's logical and bitwise ops, as an Allreduce of bools would be written
    for op, expected in [(MPI.LOR, anyone), (MPI.BOR, anyone), (MPI.LAND, everyone),
                         (MPI.BAND, everyone)]:
        np.testing.assert_array_equal(comm.allreduce(x, op=op), expected)
        np.testing.assert_array_equal(comm.allreduce_async(x, op=op).wait(), expected)
        np.testing.assert_array_equal(reference.allreduce(x, op, MPI.COMM_WORLD), expected)
        if op in (MPI.LOR, MPI.LAND):  # (MPI takes no bitwise op on MPI_C_BOOL; numpy does)
            mpi = np.empty_like(x)
            MPI.COMM_WORLD.Allreduce(x, mpi, op=op)
            np.testing.assert_array_equal(mpi, expected)
        block = comm.reduce_scatter(x, op=op)
        np.testing.assert_array_equal(block, np.array_split(expected, SIZE)[RANK])
    flag = comm.allreduce(np.bool_(RANK == SIZE - 1), op="max")
    assert flag.dtype == bool and flag.shape == () and bool(flag)
    assert bool(comm.allreduce(np.bool_(RANK == SIZE - 1), op="min")) == (SIZE == 1)


def test_mpi4pys_ops_take_the_fast_path_as_the_op_names_do(comm):
    # An MPI.Op cannot be a dict key (mpi4py makes it unhashable): the table of the
    # dtype/op pairs validated before held none, and every call with op=MPI.SUM took
    # the general path, in Python (25 us against 0.4 us for 2 floats on one rank).
    x = np.arange(7.0) + RANK
    flags = np.arange(7) % (RANK + 2) == 0
    for data, ops in ((x, [(MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MIN, "min"),
                           (MPI.MAX, "max")]),
                      (flags, [(MPI.LOR, "max"), (MPI.BOR, "max"), (MPI.LAND, "min"),
                               (MPI.BAND, "min")])):
        for op, name in ops:
            expected = comm.allreduce(data, op=name)
            np.testing.assert_array_equal(comm.allreduce(data, op=op), expected)
            served = comm._fast.allreduce(data, op, None)  # (a call of the ring too)
            assert served is not None, op
            np.testing.assert_array_equal(served, expected)
            np.testing.assert_array_equal(comm.allreduce_async(data, op=op).wait(), expected)
    # Not for a dtype the op is refused for; and an Op equal to MPI.SUM but another
    # object, which the fast path does not know, still works (by the general path).
    assert comm._fast.allreduce(x, MPI.LOR, None) is None
    with pytest.raises(ValueError, match="MPI.LOR is taken for bool arrays only"):
        comm.allreduce(x, op=MPI.LOR)
    other_sum = MPI.Op.f2py(MPI.SUM.py2f())
    assert other_sum is not MPI.SUM and other_sum == MPI.SUM
    assert comm._fast.allreduce(x, other_sum, None) is None
    np.testing.assert_array_equal(comm.allreduce(x, op=other_sum), comm.allreduce(x))


def test_an_op_the_general_path_refuses_is_not_served_by_the_fast_path(comm):
    # The general path looks an op up in validated_pairs by the string itself, or by
    # its key for one of mpi4py's ops, and by nothing else: an object that only equals
    # a validated op string (a UserString), or a key itself, is refused there, so the
    # FastPath must not serve it either (it looked such objects up as they were).
    import collections
    x = np.arange(3.0) + RANK
    comm.allreduce(x, op="sum")
    comm.allreduce(x, op=MPI.SUM)  # (both validated for float64)
    key = next(key for op, key in rr._types.MPI_OP_KEYS if op is MPI.SUM)
    for op in (collections.UserString("sum"), key):
        assert comm._fast.allreduce(x, op, None) is None, op
        assert comm._fast.allreduce_async(x, op, None) is None, op
        assert comm._fast.reduce_scatter(x, op, None) is None, op
        with pytest.raises(ValueError, match="is not one of"):
            comm.allreduce(x, op=op)
    assert comm._fast.allreduce(x, np.str_("sum"), None) is not None  # (a str: served)


def test_a_scalar_takes_the_fast_path_as_a_0d_array_does(comm):
    # A loss or np.isnan(loss), reduced once a step, took the general path (4.4 us
    # against 0.8 us for a 0-d array on 2 ranks): as np.asarray makes it, it takes the
    # FastPath now, and comes back as the general path returns it, a 0-d array.
    total = np.float32(SIZE * 1.5 + SIZE * (SIZE - 1) / 2)
    for x, op, expected in [(np.float32(1.5 + RANK), "sum", total),
                            (np.bool_(RANK == SIZE - 1), "max", np.bool_(True)),
                            (1.5 + RANK, "max", np.float64(1.5 + SIZE - 1)),
                            (RANK, MPI.SUM, np.int64(SIZE * (SIZE - 1) // 2)),
                            (RANK == 0, MPI.LAND, np.bool_(SIZE == 1))]:
        general = comm.allreduce(x, op=op)  # (validates the dtype and op, once)
        served = comm._fast.allreduce(x, op, None)
        for got in (general, served):
            assert type(got) is np.ndarray and got.shape == () and got.dtype == expected.dtype
            assert got == expected, (x, op, got)
    # Not what np.asarray makes no array the ring takes of, nor an out= the scalar.
    for x in (np.str_("a"), 2 ** 70, np.datetime64(1, "s")):
        assert comm._fast.allreduce(x, "sum", None) is None
    with pytest.raises(TypeError, match="out must be a numpy.ndarray"):
        comm.allreduce(np.float32(1), out=np.float32(1))


def test_a_strided_array_takes_the_fast_path_as_a_copy_of_it(comm):
    # A column or every other element took the general path (6.7 us against 1.8 us for
    # a contiguous 4 KiB on 2 ranks): the FastPath copies it first now, as the general
    # path does, and returns what that returns.
    base = np.arange(4.0 * 6 * 5).reshape(4, 6, 5) + RANK
    total = SIZE * (np.arange(4.0 * 6 * 5).reshape(4, 6, 5)) + SIZE * (SIZE - 1) / 2
    for view, out in [(np.s_[:, 2, :], None), (np.s_[::-1, ::2, 1], None),
                      (np.s_[:, :, 3], np.empty((4, 6))), (np.s_[..., ::-2], None)]:
        x = base[view]
        assert not x.flags.c_contiguous
        # (The general path's own call, which also validates the dtype and op.)
        general = comm._call("allreduce", comm._prepare_allreduce, x, "sum", None, wait=True)
        served = comm._fast.allreduce(x, "sum", out)
        assert served is not None
        for got in (general, served):
            assert type(got) is np.ndarray and got.flags.c_contiguous and got.flags.owndata
            np.testing.assert_array_equal(got, total[view])
        assert out is None or served is out
        np.testing.assert_array_equal(x, base[view])  # x untouched
    # Not a subclass (np.matrix's or a masked array's rules are their own), nor an op
    # the general path refuses.
    assert comm._fast.allreduce(base[:, 2, :].view(np.ma.MaskedArray), "sum", None) is None
    assert comm._fast.allreduce(base[:, 2, :], "mean", None) is None


def test_bools_of_any_byte_match_the_reference_byte_for_byte(comm):
    # A bool array made from other bytes (a uint8 view) holds True as any nonzero byte:
    # the core and the reference both write it as numpy's ufuncs do, 1 (on one rank,
    # where nothing is reduced, both return x's bytes as they are).
    rng = np.random.default_rng([RANK, 5])
    for n in around_inline_limit(comm, 1, (5, 100_001)):
        x = rng.integers(0, 256, n, dtype=np.uint8).view(bool)
        x[rng.random(n) < 0.5] = False
        for op in ("sum", "prod", "min", "max"):
            got = comm.allreduce(x, op=op)
            assert bitwise_equal(got, reference.allreduce(x, op, MPI.COMM_WORLD)), (n, op)
            if SIZE > 1:
                assert set(np.unique(got.view(np.uint8)).tolist()) <= {0, 1}, (n, op)


@pytest.mark.parametrize("n", [8, 100_003])  # (in the header exchange; by the ring)
def test_a_rank_that_flushes_subnormals_gets_the_same_bits_as_the_others(n, comm):
    # Rank 0's thread flushes subnormals to zero (as after loading a library built
    # with -ffast-math): a call done in the header exchange, whose segments every rank
    # reduces itself, gave 0 there and the IEEE sum elsewhere, silently.
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64's MXCSR")
    from ringreduce import _core

    tiny = np.finfo(np.float32).smallest_subnormal
    x = (np.arange(n) % 7 + RANK + 1).astype(np.float32) * tiny
    want = comm.allreduce(x)
    flushing = RANK == 0 and not _core.set_flush_subnormals(True)
    try:
        got, mean = comm.allreduce(x), comm.allreduce(x, op="avg")
    finally:
        if flushing:
            _core.set_flush_subnormals(False)
    assert want.any() and bitwise_equal(got, want)
    assert same_on_every_rank(mean) and mean.any()


def test_a_strided_input_costs_no_copy_beside_the_result(comm, world):
    # A strided x is copied straight into the result (out=, or the new array), which the
    # ring then reduces in place: no second array of x's size (it had cost 2N for a new
    # result, N with out=). Counted by tracemalloc, which sees numpy's allocations (the
    # core's own buffers, a few chunks, are not numpy's). 8 MiB: not a kept result.
    n = 1 << 20
    base = rank_data(np.dtype(np.float64), 2 * n)
    x = base[::2]
    nbytes = x.nbytes
    expected = sum(world.allgather(x.copy()))
    calls = [("out=", lambda: comm.allreduce(x, out=y), 0),
             ("new", lambda: comm.allreduce(x), nbytes),
             ("async out=", lambda: comm.allreduce_async(x, out=y).wait(), 0),
             ("async new", lambda: comm.allreduce_async(x).wait(), nbytes),
             ("general path", lambda: comm._call("allreduce", comm._prepare_allreduce, x,
                                                 "sum", y, wait=True), 0)]
    for what, call, result_bytes in calls:
        y = np.zeros(n)
        before = base.copy()
        got, peak = result_and_peak_allocated(call)
        assert peak < result_bytes + nbytes // 4, (what, peak)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=what)
        assert bitwise_equal(base, before), what
        del got


def test_a_strided_input_overlapping_out_gives_the_right_answer(comm, world):
    n = 4097
    for path in ("fast", "general"):
        buf = rank_data(np.dtype(np.float64), 2 * n)
        x, out = buf[::2], buf[n // 2:n // 2 + n]  # overlapping, x strided
        expected = sum(world.allgather(x.copy()))
        if path == "fast":
            got = comm.allreduce(x, out=out)
        else:
            got = comm._call("allreduce", comm._prepare_allreduce, x, "sum", out, wait=True)
        assert got is out
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12, err_msg=path)
