import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/launch.py

# tests/mpi/ runs only under mpiexec, launched by test_on_ranks.py and test_harness.py
# (which set RINGREDUCE_TEST_REPORT_DIR); a plain `pytest tests` must not collect it.
if not os.environ.get("RINGREDUCE_TEST_REPORT_DIR"):
    collect_ignore = ["mpi"]
