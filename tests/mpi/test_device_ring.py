"""The device ring's bookkeeping under real MPI, on any machine: the core's GPU engine
(staging through a pinned host mirror, or device pointers handed to MPI) run over its
host emulation, where "device" buffers are host memory and copies and kernels happen
at once. This checks which chunk goes where, through which buffer, in which order, and
that the result is the host ring's bit for bit; it says nothing about CUDA itself,
which tests/mpi/test_gpu.py checks where a GPU is."""
import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import _core, reference

from helpers import COMBOS, bitwise_equal, combo_id, rank_data, tied_values

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
SIZES = sorted({0, 1, SIZE, 2 * SIZE + 1, 40, 517, 5003})
CHUNKS = [64, 4096, 1 << 18]
MODES = {"staged": False, "direct": True}
OP_CODES = {name: i for i, name in enumerate(rr.OPS)}
FLOAT32 = np.dtype(np.float32)


def dtype_code(dtype):
    return _core.DTYPES.index(dtype.name)


def emulated(direct):
    # device ordinal, ready event, stream, direct, emulate
    return 0, 0, 0, direct, True


@pytest.fixture(scope="module")
def device_comm():
    """Runs the device ring for every call with data: GPU calls up to
    device_host_reduce_bytes otherwise go through the host, and the tests at the end of
    this file check those."""
    comm = rr.Communicator()
    comm._core.device_host_reduce_bytes = 0
    yield comm
    comm.close()


def device_allreduce(comm, x, op, chunk, direct, out=None):
    out = np.empty_like(x) if out is None else out
    comm._core.allreduce_device(x.ctypes.data, out.ctypes.data, x.size, dtype_code(x.dtype),
                                OP_CODES[op], chunk, *emulated(direct))
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_allreduce_matches_the_host_ring_bit_for_bit(combo, mode, device_comm):
    dtype, op = combo
    for n in SIZES:
        for chunk in CHUNKS:
            x = rank_data(dtype, n, op, salt=7)
            got = device_allreduce(device_comm, x, op, chunk, MODES[mode])
            device_comm.chunk_bytes = chunk
            assert bitwise_equal(got, device_comm.allreduce(x, op=op)), f"n={n} chunk={chunk}"
    assert device_comm._core.device_name == "host emulation"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "complex128"])
def test_slots_stay_16_byte_aligned_for_chunks_of_any_size(dtype, mode, device_comm):
    # Chunks of a size that is no multiple of 16 bytes, several to a segment: each slot
    # starts at a multiple of 16, else a GPU's kernels lose their vector loads (the
    # emulated GPU refuses such an address in the ring's own memory).
    dtype = np.dtype(dtype)
    x = rank_data(dtype, 5003, "sum", salt=3)
    for chunk in (37 * dtype.itemsize, 100 * dtype.itemsize):
        got = device_allreduce(device_comm, x, "sum", chunk, MODES[mode])
        device_comm.chunk_bytes = chunk
        assert bitwise_equal(got, device_comm.allreduce(x)), f"chunk={chunk}"


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_matches_the_numpy_reference_and_works_in_place(mode, device_comm):
    for n in SIZES:
        x = rank_data(FLOAT32, n, salt=3)
        expected = reference.allreduce(x, "sum")
        got = device_allreduce(device_comm, x.copy(), "sum", 256, MODES[mode])
        assert bitwise_equal(got, expected), f"n={n}"
        inplace = x.copy()
        device_allreduce(device_comm, inplace, "sum", 256, MODES[mode], out=inplace)
        assert bitwise_equal(inplace, expected), f"in place, n={n}"


def test_ranks_staging_and_ranks_with_cuda_aware_mpi_share_a_ring(device_comm, world):
    # The two ways put the same chunks with the same tags on the wire.
    direct = RANK % 2 == 1
    x = rank_data(FLOAT32, 5003, salt=11)
    got = device_allreduce(device_comm, x, "sum", 512, direct=direct)
    assert bitwise_equal(got, reference.allreduce(x, "sum"))
    code, core = dtype_code(FLOAT32), device_comm._core
    for root in range(SIZE):
        y = rank_data(FLOAT32, 5003, salt=root)
        expected = world.bcast(y, root=root)
        core.broadcast_device(y.ctypes.data, y.size, code, root, 16, *emulated(direct))
        assert bitwise_equal(y, expected)
    counts = core.allgather_counts(1, 5003, hash((5003,)) & 0x7FFFFFFFFFFFFFFF, code, 16,
                                   device=True)
    out = np.empty(5003 * SIZE, np.float32)
    core.allgather_device(x.ctypes.data, out.ctypes.data, counts, 5003, code, True,
                          *emulated(direct))
    assert bitwise_equal(out, np.concatenate(world.allgather(x)))


@pytest.mark.parametrize("mode", MODES)
def test_reduce_scatter_matches_the_host_ring(mode, device_comm):
    for n in SIZES:
        x = rank_data(FLOAT32, n, "avg", salt=5)
        work = np.empty_like(x)
        device_comm._core.reduce_scatter_device(x.ctypes.data, work.ctypes.data, n,
                                                dtype_code(FLOAT32), OP_CODES["avg"], 128,
                                                *emulated(MODES[mode]))
        offset, count = _core.segment_of(RANK, SIZE, n)
        assert bitwise_equal(work[offset:offset + count], reference.reduce_scatter(x, "avg")), n


@pytest.mark.parametrize("mode", MODES)
def test_allgather_with_different_row_counts(mode, device_comm, world):
    rows = [(r * 3 + 1) % 5 for r in range(SIZE)]  # includes ranks with no rows at 4 ranks
    x = (np.arange(rows[RANK] * 6, dtype=np.int32).reshape(rows[RANK], 3, 2) + 1000 * RANK)
    core = device_comm._core
    counts = core.allgather_counts(x.shape[0], 6, hash((3, 2)) & 0x7FFFFFFFFFFFFFFF,
                                   dtype_code(x.dtype), 32, device=True)
    assert list(counts) == rows
    out = np.empty((sum(counts), 3, 2), np.int32)
    core.allgather_device(x.ctypes.data, out.ctypes.data, counts, 6, dtype_code(x.dtype),
                          True, *emulated(MODES[mode]))
    np.testing.assert_array_equal(out, np.concatenate(world.allgather(x)))


def test_a_rank_not_ready_for_allgathers_ring_stops_every_rank(device_comm, world):
    # Past the header exchange, a rank whose result or staging could not be had says
    # so, and every rank raises MemoryError naming it, instead of entering the ring.
    if SIZE == 1:
        pytest.skip("needs two ranks")
    x = np.full(10, RANK, np.int64)
    core = device_comm._core
    counts = core.allgather_counts(1, 10, hash((10,)) & 0x7FFFFFFFFFFFFFFF,
                                   dtype_code(x.dtype), 32, device=True)
    out = np.empty(10 * SIZE, np.int64)
    with pytest.raises(MemoryError, match="rank 1 could not allocate"):
        core.allgather_device(x.ctypes.data, out.ctypes.data, counts, 10, dtype_code(x.dtype),
                              RANK != 1, *emulated(False))
    # The failed call's GPU work (the copy of this rank's rows into out, enqueued before
    # the ranks confirmed) is finished when it raises: nothing writes into out later,
    # when Python may have given its memory to another array.
    out.fill(-1)
    assert bitwise_equal(device_allreduce(device_comm, x.astype(np.float32), "sum", 64, False),
                         reference.allreduce(x.astype(np.float32), "sum"))
    assert (out == -1).all()


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_from_every_root(mode, device_comm):
    for root in range(SIZE):
        for n in (0, 1, 1000):
            x = rank_data(np.dtype(np.float64), n, salt=root)
            expected = MPI.COMM_WORLD.bcast(x, root=root)
            device_comm._core.broadcast_device(x.ctypes.data, n, dtype_code(x.dtype), root, 800,
                                               *emulated(MODES[mode]))
            assert bitwise_equal(x, expected), f"root={root} n={n}"


def test_the_staged_ring_sends_what_the_host_ring_sends(device_comm):
    # 2(p-1)/p of the buffer per rank, as the host ring over MPI messages.
    n = 4096 * SIZE
    x = rank_data(FLOAT32, n)
    before = device_comm._core.ring_bytes_sent
    device_allreduce(device_comm, x, "sum", 1024, direct=False)
    sent = device_comm._core.ring_bytes_sent - before
    assert sent == 2 * (SIZE - 1) * (n // SIZE) * 4


def test_host_and_device_buffers_in_one_call_are_a_mismatch(device_comm):
    if SIZE == 1:
        pytest.skip("needs two ranks")
    x = rank_data(FLOAT32, 1000)
    with pytest.raises(rr.MismatchError, match=r"memory: .*GPU \(cupy\).*host \(numpy\)"
                       r"|memory: .*host \(numpy\).*GPU \(cupy\)"):
        if RANK == 0:
            device_comm._core.allreduce(x, np.empty_like(x), dtype_code(FLOAT32), 0, 4096)
        else:
            device_allreduce(device_comm, x, "sum", 4096, direct=False)
    # still usable afterwards
    assert bitwise_equal(device_allreduce(device_comm, x, "sum", 4096, False),
                         reference.allreduce(x, "sum"))


# Growing sizes: the staging buffer is kept, so each case must need a bigger one.
@pytest.mark.parametrize("collective,count", [("allreduce", 1 << 16),
                                              ("reduce_scatter", 1 << 18),
                                              ("broadcast", 1 << 20)])
def test_a_rank_without_memory_for_staging_raises_everywhere_instead_of_hanging(
        collective, count, device_comm):
    if SIZE == 1:
        pytest.skip("needs two ranks")
    x = rank_data(FLOAT32, count)
    code, core = dtype_code(FLOAT32), device_comm._core
    calls = {
        "allreduce": lambda: core.allreduce_device(x.ctypes.data, x.ctypes.data, x.size, code,
                                                   0, 4096, *emulated(False)),
        "reduce_scatter": lambda: core.reduce_scatter_device(
            x.ctypes.data, np.empty_like(x).ctypes.data, x.size, code, 0, 4096,
            *emulated(False)),
        "broadcast": lambda: core.broadcast_device(x.ctypes.data, x.size, code, 0, 4096,
                                                   *emulated(False)),
    }
    if RANK == 1:
        _core.set_emulated_gpu_memory(x.nbytes // 2)
        try:
            with pytest.raises(MemoryError, match="emulated GPU"):
                calls[collective]()
        finally:
            _core.set_emulated_gpu_memory(2**63 - 1)
    else:
        with pytest.raises(rr.MismatchError, match="rank 1 failed to prepare"):
            calls[collective]()
    got = device_allreduce(device_comm, x, "sum", 4096, direct=False)
    assert bitwise_equal(got, reference.allreduce(x, "sum"))


def test_ranks_with_different_chunk_sizes_grow_gpu_scratch_together(device_comm):
    # GPU scratch is reserved before the header exchange with this rank's chunk size;
    # the ring uses rank 0's. A rank that then cannot grow its scratch must not leave
    # the others waiting in the ring.
    if SIZE == 1:
        pytest.skip("needs two ranks")
    x = rank_data(FLOAT32, 1 << 16)
    out = np.empty_like(x)
    chunk = 1 << 20 if RANK == 0 else 256
    code, core = dtype_code(FLOAT32), device_comm._core
    if RANK == 1:
        _core.set_emulated_gpu_memory(64 << 10)
    try:
        with pytest.raises(MemoryError, match="rank 1 could not allocate .* GPU scratch"):
            core.allreduce_device(x.ctypes.data, out.ctypes.data, x.size, code, 0, chunk,
                                  *emulated(True))
    finally:
        _core.set_emulated_gpu_memory(2**63 - 1)
    core.allreduce_device(x.ctypes.data, out.ctypes.data, x.size, code, 0, chunk,
                          *emulated(True))
    assert bitwise_equal(out, reference.allreduce(x, "sum"))


@pytest.mark.parametrize("mode", MODES)
def test_calls_up_to_the_limit_are_reduced_on_the_host(mode, device_comm):
    # At the shipped limit, sizes on either side of it: at or below, one copy to the
    # host and the host ring; above, the device ring. The bits are the device ring's
    # (device_comm runs it at every size) either way, in place too.
    with rr.Communicator() as comm:
        core = comm._core
        limit = core.device_host_reduce_bytes
        assert limit == core.DEVICE_HOST_REDUCE_BYTES >= core.inline_capacity
        for n, on_host in ((limit // 4 - 1, True), (limit // 4, True), (limit // 4 + 1, False)):
            for op in ("sum", "avg"):
                x = rank_data(FLOAT32, n, op, salt=n)
                before = core.device_calls_on_host
                got = device_allreduce(comm, x, op, comm.chunk_bytes, MODES[mode])
                assert core.device_calls_on_host - before == int(on_host and SIZE > 1)
                ring = device_allreduce(device_comm, x, op, comm.chunk_bytes, MODES[mode])
                assert bitwise_equal(got, ring), f"n={n} {op}"
                inplace = x.copy()
                device_allreduce(comm, inplace, op, comm.chunk_bytes, MODES[mode], out=inplace)
                assert bitwise_equal(inplace, ring), f"in place, n={n} {op}"


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(np.float64),
                                   np.dtype(np.int64)], ids=str)
@pytest.mark.parametrize("op", ["sum", "max"])
def test_the_host_path_gives_the_device_rings_bits(dtype, op, device_comm):
    with rr.Communicator() as comm:
        for n in (1, 4095, 4097, 1 << 16):
            x = rank_data(dtype, n, op, salt=3)
            assert bitwise_equal(device_allreduce(comm, x, op, 4096, False),
                                 device_allreduce(device_comm, x, op, 4096, False)), n


def test_a_rank_without_staging_for_the_host_path_raises_everywhere():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    with rr.Communicator() as comm:
        x = rank_data(FLOAT32, 1 << 17)  # 512 KiB: the host path, 1 MiB of staging
        if RANK == 1:
            _core.set_emulated_gpu_memory(x.nbytes + x.nbytes // 2)
            try:
                with pytest.raises(MemoryError, match="emulated GPU"):
                    device_allreduce(comm, x, "sum", 4096, False)
            finally:
                _core.set_emulated_gpu_memory(2**63 - 1)
        else:
            with pytest.raises(rr.MismatchError, match="rank 1 failed to prepare"):
                device_allreduce(comm, x, "sum", 4096, False)
        assert bitwise_equal(device_allreduce(comm, x, "sum", 4096, False),
                             reference.allreduce(x, "sum"))


def test_ranks_that_disagree_on_where_to_reduce_raise_instead_of_hanging():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    with rr.Communicator() as comm:
        x = rank_data(FLOAT32, 10_000)  # 40 KB: past the header exchange, under the limit
        if RANK == 1:
            comm._core.device_host_reduce_bytes = 0
        with pytest.raises(rr.MismatchError, match="device_host_reduce_bytes"):
            device_allreduce(comm, x, "sum", 4096, direct=False)
        comm._core.device_host_reduce_bytes = comm._core.DEVICE_HOST_REDUCE_BYTES
        assert bitwise_equal(device_allreduce(comm, x, "sum", 4096, direct=False),
                             reference.allreduce(x, "sum"))
        with pytest.raises(ValueError, match=">= 0"):
            comm._core.device_host_reduce_bytes = -1


def device_reduce_scatter(comm, x, op, chunk, direct):
    """This rank's segment of a reduce_scatter through the device call."""
    work = np.empty_like(x)
    comm._core.reduce_scatter_device(x.ctypes.data, work.ctypes.data, x.size,
                                     dtype_code(x.dtype), OP_CODES[op], chunk,
                                     *emulated(direct))
    offset, count = _core.segment_of(RANK, SIZE, x.size)
    return work[offset:offset + count].copy()


@pytest.mark.parametrize("mode", MODES)
def test_min_and_max_keep_the_first_of_tied_values_as_the_reference(mode, device_comm):
    # Of +0 and -0, or of two NaNs, min and max keep the first operand: a rank's own
    # data, then what came around (gpu.md: the host ring's bits). Random data never
    # ties, so the tests above would pass a device ring that reduced the other way round.
    for n in (SIZE, 5003):
        x = tied_values(np.float32, n, [RANK, n, 5])
        for op in ("min", "max"):
            want, want_block = reference.allreduce(x, op), reference.reduce_scatter(x, op)
            for chunk in (64, 4096):
                got = device_allreduce(device_comm, x, op, chunk, MODES[mode])
                assert bitwise_equal(got, want), (n, op, chunk)
                got = device_reduce_scatter(device_comm, x, op, chunk, MODES[mode])
                assert bitwise_equal(got, want_block), (n, op, chunk)


@pytest.mark.parametrize("mode", MODES)
def test_reduce_scatter_and_broadcast_through_the_host_up_to_the_limit(mode, device_comm):
    # As allreduce: at or below the limit one trip through the host, above it the
    # device ring; the same bits either way (device_comm runs the device ring).
    with rr.Communicator() as comm:
        core, limit = comm._core, comm._core.device_host_reduce_bytes
        for n, on_host in ((1, True), (4097, True), (limit // 4, True), (limit // 4 + 1, False)):
            x = rank_data(FLOAT32, n, "avg", salt=n)
            before = core.device_calls_on_host
            got = device_reduce_scatter(comm, x, "avg", 4096, MODES[mode])
            assert core.device_calls_on_host - before == int(on_host and SIZE > 1)
            assert bitwise_equal(got, device_reduce_scatter(device_comm, x, "avg", 4096,
                                                            MODES[mode])), n
            assert bitwise_equal(got, reference.reduce_scatter(x, "avg")), n
            for root in range(SIZE):
                y = rank_data(FLOAT32, n, salt=root)
                expected = MPI.COMM_WORLD.bcast(y, root=root)
                before = core.device_calls_on_host
                core.broadcast_device(y.ctypes.data, n, dtype_code(FLOAT32), root, 4096,
                                      *emulated(MODES[mode]))
                assert core.device_calls_on_host - before == int(on_host and SIZE > 1)
                assert bitwise_equal(y, expected), f"n={n} root={root}"


def test_every_collective_raises_when_ranks_disagree_on_the_path():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    with rr.Communicator() as comm:
        core = comm._core
        x = rank_data(FLOAT32, 10_000)
        if RANK == 1:
            core.device_host_reduce_bytes = 0
        with pytest.raises(rr.MismatchError, match="device_host_reduce_bytes"):
            device_reduce_scatter(comm, x, "sum", 4096, False)
        with pytest.raises(rr.MismatchError, match="device_host_reduce_bytes"):
            core.broadcast_device(x.ctypes.data, x.size, dtype_code(FLOAT32), 0, 4096,
                                  *emulated(False))
        core.device_host_reduce_bytes = core.DEVICE_HOST_REDUCE_BYTES
        assert bitwise_equal(device_reduce_scatter(comm, x, "sum", 4096, False),
                             reference.reduce_scatter(x, "sum"))


def device_allgather(comm, x, direct):
    """allgather of x's rows through the device calls, as _device.py makes them."""
    core = comm._core
    row_shape = x.shape[1:]
    row_elems = int(np.prod(row_shape, dtype=np.int64))
    counts = core.allgather_counts(x.shape[0], row_elems, hash(row_shape) & 0x7FFFFFFFFFFFFFFF,
                                   dtype_code(x.dtype), 4096, device=True)
    out = np.empty((sum(counts),) + row_shape, x.dtype)
    core.allgather_device(x.ctypes.data, out.ctypes.data, counts, row_elems,
                          dtype_code(x.dtype), True, *emulated(direct))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_allgather_through_the_host_up_to_the_limit_in_all(mode, world):
    # allgather's limit is on the whole result, which every rank knows after the counts.
    with rr.Communicator() as comm:
        core, limit = comm._core, comm._core.device_host_reduce_bytes
        per_rank = limit // 4 // SIZE  # float32 elements, so that SIZE rows of it fit
        for rows in (1, per_rank, per_rank + 1):
            x = rank_data(FLOAT32, rows, salt=rows).reshape(rows, 1)
            before = core.device_calls_on_host
            got = device_allgather(comm, x, MODES[mode])
            on_host = rows * SIZE * 4 <= limit
            assert core.device_calls_on_host - before == int(on_host and SIZE > 1), rows
            assert bitwise_equal(got, np.concatenate(world.allgather(x))), rows


def test_allgather_raises_when_ranks_disagree_on_the_limit():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    with rr.Communicator() as comm:
        x = np.ones((3, 2), np.float32)
        if RANK == 1:
            comm._core.device_host_reduce_bytes = 0
        with pytest.raises(rr.MismatchError, match="device_host_reduce_bytes"):
            device_allgather(comm, x, False)
        comm._core.device_host_reduce_bytes = comm._core.DEVICE_HOST_REDUCE_BYTES
        assert device_allgather(comm, x, False).shape == (3 * SIZE, 2)


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "broadcast",
                                        "allgather"])
def test_a_failed_copy_to_the_host_raises_everywhere_instead_of_hanging(collective):
    # As after a faulted kernel on a GPU: rank 1's copy of its input to the host fails,
    # before (or, for allgather, just after) the header exchange. Every rank raises.
    if SIZE == 1:
        pytest.skip("needs two ranks")
    with rr.Communicator() as comm:
        core = comm._core
        x = rank_data(FLOAT32, 1000)
        calls = {
            "allreduce": lambda: device_allreduce(comm, x, "sum", 4096, False),
            "reduce_scatter": lambda: device_reduce_scatter(comm, x, "sum", 4096, False),
            "broadcast": lambda: core.broadcast_device(x.ctypes.data, x.size, dtype_code(FLOAT32),
                                                       1, 4096, *emulated(False)),
            "allgather": lambda: device_allgather(comm, x.reshape(100, 10), False),
        }
        others_raise = (MemoryError, "rank 1 could not") if collective == "allgather" else (
            rr.MismatchError, "rank 1 failed to prepare")
        if RANK == 1:
            _core.set_emulated_copy_fault(1)
            try:
                with pytest.raises(MemoryError if collective == "allgather" else RuntimeError,
                                   match="rank 1 could not|failed a copy"):
                    calls[collective]()
            finally:
                _core.set_emulated_copy_fault(0)
        else:
            with pytest.raises(others_raise[0], match=others_raise[1]):
                calls[collective]()
        assert bitwise_equal(device_allreduce(comm, x, "sum", 4096, False),
                             reference.allreduce(x, "sum"))


@pytest.mark.parametrize("through", ["device ring", "host"])
def test_a_check_that_differs_raises_on_every_rank_before_data_moves(through, device_comm):
    # allreduce_gradients' first call on GPU buffers carries its check on either path.
    if SIZE == 1:
        pytest.skip("needs two ranks")
    x = rank_data(FLOAT32, 1000)
    out = np.zeros_like(x)
    code, core = dtype_code(FLOAT32), device_comm._core
    core.device_host_reduce_bytes = 0 if through == "device ring" else 1 << 20

    def call(check):
        core.allreduce_device(x.ctypes.data, out.ctypes.data, x.size, code, 0, 4096,
                              *emulated(False), check)
    try:
        with pytest.raises(_core.CheckedCallsMismatch,
                           match=r"the caller's check of it\): check 5 on ") as caught:
            call(5 + (RANK == SIZE - 1))
        assert caught.value.checks == [5] * (SIZE - 1) + [6]  # every rank's, by rank
        # (A rank without a check made some other call: a plain MismatchError, which the
        # checked callers do not answer with a further exchange.)
        with pytest.raises(rr.MismatchError, match=r"a plain call \(.*\) on") as caught:
            call(0 if RANK == SIZE - 1 else 5)
        assert type(caught.value) is rr.MismatchError
        # (Every rank's check, there too: DistributedOptimizer's agreements read from it
        # whether they met a step.)
        assert caught.value.checks == [5] * (SIZE - 1) + [0]
        assert not out.any()  # nothing moved
        call(5)
        assert bitwise_equal(out, reference.allreduce(x, "sum"))
    finally:
        core.device_host_reduce_bytes = 0
