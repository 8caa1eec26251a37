"""Runs benchmarks/bench_gpu.py with fake_cupy over the core's host emulation of a GPU,
so that tests/test_benchmarks.py can check the script end to end on machines without
one (its times mean nothing there). Same arguments as bench_gpu.py."""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fake_cupy  # noqa: E402

fake_cupy.emulate_gpu()

# EMULATED_BENCH_CORRUPT=name: that collective's results are off by one element on rank 1
# (for the test that the benchmark refuses a wrong result).
corrupt = os.environ.get("EMULATED_BENCH_CORRUPT")
if corrupt:
    import numpy as np
    from mpi4py import MPI

    import ringreduce

    right = getattr(ringreduce.Communicator, corrupt)

    def wrong(self, *args, **kwargs):
        got = right(self, *args, **kwargs)
        if MPI.COMM_WORLD.Get_rank() == 1:
            got.host.reshape(-1)[-1] += np.float32(1)
        return got
    setattr(ringreduce.Communicator, corrupt, wrong)
sys.argv[0] = os.path.join(HERE, "..", "..", "benchmarks", "bench_gpu.py")
runpy.run_path(sys.argv[0], run_name="__main__")
