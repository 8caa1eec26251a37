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
        before_bytes, before_steps = ring.bytes_sent, ring.ring_steps
        ring.allreduce(np.arange(count, dtype=np.float32) + RANK)
        sent = ring.bytes_sent - before_bytes
        steps = ring.ring_steps - before_steps
        order = ring.ring  # (rank order unless RINGREDUCE_TEST_MACHINE puts them elsewhere)
    model = sim.ring(SIZE, count, 4, ring_order=order)
    assert sent == model.bytes_sent[RANK]
    assert steps == model.steps == 2 * (SIZE - 1)


def test_the_counters_a_learner_reads_are_what_each_collective_sends():
    # Communicator.bytes_sent and ring_steps, as their docstrings give them, for each
    # collective of a size past the header exchange (p divides it).
    with rr.Communicator(chunk_bytes=4096) as ring:
        n = (16384 + 100) * SIZE  # float32 elements: past every call the header carries
        x = np.ones(n, np.float32)
        p = SIZE
        position = ring.ring.index(RANK)  # (a broadcast's chain follows the ring from root)
        root = ring.ring[0]
        for name, call, nbytes, steps in (
                ("allreduce", lambda: ring.allreduce(x), 2 * (p - 1) * 4 * n // p, 2 * (p - 1)),
                ("reduce_scatter", lambda: ring.reduce_scatter(x), (p - 1) * 4 * n // p, p - 1),
                ("allgather", lambda: ring.allgather(x), (p - 1) * 4 * n, p - 1),
                ("broadcast", lambda: ring.broadcast(x, root=root),
                 4 * n if p > 1 and position < p - 1 else 0, 0),
                ("allreduce_async", lambda: ring.allreduce_async(x).wait(),
                 2 * (p - 1) * 4 * n // p, 2 * (p - 1)),
                ("small", lambda: ring.allreduce(np.ones(2, np.float32)), 0, 0)):
            before = ring.bytes_sent, ring.ring_steps
            call()
            assert (ring.bytes_sent - before[0], ring.ring_steps - before[1]) == (nbytes, steps), \
                name
