"""The simulator's ring sends exactly what the real core sends, in as many steps."""
import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import sim

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()


@pytest.mark.parametrize("extra", [1, 100, 1001, 4099, 300_000])
def test_simulated_ring_traffic_matches_the_core(extra):
    with rr.Communicator(chunk_bytes=4096) as ring:
        # Past the size that rides in the header exchange, which runs no ring.
        count = ring._core.inline_capacity // 4 + extra
        before_bytes, before_steps = ring._core.ring_bytes_sent, ring._core.ring_steps
        ring.allreduce(np.arange(count, dtype=np.float32) + RANK)
        sent = ring._core.ring_bytes_sent - before_bytes
        steps = ring._core.ring_steps - before_steps
        order = ring.ring  # (rank order unless RINGREDUCE_TEST_MACHINE puts them elsewhere)
    model = sim.ring(SIZE, count, 4, ring_order=order)
    assert sent == model.bytes_sent[RANK]
    assert steps == model.steps == 2 * (SIZE - 1)
