"""Run by tests/test_sanitizers.py under ThreadSanitizer, on 2 ranks, over either wire:
while an asynchronous allreduce runs on the worker thread, the caller's thread sets the
Communicator's timeout and reads its counters. The timeouts and the counters were plain
fields that the worker read or wrote meanwhile: races TSan reported (from a review)."""
import numpy as np
from mpi4py import MPI

import ringreduce as rr

comm = rr.Communicator(MPI.COMM_WORLD, timeout=60)
x = np.ones(4_000_000)
for _ in range(3):
    handle = comm.allreduce_async(x)
    turns = 0
    while not handle.done():
        comm.timeout = 30 + turns % 7
        turns += comm.bytes_sent >= 0 and comm.ring_steps >= 0
    assert handle.wait()[0] == comm.size
comm.close()
if MPI.COMM_WORLD.rank == 0:
    print(f"rank 0: settings and counters touched while calls ran ({comm.transport})", flush=True)
