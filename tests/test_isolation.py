"""Whole jobs whose ranks look like one machine but cannot share memory the usual way:
the shared-memory wire must notice and leave the ranks to MPI, never compute with the
wrong memory."""
import subprocess
import sys

import pytest

from launch import job_env, mpiexec

ALIGNED_FDS = """
import os
import sys
import numpy as np
from mpi4py import MPI
import ringreduce as rr

# Each rank runs in a pid namespace of its own (so both are pid 1), and takes the same
# file descriptors, so that the path one offers for its memory, /proc/1/fd/N, names
# the other's own memory there.
while (fd := os.open("/dev/null", os.O_RDONLY)) < 60:
    pass
os.close(fd)
ring = rr.Communicator(timeout=60)
rank = MPI.COMM_WORLD.Get_rank()
with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as said:
    said.write(ring.transport_reason + "\\n")
    for n in (1, 1000):  # (small: MPICH's own single-copy path fails across namespaces)
        result = ring.allreduce(np.full(n, rank + 1.0))
        said.write(f"pid {os.getpid()} {ring.transport} result {np.unique(result)}\\n")
"""


# What ringreduce asks of MPI in that job, without ringreduce: whether the MPI library
# itself works between ranks in pid namespaces of their own (Open MPI 4.1's shared-memory
# transport crashes there).
MPI_ALONE = """
import numpy as np
from mpi4py import MPI
dup = MPI.COMM_WORLD.Dup()
dup.Ibarrier().Wait()
mine, everyone = np.zeros(256, np.uint8), np.zeros(256 * dup.Get_size(), np.uint8)
dup.Iallgather(mine, everyone).Wait()
for n in (1, 1000):
    dup.Allreduce(np.ones(n), np.empty(n))
"""


def in_namespaces(tmp_path, name, text, *args):
    script = tmp_path / name
    script.write_text(text)
    return subprocess.run([mpiexec(), "-n", "2", "unshare", "-pf", "--mount-proc",
                           sys.executable, str(script), *args],
                          capture_output=True, text=True, timeout=120, env=job_env())


def unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-pf", "--mount-proc", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not unshare_works(), reason="no unshare with a pid namespace here")
def test_ranks_in_pid_namespaces_of_their_own_never_map_each_others_memory_wrongly(tmp_path):
    try:
        alone = in_namespaces(tmp_path, "mpi_alone.py", MPI_ALONE)
    except subprocess.TimeoutExpired:
        alone = None
    if alone is None or alone.returncode != 0:
        pytest.skip("this MPI library does not work between pid namespaces by itself")
    # The check that found this: both ranks mapped their own memory as the other's
    # (the same /proc path in each namespace), and every sum came out wrong, silently.
    done = in_namespaces(tmp_path, "aligned.py", ALIGNED_FDS, str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    said = [(tmp_path / f"rank{rank}.txt").read_text().splitlines() for rank in (0, 1)]
    for reason, *_ in said:  # the same on both
        assert reason == ("rank 0 could not map the shared memory of rank 1 (e.g. processes "
                          "in other pid namespaces, or of other users)"), said
    lines = [line for lines in said for line in lines[1:]]
    assert len(lines) == 4, lines
    assert all(line.startswith("pid 1 ") for line in lines), lines  # in namespaces indeed
    assert all(line.endswith("result [3.]") for line in lines), lines


FEW_FILE_DESCRIPTORS = """
import os
import resource
import sys
import numpy as np
from mpi4py import MPI
import ringreduce as rr

rank = MPI.COMM_WORLD.Get_rank()
held = []
if rank == 1:  # every file descriptor taken but one (its own memory's)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, soft), hard))
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    os.close(held.pop())
ring = rr.Communicator(timeout=60)
for fd in held:
    os.close(fd)
with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as said:
    said.write(ring.transport_reason + "\\n")
    said.write(f"{ring.transport} {np.unique(ring.allreduce(np.full(1000, rank + 1.0)))}\\n")
ring.close()
"""


def test_a_rank_out_of_file_descriptors_says_so_and_the_ranks_go_on_over_mpi(tmp_path):
    # Before, the reason blamed pid namespaces or other users (helper 179).
    script = tmp_path / "fds.py"
    script.write_text(FEW_FILE_DESCRIPTORS)
    done = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", str(script),
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=job_env())
    assert done.returncode == 0, done.stderr[-4000:]
    said = [(tmp_path / f"rank{rank}.txt").read_text().splitlines() for rank in (0, 1)]
    for lines in said:
        assert lines == ["rank 1 could not map the shared memory of rank 0 (Too many open "
                         "files)", "MPI [3.]"], said
