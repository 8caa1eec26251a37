"""Ctrl-C while Communicators and DistributedOptimizers are made, closed and set up:
whole jobs under mpiexec, with one rank held up (asleep) where the others wait for it,
and the SIGINT sent once every rank has said where it is. Ctrl-C to mpiexec (which
passes it on to every rank) must end the job at once, every rank raising
KeyboardInterrupt; Ctrl-C to one rank must stop it there, and the others must not be
left waiting out their timeout (120 s here) where they can learn of it."""
import os
import re
import signal
import subprocess
import time

import pytest

from launch import mpiexec, start_script

# Every rank says "rank R pid P ready" just before the point where the SIGINT is to find
# it, and, where it catches one, "rank R SECONDS KIND: message" (one write: whole lines).
PRELUDE = """
import os
import sys
import time
import numpy as np
from mpi4py import MPI
import ringreduce as rr
from ringreduce.optim import SGD, DistributedOptimizer

rank = MPI.COMM_WORLD.Get_rank()
late = rank == MPI.COMM_WORLD.Get_size() - 1  # held up where the others wait for it


def say(text):
    os.write(1, f"rank {rank} {text}\\n".encode())


def ready():
    MPI.COMM_WORLD.Barrier()  # (no rank is still importing when the test signals)
    say(f"pid {os.getpid()} ready")
    return time.monotonic()


def caught(start, error):
    say(f"{time.monotonic() - start:.1f} {type(error).__name__}: {error}")
"""

MAKING = PRELUDE + """
start = ready()
try:
    if late:
        time.sleep(60)  # the others wait for it in MPI_Comm_idup
    rr.Communicator(timeout=120)
    say("made it")
except BaseException as error:
    caught(start, error)
    raise
"""

CLOSING = PRELUDE + """
ring = rr.Communicator(timeout=120)
ring.allreduce(np.ones(4))
start = ready()
try:
    if late:
        time.sleep(float(sys.argv[1]))  # the others wait for it in close()
    ring.close()
    say(f"{time.monotonic() - start:.1f} closed")
except BaseException as error:
    caught(start, error)
    if not late:  # (stopped in close(): closed here, so a call is refused, not made)
        say(f"closed={ring.closed}")
        try:
            ring.allreduce(np.ones(4))
        except ValueError as refused:
            say(f"then: {refused}")
    raise
"""

OPTIMIZER = PRELUDE + """
params = [np.full(8, float(rank)), np.zeros(3)]
ring = None if sys.argv[1] == "module" else rr.Communicator(timeout=120)
opt = DistributedOptimizer(SGD(params, lr=0.1), ring) if sys.argv[1] == "broadcast" else None
start = ready()
try:
    if late:
        time.sleep(float(sys.argv[2]))  # the others wait for it in the collective
    if sys.argv[1] == "broadcast":
        opt.broadcast_parameters(root=0)
    else:  # (over the module-level Communicator, made here, where ring is None)
        opt = DistributedOptimizer(SGD(params, lr=0.1), ring)
    say(f"{time.monotonic() - start:.1f} done")
    if sys.argv[1] == "make":
        opt.step([np.ones(8), np.ones(3)])
        say("stepped")
except BaseException as error:
    caught(start, error)
    raise
"""


class Job:
    """A job on `ranks` ranks, killed after `limit` seconds whatever happens (a test
    reading its output would otherwise wait for good on a job that hangs)."""

    def __init__(self, tmp_path, name, text, args=(), ranks=2, env=None, limit=120):
        self.script = tmp_path / name
        self.ranks = ranks
        self.process = start_script(tmp_path, name, text, args, ranks,
                                    {"RINGREDUCE_TIMEOUT": "120", **(env or {})}, limit)
        self.said = ""

    def wait_until_ready(self) -> dict:
        """{rank: pid} once every rank said it is ready."""
        pids = {}
        while len(pids) < self.ranks:
            line = self.process.stdout.readline()
            assert line, self.said + self.process.stderr.read()  # ended before that
            self.said += line
            pids.update({int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+) ready", line)})
        return pids

    def end(self, within: float) -> tuple:
        """(stdout, stderr) once the job ended, which must be within `within` seconds."""
        try:
            out, err = self.process.communicate(timeout=within)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.process.communicate()
            raise AssertionError(f"the job went on after Ctrl-C:\n{self.said}{out}{err}") from None
        return self.said + out, err

    def kill(self):
        self.process.kill()
        subprocess.run(["pkill", "-9", "-f", str(self.script)])


def what_each_rank_caught(out: str) -> dict:
    return {int(rank): (float(seconds), kind, text) for rank, seconds, kind, text in
            re.findall(r"^rank (\d+) ([\d.]+) (\w+): ?(.*)$", out, re.MULTILINE)}


def launcher_passes_sigint_on() -> bool:
    """Whether mpiexec passes a SIGINT on to the ranks, as MPICH's Hydra does. Open MPI's
    mpirun does not: its man page (Signal Propagation) says that on SIGINT or SIGTERM it
    kills the job, SIGTERM to every rank and SIGKILL a few seconds later. There the job
    must still end at once, but no rank raises KeyboardInterrupt to show where it was."""
    from ringreduce import info

    return not info.launcher_family(mpiexec()).startswith("Open MPI")


def ringreduce_shared_memory() -> set:
    return {name for name in os.listdir("/dev/shm") if "ringreduce" in name} \
        if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared memory", "MPI"])
def test_ctrl_c_to_mpiexec_while_a_rank_is_late_to_make_its_communicator(tmp_path, shm):
    # Ranks 0 and 1 wait in the making (MPI_Comm_idup) for rank 2, asleep before it.
    # One Ctrl-C to mpiexec: every rank raises KeyboardInterrupt, the waiting ones from
    # the making, and the job ends at once rather than at the 120 s timeout.
    before = ringreduce_shared_memory()
    job = Job(tmp_path, "making.py", MAKING, ranks=3, env={"RINGREDUCE_SHM": shm})
    job.wait_until_ready()
    time.sleep(1.0)  # ranks 0 and 1 inside the making by now
    job.process.send_signal(signal.SIGINT)
    out, err = job.end(within=30)
    caught = what_each_rank_caught(out)
    # (MPICH's mpiexec may report a rank ended by SIGINT as one ended by SIGSEGV; that
    # happens to ranks in time.sleep() alone too, without ringreduce.)
    assert "made it" not in out, out
    assert ringreduce_shared_memory() <= before
    if not launcher_passes_sigint_on():
        return
    assert sorted(caught) == [0, 1, 2] and all(
        kind == "KeyboardInterrupt" and seconds < 10 for seconds, kind, _ in caught.values()), out + err
    assert err.count("in __init__") >= 2, err  # ranks 0 and 1 stopped inside the making


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared memory", "MPI"])
def test_ctrl_c_on_a_rank_waiting_in_close_leaves_and_the_late_rank_closes(tmp_path, shm):
    # Rank 0 waits in close() for rank 1, asleep 6 s; Ctrl-C on rank 0 alone. It raises
    # KeyboardInterrupt, its Communicator is closed there (it left: calls raise
    # ValueError), and rank 1's close(), which then finds rank 0 gone, returns at once
    # instead of waiting out its 120 s timeout for a close that never comes.
    job = Job(tmp_path, "closing.py", CLOSING, args=("6",), env={"RINGREDUCE_SHM": shm})
    pids = job.wait_until_ready()
    time.sleep(1.0)  # rank 0 inside close() by now
    os.kill(pids[0], signal.SIGINT)
    out, err = job.end(within=60)
    caught = what_each_rank_caught(out)
    # (stopped where it waited, at about 1 s: not once rank 1 came, at 6 s)
    assert caught[0][1] == "KeyboardInterrupt" and caught[0][0] < 4, out + err
    assert "rank 0 closed=True" in out, out
    assert "rank 0 then: ringreduce.allreduce (rank 0 of 2): this Communicator has been closed" in out
    closed = re.search(r"^rank 1 ([\d.]+) closed$", out, re.MULTILINE)
    assert closed and float(closed.group(1)) < 15, out + err


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared memory", "MPI"])
def test_ctrl_c_to_mpiexec_while_ranks_wait_in_close(tmp_path, shm):
    job = Job(tmp_path, "closing.py", CLOSING, args=("60",), env={"RINGREDUCE_SHM": shm})
    job.wait_until_ready()
    time.sleep(1.0)  # rank 0 inside close(), rank 1 asleep before it
    job.process.send_signal(signal.SIGINT)
    out, err = job.end(within=30)
    assert not re.search(r"^rank \d [\d.]+ closed$", out, re.MULTILINE), out
    if not launcher_passes_sigint_on():
        return
    caught = what_each_rank_caught(out)
    assert sorted(caught) == [0, 1], out + err
    assert all(kind == "KeyboardInterrupt" for _, kind, _ in caught.values()), out + err


@pytest.mark.parametrize("case", ["make", "module", "broadcast"])
def test_ctrl_c_to_mpiexec_while_ranks_set_up_a_distributed_optimizer(tmp_path, case):
    # Rank 0 waits for rank 1 (asleep) in DistributedOptimizer(...)'s agreement on the
    # model, in the making of the module-level Communicator it makes first (comm None),
    # or in broadcast_parameters(); Ctrl-C to mpiexec ends the job at once.
    job = Job(tmp_path, "optimizer.py", OPTIMIZER, args=(case, "60"))
    job.wait_until_ready()
    time.sleep(1.0)
    job.process.send_signal(signal.SIGINT)
    out, err = job.end(within=30)
    assert not re.search(r"^rank \d [\d.]+ done$", out, re.MULTILINE), out
    if not launcher_passes_sigint_on():
        return
    caught = what_each_rank_caught(out)
    assert sorted(caught) == [0, 1], out + err
    assert all(kind == "KeyboardInterrupt" for _, kind, _ in caught.values()), out + err


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared memory", "MPI"])
@pytest.mark.parametrize("case", ["broadcast", "make"])
def test_ctrl_c_on_one_rank_in_an_optimizers_agreement_tells_the_other(tmp_path, case, shm):
    # Rank 0 waits for rank 1 (asleep 6 s) in broadcast_parameters() or in
    # DistributedOptimizer(...): Ctrl-C on rank 0, which raises KeyboardInterrupt there
    # and leaves the communicator. Rank 1, when it comes, raises CollectiveTimeoutError
    # at once, naming rank 0: in broadcast_parameters(), or (making it) at its first
    # step, as rank 0's part of the agreement was on its way already, so rank 1 makes
    # its optimizer (a call of small rows completes where every rank's rows came).
    job = Job(tmp_path, "optimizer.py", OPTIMIZER, args=(case, "6"),
              env={"RINGREDUCE_SHM": shm})
    pids = job.wait_until_ready()
    time.sleep(1.0)
    os.kill(pids[0], signal.SIGINT)
    out, err = job.end(within=60)
    caught = what_each_rank_caught(out)
    # (stopped where it waited, at about 1 s: not once rank 1 came, at 6 s)
    assert caught[0][1] == "KeyboardInterrupt" and caught[0][0] < 4, out + err
    assert "stepped" not in out, out
    seconds, kind, text = caught[1]
    assert kind == "CollectiveTimeoutError" and seconds < 15, out + err
    assert "rank 0 has left this communicator" in text, text
