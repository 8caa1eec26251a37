import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/launch.py

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
