"""The harness itself: a failing rank aborts the job, and a hang is killed on time."""
import subprocess
import time

import pytest

from launch import run_on_ranks


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
