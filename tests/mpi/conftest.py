"""Runs inside every rank. A failing test aborts the whole MPI job at once: the other
ranks would otherwise wait forever in the collective the failed rank never reached.
At the end each rank writes how many tests passed, failed and were skipped."""
import faulthandler
import json
import os
import signal
import sys

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr

_counts = {"passed": 0, "failed": 0, "skipped": 0}

# On a timeout the launcher sends SIGUSR1 first: every rank prints where it is stuck.
faulthandler.register(signal.SIGUSR1, all_threads=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or report.outcome != "passed":
        if report.outcome == "passed" and report.when == "call":
            _counts["passed"] += 1
        elif report.outcome == "skipped":
            _counts["skipped"] += 1
        elif report.outcome == "failed":
            _counts["failed"] += 1
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        text = f"\n[rank {MPI.COMM_WORLD.Get_rank()}] FAILED {item.nodeid}\n{report.longreprtext}\n"
        sys.stderr.write(text)
        sys.stderr.flush()
        # Also where the launcher looks: mpiexec may kill the job before it has passed
        # on what this rank wrote last.
        report_dir = os.environ.get("RINGREDUCE_TEST_REPORT_DIR")
        if report_dir:
            with open(os.path.join(report_dir, f"rank{MPI.COMM_WORLD.Get_rank()}.failed"),
                      "a") as f:
                f.write(text)
        MPI.COMM_WORLD.Abort(1)


def pytest_sessionfinish(session, exitstatus):
    report_dir = os.environ.get("RINGREDUCE_TEST_REPORT_DIR")
    if report_dir:
        rank = MPI.COMM_WORLD.Get_rank()
        path = os.path.join(report_dir, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(dict(_counts, rank=rank, size=MPI.COMM_WORLD.Get_size()), f)
        os.replace(path + ".tmp", path)  # whole or absent, even if the job is killed


@pytest.fixture(scope="session")
def world():
    return MPI.COMM_WORLD


@pytest.fixture(scope="session")
def comm():
    """Default chunk size. (Closed at the end, in the same order on every rank.)"""
    with rr.Communicator() as ring:
        yield ring


@pytest.fixture(scope="session")
def small_chunks():
    """A test-only chunk of 64 bytes, so small arrays already run many pipeline chunks."""
    with rr.Communicator(chunk_bytes=64) as ring:
        yield ring
