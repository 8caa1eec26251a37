"""A short pass over every collective for many ranks (16 and 32, from test_on_ranks.py):
what 1-8 ranks cannot show. Rank counts past a power of two, segments of one element or
none, a root far from rank 0, tags and shared-memory slots for 32 peers, and a ring of
31 steps per phase, checked against numpy (and the numpy reference ring) on every rank."""
import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import reference
from ringreduce.optim import SGD, DistributedOptimizer

from helpers import bitwise_equal, rank_data, same_on_every_rank

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
# Fewer elements than ranks (empty segments), one per rank, uneven, and enough for
# several 64-byte chunks per segment.
COUNTS = sorted({1, SIZE - 1, SIZE, SIZE + 1, 3 * SIZE + 2, 40 * SIZE + 7})


def everyones(dtype, n, salt=0):
    """Every rank's input (rank_data's, seeded by the rank), on every rank."""
    return MPI.COMM_WORLD.allgather(rank_data(np.dtype(dtype), n, salt=salt))


@pytest.mark.parametrize("n", COUNTS)
def test_allreduce_sums_integers_exactly_and_floats_as_the_reference(n, small_chunks, world):
    xs = everyones(np.int64, n)
    with np.errstate(over="ignore"):
        want = np.sum(xs, axis=0)  # (wraps as the ring does)
    assert bitwise_equal(small_chunks.allreduce(xs[RANK]), want)
    assert bitwise_equal(small_chunks.allreduce(xs[RANK], op="max"), np.max(xs, axis=0))
    x = rank_data(np.dtype(np.float32), n, salt=1)
    got = small_chunks.allreduce(x)
    assert same_on_every_rank(got)
    # (The same ring, so the same order of additions: the same bits.)
    assert bitwise_equal(got, reference.allreduce(x, "sum", world))


@pytest.mark.parametrize("n", COUNTS)
def test_reduce_scatter_gives_each_rank_its_block(n, small_chunks):
    xs = everyones(np.int32, n, salt=2)
    with np.errstate(over="ignore"):
        want = np.array_split(np.sum(xs, axis=0, dtype=np.int32), SIZE)[RANK]
    assert bitwise_equal(small_chunks.reduce_scatter(xs[RANK]), want)


def test_allgather_of_uneven_rows_including_none(small_chunks):
    rows = [r % 3 for r in range(SIZE)]  # (a third of the ranks give no rows)
    parts = [np.full((k, 5), r, np.int16) for r, k in enumerate(rows)]
    got = small_chunks.allgather(parts[RANK])
    assert bitwise_equal(got, np.concatenate(parts))


@pytest.mark.parametrize("root", sorted({0, SIZE // 2, SIZE - 1}))
def test_broadcast_from_any_root(root, small_chunks):
    xs = everyones(np.float64, 3 * SIZE + 2, salt=3)
    x = xs[RANK].copy()
    assert small_chunks.broadcast(x, root=root) is x
    assert bitwise_equal(x, xs[root])


def test_calls_in_flight_of_every_kind_waited_for_in_reverse(comm):
    xs = everyones(np.float64, 2 * SIZE + 1, salt=4)
    exact = everyones(np.int64, 5000, salt=5)
    handles = [
        ("sum", comm.allreduce_async(exact[RANK].copy())),
        ("scatter", comm.reduce_scatter_async(exact[RANK].copy())),
        ("gather", comm.allgather_async(xs[RANK].copy())),
        ("bcast", comm.broadcast_async(xs[RANK].copy(), root=SIZE - 1)),
        ("max", comm.allreduce_async(xs[RANK].copy(), op="max")),
    ]
    with np.errstate(over="ignore"):
        total = np.sum(exact, axis=0)
    want = {"sum": total, "scatter": np.array_split(total, SIZE)[RANK],
            "gather": np.concatenate(xs), "bcast": xs[SIZE - 1], "max": np.max(xs, axis=0)}
    for name, handle in reversed(handles):
        assert bitwise_equal(handle.wait(), want[name]), name


def test_data_parallel_sgd_keeps_replicas_identical_and_matches_one_process(comm):
    start = [rank_data(np.dtype(np.float64), 37, salt=6 + RANK), np.zeros((4, 3))]
    params = [p.copy() for p in start]
    opt = DistributedOptimizer(SGD(params, lr=0.1), comm, bucket_mb=0.0002)  # two buckets
    opt.broadcast_parameters()  # (rank 0's start)
    alone = [MPI.COMM_WORLD.bcast(start[0], root=0), np.zeros((4, 3))]
    for step in range(3):
        grads = [np.full(37, float(RANK + step)), np.full((4, 3), float(RANK * step))]
        opt.step(grads)
        mean = [np.full(37, (SIZE - 1) / 2 + step), np.full((4, 3), (SIZE - 1) / 2 * step)]
        alone = [a - 0.1 * g for a, g in zip(alone, mean)]
    for p, a in zip(params, alone):
        assert same_on_every_rank(p)
        np.testing.assert_allclose(p, a, rtol=1e-12, atol=1e-12)
