"""An exception that leaves a `with rr.Communicator()` block on one rank must end the job
(`python -m mpi4py` aborts it), not hang it: freeing the communicator is collective,
and the other ranks are elsewhere, here in an allreduce."""
import subprocess
import sys
import time

from launch import mpiexec

SCRIPT = """
import numpy as np
from mpi4py import MPI
import ringreduce as rr

with rr.Communicator() as ring:
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise KeyError("only on rank 1")
    ring.allreduce(np.ones(10))  # rank 0 waits here for rank 1
"""


def test_an_exception_leaving_a_with_block_on_one_rank_ends_the_job(tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    try:
        done = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", str(script)],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-f", str(script)])
        raise AssertionError("the job hung instead of ending") from None
    assert done.returncode != 0
    assert "only on rank 1" in done.stderr
    assert time.monotonic() - start < 60
