"""Not a test of ringreduce: proves that the harness aborts the job when one rank
fails before a collective (run by tests/test_harness.py)."""
from mpi4py import MPI


def test_last_rank_fails_before_a_barrier():
    if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
        raise AssertionError("deliberate failure on the last rank")
    MPI.COMM_WORLD.Barrier()  # the others would wait here forever without the abort
