"""Runs a pytest module on several MPI ranks at once, under mpiexec, with a timeout.

Each rank runs the same tests in the same order (`python -m mpi4py -m pytest`, so an
uncaught error on one rank aborts the whole job) and writes a one-line JSON summary;
a failing test aborts the job at once (see tests/mpi/conftest.py) instead of leaving
the other ranks waiting in a collective.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    """RINGREDUCE_MPIEXEC where set (a path, or a name on PATH: the GPU check names the
    MPI it installed, which the python there does not sit beside), else the mpiexec
    beside this python (the mpich wheel's in a virtual environment, or the script that
    scripts/bootstrap.sh puts there to start a system MPI's, under MPICC), else PATH's."""
    named = os.environ.get("RINGREDUCE_MPIEXEC")
    if named:
        found = shutil.which(named)
        if not found:
            raise RuntimeError(f"RINGREDUCE_MPIEXEC={named!r}: no such executable")
        return found
    # (Imported here: conftest.py imports this module in every test process, and
    # importing ringreduce initialises MPI.)
    from ringreduce._mpi_check import mpiexec_beside_python

    found = mpiexec_beside_python(or_on_path=True)
    if not found:
        raise RuntimeError("mpiexec not found: install the mpich wheel or a system MPI")
    return found


def job_env(extra: dict | None = None) -> dict:
    """The environment for an mpiexec started by a test: os.environ (with extra), given
    explicitly. A test process that imported ringreduce has initialised MPI, and Open
    MPI then adds its own job's variables (PMIX_*, OMPI_*) to the C environment, which
    a child inherits by default: an mpiexec that sees them thinks it runs inside that
    job and fails without a word. os.environ is Python's copy, without them."""
    return {**os.environ, **(extra or {})}


def run_script(tmp_path, name, text, env=None, timeout=60, args=(), abort_on_exception=True,
               ranks=2, cwd=None):
    """The job (on 2 ranks unless told); by default run by `python -m mpi4py`, which
    ends the job (MPI_Abort) when an exception is not caught. It runs in cwd (this
    process's own unless given)."""
    script = tmp_path / name
    script.write_text(text)
    python = [sys.executable, "-m", "mpi4py"] if abort_on_exception else [sys.executable]
    try:
        return subprocess.run([mpiexec(), "-n", str(ranks), *python, str(script), *args],
                              capture_output=True, text=True, timeout=timeout,
                              env=job_env(env), cwd=cwd)
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-f", str(script)])
        raise AssertionError("the job hung instead of ending") from None


def start_script(tmp_path, name, text, args=(), ranks=2, env=None, timeout=120):
    """The job (on 2 ranks unless told) running, its output piped, for a test to act on
    as it goes; killed after `timeout` seconds whatever happens (a test reading its
    output would otherwise wait for good on a job that hangs before it says anything)."""
    script = tmp_path / name
    script.write_text(text)
    job = subprocess.Popen([mpiexec(), "-n", str(ranks), sys.executable, str(script), *args],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=job_env(env))
    watchdog = threading.Timer(timeout, job.kill)
    watchdog.daemon = True
    watchdog.start()
    return job


def failures_reported(report_dir: Path) -> str:
    """What failing ranks wrote into the report directory (tests/mpi/conftest.py)."""
    failures = "".join(path.read_text() for path in sorted(report_dir.glob("rank*.failed")))
    return f"\nFailures reported:{failures[-12000:]}" if failures else ""


def run_on_ranks(ranks: int, module: str, tmp_path: Path, timeout: float, extra=(),
                 env: dict | None = None) -> dict:
    """Runs tests/mpi/<module> on `ranks` ranks; returns the per-rank summaries."""
    report_dir = tmp_path / "reports"
    report_dir.mkdir(exist_ok=True)
    marker = f"{os.getpid()}-{uuid.uuid4().hex}"  # in every rank's environment
    # One BLAS thread per rank: more ranks than cores already, spinning BLAS threads on
    # top would only slow the tests down.
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **job_env(env),
           "RINGREDUCE_TEST_REPORT_DIR": str(report_dir), "RINGREDUCE_TEST_JOB": marker,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "pytest",
               "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
               str(ROOT / "tests" / "mpi" / module), *extra]
    # A session of its own, so that on a timeout the whole job can be killed.
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc, marker)
        output, _ = proc.communicate()
        raise AssertionError(f"{module} on {ranks} ranks did not finish within {timeout} s "
                             f"(a hang?). Output:\n{output[-6000:]}"
                             f"{failures_reported(report_dir)}") from None
    summaries = {}
    for path in report_dir.glob("rank*.json"):
        try:
            summary = json.loads(path.read_text())
        except ValueError:  # a rank killed while writing it: treated as missing
            continue
        summaries[summary["rank"]] = summary
    if proc.returncode != 0:
        raise AssertionError(f"{module} on {ranks} ranks failed (exit {proc.returncode}):\n"
                             f"{output[-12000:]}{failures_reported(report_dir)}")
    if sorted(summaries) != list(range(ranks)):
        raise AssertionError(f"{module} on {ranks} ranks: summaries from ranks "
                             f"{sorted(summaries)} only:\n{output[-6000:]}")
    return summaries



def kill_job(proc: subprocess.Popen, marker: str) -> None:
    """Kill mpiexec and every rank it started, whatever process group they are in.

    MPICH's ranks stay in mpiexec's session; Open MPI's may not, so after killing the
    session we also look for any process whose environment carries this job's marker.
    """
    # Each rank (not mpiexec, which SIGUSR1 would kill) prints its stack first.
    _signal_ranks(marker, signal.SIGUSR1, only_python=True)
    time.sleep(2)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=5)
            break
        except subprocess.TimeoutExpired:
            continue
    _signal_ranks(marker, signal.SIGKILL)


def _signal_ranks(marker: str, sig: int, only_python: bool = False) -> None:
    """Signal every process whose environment carries this job's marker."""
    needle = f"RINGREDUCE_TEST_JOB={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            program = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
            if not only_python or os.path.basename(program).startswith("python"):
                os.kill(int(entry.name), sig)
        except (OSError, ValueError):
            continue


# MPI's own shared memory (MPICH's mpich_shm_*, Open MPI's vader_segment.*) outlives a
# job whose ranks were killed or aborted, as many tests do on purpose, and stays in
# /dev/shm (which is memory) until the machine restarts: some 100 MB a run of the suite.
MPI_SEGMENT_PREFIXES = ("mpich_shm_", "vader_segment.")
SHM = "/dev/shm"


def mpi_segments() -> set:
    """The names of MPI's shared-memory files in /dev/shm now."""
    try:
        return {name for name in os.listdir(SHM) if name.startswith(MPI_SEGMENT_PREFIXES)}
    except OSError:
        return set()


def mapped_in_shm() -> set:
    """The names of the files in /dev/shm that a live process maps."""
    mapped = set()
    with contextlib.suppress(OSError):
        pids = [pid for pid in os.listdir("/proc") if pid.isdigit()]
        for pid in pids:
            try:
                with open(f"/proc/{pid}/maps") as maps:
                    for line in maps:
                        fields = line.split(None, 5)
                        if len(fields) == 6 and fields[5].startswith(SHM + "/"):
                            path = fields[5].rstrip("\n").removesuffix(" (deleted)")
                            mapped.add(os.path.basename(path))
            except OSError:  # (ended meanwhile, or another user's)
                continue
    return mapped


def remove_mpi_segments_left(before: set) -> list:
    """Removes MPI's files that came to /dev/shm since `before` was taken, are this
    user's, and that no live process maps, looked at twice half a second apart (a job
    that is starting creates its file before mapping it); returns their names. Without
    /proc, where what is mapped cannot be known, removes nothing."""
    left = mpi_segments() - before
    if not left or not os.path.isdir("/proc"):
        return []
    left -= mapped_in_shm()
    if not left:
        return []
    time.sleep(0.5)
    removed = []
    for name in sorted(left - mapped_in_shm()):
        path = os.path.join(SHM, name)
        with contextlib.suppress(OSError):
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(name)
    return removed
