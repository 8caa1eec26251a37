"""2-D parallelism: the ranks laid out as a grid (MPI.Compute_dims: 2x2 on 4 ranks, 3x1
on 3), one Communicator per row (made with Create_cart and Sub) and one per column (made
with Split, in the reverse of the world's order), alive at once with one over COMM_SELF
and one over a Split singleton, so that every rank is in several rings that share
ranks. Each group's results are held to ringreduce.reference bit for bit, calls on the
groups interleave (asynchronous ones waited in another order than made), a
DistributedOptimizer steps on the rows while the columns reduce activations, and an
error on one group leaves the other alone."""
import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import reference
from ringreduce.optim import SGD, DistributedOptimizer

from helpers import around_inline_limit, bitwise_equal, rank_data

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
ROWS, COLUMNS = MPI.Compute_dims(SIZE, 2)  # (1x1, 2x1, 3x1, 2x2)


class Grid:
    """This rank's groups: mpi4py communicators and the Communicators over them."""

    def __init__(self):
        self.cart = WORLD.Create_cart([ROWS, COLUMNS], periods=[False, False], reorder=False)
        self.row_index, self.column_index = self.cart.Get_coords(self.cart.Get_rank())
        self.row_mpi = self.cart.Sub([False, True])  # this row: COLUMNS ranks
        # This column (ROWS ranks), numbered bottom up: rank 0 is the world's highest.
        self.column_mpi = WORLD.Split(self.column_index, key=-self.row_index)
        self.singleton_mpi = WORLD.Split(RANK, key=0)
        self.row = rr.Communicator(self.row_mpi, chunk_bytes=64)  # (many chunks)
        self.column = rr.Communicator(self.column_mpi)
        self.alone = rr.Communicator(self.singleton_mpi)
        self.self = rr.Communicator(MPI.COMM_SELF)

    def groups(self):
        return [(self.row, self.row_mpi), (self.column, self.column_mpi),
                (self.alone, self.singleton_mpi), (self.self, MPI.COMM_SELF)]

    def close(self):
        for ring, _ in self.groups():  # (the same order on every rank)
            ring.close()
        for mpi_comm in (self.row_mpi, self.column_mpi, self.singleton_mpi, self.cart):
            mpi_comm.Free()


@pytest.fixture(scope="module")
def grid():
    made = Grid()
    yield made
    made.close()


def test_the_groups_are_the_grids_rows_and_columns(grid):
    assert (grid.row.size, grid.column.size, grid.alone.size, grid.self.size) == (
        COLUMNS, ROWS, 1, 1)
    assert grid.row.rank == grid.column_index
    assert grid.column.rank == ROWS - 1 - grid.row_index  # (reversed)
    assert WORLD.allgather(grid.row_mpi.allgather(RANK)) == [
        [r // COLUMNS * COLUMNS + c for c in range(COLUMNS)] for r in range(SIZE)]
    assert WORLD.allgather(grid.column_mpi.allgather(RANK)) == [
        [row * COLUMNS + r % COLUMNS for row in reversed(range(ROWS))] for r in range(SIZE)]


@pytest.mark.parametrize("dtype, ops", [(np.dtype(np.float64), ("sum", "avg", "max")),
                                        (np.dtype(np.float32), ("sum", "prod")),
                                        (np.dtype(np.int32), ("sum", "min"))],
                         ids=["float64", "float32", "int32"])
def test_every_collective_on_every_group_matches_the_reference(grid, dtype, ops):
    for ring, mpi_comm in grid.groups():
        for n in around_inline_limit(ring, dtype.itemsize, (0, 1, 7, 100_003)):
            for op in ops:
                x = rank_data(dtype, n, op=op, salt=ring.size)
                assert bitwise_equal(ring.allreduce(x, op),
                                     reference.allreduce(x, op, mpi_comm, ring=ring.ring))
                assert bitwise_equal(ring.reduce_scatter(x, op),
                                     reference.reduce_scatter(x, op, mpi_comm, ring=ring.ring))
            x = rank_data(dtype, n, salt=3)
            assert bitwise_equal(ring.allgather(x), reference.allgather(x, mpi_comm))
            root = ring.size - 1
            assert bitwise_equal(ring.broadcast(x.copy(), root), mpi_comm.bcast(x, root))


def test_calls_interleaved_across_groups_waited_in_another_order(grid):
    # Each group's calls are made in one order on all its ranks, but a rank waits in
    # an order of its own, with blocking calls on the other groups in between.
    dtype = np.dtype(np.float64)
    for turn in range(6):
        started = []
        for k in range(9):
            ring, mpi_comm = grid.groups()[k % 4]
            n = int(np.random.default_rng([turn, k]).integers(1, 150_000))
            x = rank_data(dtype, n, salt=100 * turn + k)
            if k % 3 == 0:
                started.append((ring.allreduce_async(x, "sum"),
                                reference.allreduce(x, "sum", mpi_comm, ring=ring.ring)))
            elif k % 3 == 1:
                started.append((ring.reduce_scatter_async(x, "max"),
                                reference.reduce_scatter(x, "max", mpi_comm, ring=ring.ring)))
            else:
                started.append((ring.allgather_async(x), reference.allgather(x, mpi_comm)))
            if k == 4:  # (blocking, queued behind this group's calls in flight)
                y = rank_data(dtype, 1000 + turn, salt=turn)
                assert bitwise_equal(grid.column.allreduce(y, "avg"), reference.allreduce(
                    y, "avg", grid.column_mpi, ring=grid.column.ring))
        for i in np.random.default_rng([RANK, turn]).permutation(len(started)):
            handle, expected = started[i]
            assert bitwise_equal(handle.wait(), expected), (turn, i)


def test_data_parallel_rows_with_tensor_parallel_columns_train_as_one_process(grid):
    # A 2-layer network whose hidden units are split over each column's ranks (the
    # column reduces the output's partial sums) and whose batch is split over each
    # row's ranks (a DistributedOptimizer on the row averages the gradients). Between
    # the first bucket's all-reduce and step(), the column reduces the loss: the row's
    # call is in flight meanwhile. Every row holds its shard bitwise alike, every rank
    # the same losses, and the shards follow one process's training of the whole.
    shard = grid.row_index  # (not column.rank, which runs the other way)
    inputs, hidden, batch = 6, 4 * ROWS, 6 * COLUMNS
    data = np.random.default_rng(0)
    X = data.standard_normal((10 * batch, inputs))
    Y = np.tanh(X @ data.standard_normal((inputs, 1)))
    start = np.random.default_rng(1)
    W1_whole = start.standard_normal((inputs, hidden)) * 0.3
    W2_whole = start.standard_normal((hidden, 1)) * 0.3
    units = slice(shard * hidden // ROWS, (shard + 1) * hidden // ROWS)
    W1, W2 = W1_whole[:, units].copy(), W2_whole[units].copy()
    if grid.row.rank != 0:  # (until broadcast_parameters gives them rank 0's)
        W1 += np.random.default_rng(RANK).standard_normal(W1.shape)
    opt = DistributedOptimizer(SGD([W1, W2], lr=0.05, momentum=0.9), comm=grid.row,
                               bucket_mb=1e-5)  # (a bucket a parameter)
    opt.broadcast_parameters(root=0)
    W1_one, W2_one = W1_whole.copy(), W2_whole.copy()
    one_process = SGD([W1_one, W2_one], lr=0.05, momentum=0.9)
    losses = []
    for step in range(12):
        rows = np.arange(step * batch, (step + 1) * batch) % len(X)
        x, t = X[rows[grid.column_index::COLUMNS]], Y[rows[grid.column_index::COLUMNS]]
        h = np.maximum(x @ W1, 0.0)
        error = grid.column.allreduce(h @ W2) - t
        d = error / len(x)
        opt.grad_ready(1, h.T @ d)
        losses.append(grid.column.allreduce(np.array([np.mean(error**2) / 2]), "avg")[0])
        opt.grad_ready(0, x.T @ ((d @ W2.T) * (h > 0)))
        opt.step()
        x, t = X[rows], Y[rows]
        h = np.maximum(x @ W1_one, 0.0)
        d = (h @ W2_one - t) / len(x)
        one_process.step([x.T @ ((d @ W2_one.T) * (h > 0)), h.T @ d])
    for mine, theirs in zip((W1, W2), zip(*grid.row_mpi.allgather((W1, W2)))):
        assert all(bitwise_equal(mine, other) for other in theirs)
    # (A loss is of its column's share of the batch: alike down a column.)
    assert all(bitwise_equal(np.array(losses), other)
               for other in grid.column_mpi.allgather(np.array(losses)))
    np.testing.assert_allclose(W1, W1_one[:, units], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(W2, W2_one[units], rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(SIZE == 1, reason="needs a group of two ranks")
def test_a_mismatch_on_one_group_leaves_the_other_groups_alone(grid):
    # api.md: a MismatchError leaves the Communicator usable. The other group's calls,
    # in flight meanwhile, finish with the right data.
    (bad, bad_mpi), (other, other_mpi) = grid.groups()[:2]
    if bad.size == 1:
        (bad, bad_mpi), (other, other_mpi) = (other, other_mpi), (bad, bad_mpi)
    x = rank_data(np.dtype(np.float64), 300_000, salt=9)
    in_flight = [other.allreduce_async(x), other.reduce_scatter_async(x, "min")]
    with pytest.raises(rr.MismatchError, match=r"count \(x.size\): 10 on rank 0; 11 on rank 1"):
        bad.allreduce(np.ones(10 + bad.rank))
    with pytest.raises(rr.MismatchError, match="dtype: float64 on rank 0; float32 on rank"):
        bad.allreduce_async(np.ones(5, np.float64 if bad.rank == 0 else np.float32)).wait()
    assert bitwise_equal(in_flight[0].wait(),
                         reference.allreduce(x, "sum", other_mpi, ring=other.ring))
    assert bitwise_equal(in_flight[1].wait(),
                         reference.reduce_scatter(x, "min", other_mpi, ring=other.ring))
    y = rank_data(np.dtype(np.float32), 5000, salt=10)
    for ring, mpi_comm in ((bad, bad_mpi), (other, other_mpi)):
        assert bitwise_equal(ring.allreduce(y), reference.allreduce(y, "sum", mpi_comm,
                                                                     ring=ring.ring))


def test_a_group_closes_while_another_has_calls_in_flight(grid):
    # Closing the rows (in a with block each) while the columns' calls run; the
    # columns' Communicator is closed with its own calls in flight, which close()
    # finishes.
    x = rank_data(np.dtype(np.float64), 200_000, salt=11)
    expected = reference.allreduce(x, "sum", grid.column_mpi, ring=grid.column.ring)
    column = rr.Communicator(grid.column_mpi)
    first = [column.allreduce_async(x) for _ in range(3)]
    with rr.Communicator(grid.row_mpi) as row:
        in_row = row.allreduce_async(x)
    assert row.closed and bitwise_equal(
        in_row.wait(), reference.allreduce(x, "sum", grid.row_mpi, ring=row.ring))
    last = [column.allreduce_async(x) for _ in range(2)]
    column.close()
    for handle in reversed(first + last):
        assert bitwise_equal(handle.wait(), expected)
