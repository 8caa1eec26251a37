"""Counts past 2**31 elements: every offset and count in the core is 64-bit."""
import numpy as np
from mpi4py import MPI

import ringreduce as rr

COUNT = 2**31 + 2**20 + 3  # int8: about 2 GiB per rank


def test_allreduce_past_2_to_the_31_elements(world):
    period = 2**20 + 7  # not a divisor of anything the ring cuts at
    pattern = np.random.default_rng(world.Get_rank()).integers(-128, 128, period, dtype=np.int8)
    x = np.resize(pattern, COUNT)
    with np.errstate(over="ignore"):
        summed = np.sum(world.allgather(pattern), axis=0, dtype=np.int8)
    rr.allreduce(x, op="sum", out=x)  # in place: one 2 GiB buffer per rank
    expected = np.resize(summed, COUNT)
    block = 1 << 26
    for start in range(0, COUNT, block):
        assert np.array_equal(x[start:start + block], expected[start:start + block]), start
    assert x[-1] == summed[(COUNT - 1) % period]
