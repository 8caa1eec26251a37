"""The harness itself: a failing rank aborts the job, a hang is killed on time, and
jobs start the mpiexec they are told to."""
import os
import subprocess
import time

import pytest

from launch import mpiexec, run_on_ranks, run_script


def test_a_failing_rank_aborts_the_job_quickly(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"failed \(exit") as info:
        run_on_ranks(3, "selfcheck_abort.py", tmp_path, timeout=120)
    assert "deliberate failure" in str(info.value)
    assert time.monotonic() - start < 60


def test_a_hanging_job_is_killed_at_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish within 10 s"):
        run_on_ranks(2, "selfcheck_hang.py", tmp_path, timeout=10)
    assert time.monotonic() - start < 30
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", "selfcheck_hang"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left running: {left.stdout}"


def test_the_mpiexec_named_by_ringreduce_mpiexec_starts_the_jobs(tmp_path, monkeypatch):
    # (benchmarks/gpu_check.sh names the MPI it installs, whose mpiexec is not beside
    # the python it runs)
    monkeypatch.delenv("RINGREDUCE_MPIEXEC", raising=False)
    real = mpiexec()
    named = tmp_path / "bin" / "my-mpiexec"
    named.parent.mkdir()
    named.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" > "{tmp_path}/started"\n'
                     f'exec "{real}" "$@"\n')
    named.chmod(0o755)
    monkeypatch.setenv("RINGREDUCE_MPIEXEC", str(named))
    assert mpiexec() == str(named)
    done = run_script(tmp_path, "hello.py", "print('hello')", ranks=1)
    assert done.returncode == 0 and "hello" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "started").read_text().startswith("-n 1 ")
    monkeypatch.setenv("PATH", f"{named.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RINGREDUCE_MPIEXEC", "my-mpiexec")  # a name on PATH
    assert mpiexec() == str(named)
    monkeypatch.setenv("RINGREDUCE_MPIEXEC", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="RINGREDUCE_MPIEXEC=.*missing.*no such executable"):
        mpiexec()
