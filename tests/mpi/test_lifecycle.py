"""A Communicator's life over unusual mpi4py communicators, and what a program may do with
the object itself: copy or pickle it (refused, naming why), make and close one a turn
for longer than MPI has communicators, free the communicator it was made over while it
lives. Every rank count: topology communicators and Split()s differ with the count."""
import copy
import os
import pickle

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def sum_of_ranks(mpi_comm, ring, n=5):
    """ring's allreduce of each rank's rank (in mpi_comm) + 1, checked on every rank."""
    size = mpi_comm.Get_size()
    result = ring.allreduce(np.full(n, mpi_comm.Get_rank() + 1.0))
    np.testing.assert_array_equal(result, np.full(n, size * (size + 1) / 2))


def test_copying_or_pickling_a_communicator_is_refused_and_leaves_it_working():
    # A shallow copy shared the original's core and worker thread: dropped while a call
    # was in flight, it closed them under the original (on one rank alone, the others
    # then met that close in their next call, or waited out their timeout).
    with rr.Communicator(timeout=60) as ring:
        handle = ring.allreduce_async(np.full(1 << 16, RANK + 1.0))
        for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=rf"^ringreduce\.Communicator \(rank {RANK} of "
                                                rf"{SIZE}\): a Communicator cannot be copied"):
                attempt(ring)
            with pytest.raises(TypeError, match=rf"^ringreduce\.allreduce_async \(rank {RANK} "
                                                rf"of {SIZE}\): a Handle cannot be copied"):
                attempt(handle)
        np.testing.assert_array_equal(handle.wait(), np.full(1 << 16, SIZE * (SIZE + 1) / 2))
        for _ in range(3):
            sum_of_ranks(WORLD, ring)


def test_a_deep_copy_of_what_holds_a_communicator_can_share_it_through_memo():
    # The way the error message gives: the copy's state is its own, the ring the same.
    with rr.Communicator(timeout=60) as ring:
        holder = {"ring": ring, "weights": np.arange(4.0)}
        twin = copy.deepcopy(holder, memo={id(ring): ring})
        assert twin["ring"] is ring and twin["weights"] is not holder["weights"]
        sum_of_ranks(WORLD, twin["ring"])


def test_an_intercommunicator_is_refused_by_name():
    if SIZE < 2:
        pytest.skip("an intercommunicator needs two groups")
    local = WORLD.Split(RANK % 2, RANK)
    inter = local.Create_intercomm(0, WORLD, 1 - RANK % 2, tag=11)
    try:
        for given in (inter, MPI.Comm(inter)):  # (a plain MPI.Comm of one, too)
            with pytest.raises(TypeError, match=r"^ringreduce\.Communicator: comm must be an "
                                                r"intracommunicator, got an intercommunicator"):
                rr.Communicator(given)
            with pytest.raises(TypeError, match=r"^ringreduce\.allreduce: comm must be an "
                                                r"intracommunicator"):
                rr.allreduce(np.ones(3), comm=given)
    finally:
        inter.Free()
        local.Free()


def topologies():
    ring_of = [(RANK - 1) % SIZE], [(RANK + 1) % SIZE]
    return {
        "cart": lambda: WORLD.Create_cart([SIZE], periods=[True], reorder=True),
        "graph": lambda: WORLD.Create_graph(list(range(1, SIZE + 1)),
                                            [(i + 1) % SIZE for i in range(SIZE)],
                                            reorder=True),
        "dist graph": lambda: WORLD.Create_dist_graph_adjacent(*ring_of, reorder=True),
    }


@pytest.mark.parametrize("kind", sorted(topologies()))
def test_topology_communicators_reordered_work_and_stay_usable_after_close(kind):
    # (MPI may renumber the ranks of these: the ring follows the communicator's own.)
    mpi_comm = topologies()[kind]()
    try:
        with rr.Communicator(mpi_comm, timeout=60) as ring:
            assert ring.rank == mpi_comm.Get_rank() and ring.size == SIZE
            sum_of_ranks(mpi_comm, ring)
        assert ring.closed
        # The caller's communicator is its own still (ringreduce freed its duplicate).
        assert mpi_comm.allreduce(1) == SIZE
        assert mpi_comm.Get_topology() == {"cart": MPI.CART, "graph": MPI.GRAPH,
                                           "dist graph": MPI.DIST_GRAPH}[kind]
    finally:
        mpi_comm.Free()


@pytest.mark.parametrize("how", ["Split", "Create_group"])
def test_a_rank_left_out_of_a_subcommunicator_gets_comm_null_refused_the_others_a_ring(how):
    left_out = SIZE - 1 if SIZE > 1 else None  # (on 1 rank: nobody)
    if how == "Split":
        sub = WORLD.Split(MPI.UNDEFINED if RANK == left_out else 0, RANK)
    else:
        sub = WORLD.Create_group(WORLD.Get_group().Excl([] if left_out is None else [left_out]))
    if RANK == left_out:
        assert sub == MPI.COMM_NULL
        with pytest.raises(ValueError, match=r"comm is MPI\.COMM_NULL"):
            rr.Communicator(sub)
        return
    try:
        with rr.Communicator(sub, timeout=60) as ring:
            assert ring.size == (SIZE - 1 if left_out is not None else 1)
            sum_of_ranks(sub, ring)
    finally:
        sub.Free()


def test_the_callers_communicator_freed_while_the_communicator_lives():
    # The Communicator runs on its own duplicate, so it goes on; its mpi_comm is then
    # the caller's freed one (COMM_NULL), which a new Communicator refuses by name.
    mine = WORLD.Dup()
    ring = rr.Communicator(mine, timeout=60)
    mine.Free()
    try:
        sum_of_ranks(WORLD, ring)
        assert ring.mpi_comm == MPI.COMM_NULL
        with pytest.raises(ValueError, match=r"comm is MPI\.COMM_NULL: a communicator "
                                             r"already Free\(\)d"):
            rr.Communicator(ring)
        sum_of_ranks(WORLD, ring)
    finally:
        ring.close()


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_communicator_made_and_closed_a_turn_for_more_turns_than_mpi_has_communicators():
    # MPICH has 2048 context ids a process: a Communicator a turn (an epoch, a trial)
    # that kept its duplicate would raise MPIError at about the 2046th. Its memory
    # files must go too. (More than 2048 turns on 2 ranks, over shared memory and over
    # MPI messages; ids are per process, so 3 and 4 oversubscribed ranks, much slower a
    # turn, check only that closing keeps working, as do other MPIs than MPICH, whose
    # limit this is: Open MPI's duplicates take some 90 ms each on 2 ranks here.)
    mpich = "MPICH" in MPI.Get_library_version()
    turns = 2100 if SIZE <= 2 and mpich else 200
    for turn in range(turns):
        with rr.Communicator(timeout=60) as ring:
            ring.allreduce(np.ones(4))
        if turn == 9:
            files = open_files()
    assert open_files() == files
    # The module-level functions over a communicator made and freed a turn, the same.
    for turn in range(turns):
        sub = WORLD.Dup()
        np.testing.assert_array_equal(rr.allreduce(np.ones(2), comm=sub), np.full(2, SIZE))
        sub.Free()
    assert open_files() == files
