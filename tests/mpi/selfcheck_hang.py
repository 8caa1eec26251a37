"""Not a test of ringreduce: a job that hangs, to prove the harness's timeout kills
it (run by tests/test_harness.py)."""
import numpy as np
from mpi4py import MPI


def test_rank_0_waits_for_a_message_nobody_sends():
    if MPI.COMM_WORLD.Get_rank() == 0:
        MPI.COMM_WORLD.Recv(np.empty(1), source=MPI.ANY_SOURCE, tag=99)
    MPI.COMM_WORLD.Barrier()
