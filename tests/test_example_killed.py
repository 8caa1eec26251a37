"""The digits example's checkpoints against real kills: a 2-rank job whose ranks are
killed with SIGKILL (no handler, no chance to finish a save) at several points, each
time run again with the same command, must end exactly as a job that was never
stopped. (tests/mpi/test_example.py stops jobs at every point inside a save with an
exception raised there; this is the same promise with the operating system's kill.)"""
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from launch import job_env, mpiexec

pytest.importorskip("sklearn")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_digits.py"
EPOCHS = 24


def command(*args):
    return [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", str(EXAMPLE),
            "--epochs", str(EPOCHS), *args]


def python_ranks(marker: str) -> list:
    """The pids of the job's Python processes: those whose arguments name `marker`
    (mpiexec's name it too, but it is not Python)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # (ended meanwhile)
            continue
        if marker.encode() in argv and os.path.basename(argv[0]).startswith(b"python"):
            found.append(int(entry))
    return sorted(found)


def run_and_kill_after(epoch: int, victim: int, ckpt: str, history: str) -> str:
    """Runs the job with --checkpoint; once rank 0 has reported `epoch`, kills one rank
    (0 or 1, by pid order) with SIGKILL. Returns what rank 0 wrote."""
    job = subprocess.Popen(command("--checkpoint", ckpt, "--json", history),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=job_env())
    watchdog = threading.Timer(120, job.kill)
    watchdog.daemon = True
    watchdog.start()
    said = []
    try:
        for line in job.stdout:
            said.append(line)
            if line.startswith(f"epoch {epoch:>3}/"):
                ranks = python_ranks(ckpt)
                assert len(ranks) == 2, (ranks, "".join(said))
                os.kill(ranks[victim], signal.SIGKILL)
                break
        rest = job.communicate(timeout=60)[0]
    finally:
        watchdog.cancel()
        job.kill()
    said.append(rest or "")
    assert job.returncode != 0, "".join(said)  # (the kill landed before the job ended)
    return "".join(said)


def test_a_job_killed_again_and_again_ends_as_one_never_stopped(tmp_path):
    reference = tmp_path / "reference.json"
    subprocess.run(command("--json", str(reference)), check=True, capture_output=True,
                   timeout=120, env=job_env())
    ckpt, history = str(tmp_path / "ck"), str(tmp_path / "history.json")
    said = [run_and_kill_after(epoch, victim, ckpt, history)
            for epoch, victim in [(4, 1), (9, 0), (15, 1)]]
    # Each job after the first went on from a checkpoint, not from the start.
    for output in said[1:]:
        assert "resuming after epoch" in output, output
    done = subprocess.run(command("--checkpoint", ckpt, "--json", history), text=True,
                          capture_output=True, timeout=120, env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming after epoch" in done.stderr
    want, got = (json.loads(Path(p).read_text()) for p in (reference, history))
    assert got["epoch"] == list(range(1, EPOCHS + 1))
    for key in ("loss", "train_accuracy", "test_accuracy"):
        assert got[key] == want[key], key  # bit for bit: floats from JSON compare exactly
