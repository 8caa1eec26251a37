import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/launch.py
from launch import mpi_segments, remove_mpi_segments_left  # noqa: E402

# tests/mpi/ runs only under mpiexec, launched by test_on_ranks.py and test_harness.py
# (which set RINGREDUCE_TEST_REPORT_DIR); a plain `pytest tests` must not collect it.
if not os.environ.get("RINGREDUCE_TEST_REPORT_DIR"):
    collect_ignore = ["mpi"]

# With a system Open MPI (MPICC=... bash scripts/test.sh), every mpiexec the tests start
# must accept more ranks than cores (they run 4 ranks on 2 on purpose) and, on machines
# where the tests run as root (CI containers), root. MPICH ignores these variables.
os.environ.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
if hasattr(os, "geteuid") and os.geteuid() == 0:
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


@pytest.fixture(scope="session", autouse=True)
def no_mpi_shared_memory_left_behind():
    # MPI's own shared memory outlives the jobs that tests kill or abort on purpose
    # (launch.remove_mpi_segments_left says more): what this session's left goes.
    outer = not os.environ.get("RINGREDUCE_TEST_REPORT_DIR")  # (not a rank's own session)
    before = mpi_segments() if outer else None
    yield
    if before is not None:
        remove_mpi_segments_left(before)
