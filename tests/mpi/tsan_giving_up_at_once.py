"""Run by tests/test_sanitizers.py under ThreadSanitizer, on 2 ranks, over MPI messages
(RINGREDUCE_SHM=0): six threads of rank 0, each in an allreduce on a Communicator of
its own that rank 1 never joins, give up at the same moment. Each one's leave() keeps
its pending header exchange's buffers, for good, in one list of the whole process,
which they once appended to at once, unlocked: TSan saw the race in every run, and
the heap was corrupt in some (from a review)."""
import sys
import threading

import numpy as np
from mpi4py import MPI

import ringreduce as rr

THREADS = 6
world = MPI.COMM_WORLD
rings = [rr.Communicator(world, timeout=30) for _ in range(THREADS)]
assert all(ring.transport == "MPI" for ring in rings), [ring.transport for ring in rings]
errors = []
if world.rank == 0:
    start = threading.Barrier(THREADS)

    def call(ring):
        ring.timeout = 1.0
        start.wait()
        try:
            ring.allreduce(np.arange(4.0))
        except rr.CollectiveTimeoutError as error:
            errors.append(error)

    threads = [threading.Thread(target=call, args=(ring,)) for ring in rings]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(errors) != THREADS:
        sys.exit(f"rank 0: {len(errors)} of {THREADS} calls timed out: {errors}")
world.Barrier()
if world.rank == 0:
    print(f"rank 0: all {THREADS} calls gave up", flush=True)
