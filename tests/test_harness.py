"""The harness itself: a failing rank aborts the job, a hang is killed on time, and
jobs start the mpiexec they are told to."""
import mmap
import os
import subprocess
import sys
import time

import pytest

from launch import SHM, job_env, mpi_segments, mpiexec, remove_mpi_segments_left, \
    run_on_ranks, run_script


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
    assert time.monotonic() - start < 10 + 2 + 5 + 5 + 20  # the timeout, kill_job's waits
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", "selfcheck_hang"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left running: {left.stdout}"


@pytest.mark.skipif(not (os.path.isdir(SHM) and os.path.isdir("/proc")),
                    reason="needs /dev/shm and /proc")
def test_mpi_shared_memory_left_by_a_killed_job_is_removed_but_not_a_live_ones(tmp_path):
    # The suite's end removes MPI's files that its killed jobs left in /dev/shm (memory,
    # until a restart), and none that a live process still maps. A job killed with
    # SIGKILL leaves MPICH's; a file this process maps stands for a live job's.
    before = mpi_segments()
    killed = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-c",
         "import os, signal; from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); "
         "os.kill(os.getpid(), signal.SIGKILL)"],
        capture_output=True, text=True, timeout=120, env=job_env())
    assert killed.returncode != 0, killed
    live_name = f"mpich_shm_ringreduce_test_{os.getpid()}"
    with open(os.path.join(SHM, live_name), "w+b") as live:
        live.truncate(4096)
        with mmap.mmap(live.fileno(), 4096) as mapped:
            mapped[0] = 1
            left = mpi_segments() - before
            removed = remove_mpi_segments_left(before)
            assert live_name in left and live_name not in removed, (left, removed)
            assert os.path.exists(os.path.join(SHM, live_name))
    os.unlink(os.path.join(SHM, live_name))
    killed_left = left - {live_name}
    if not killed_left:
        pytest.skip("the killed job left no shared memory of MPI's here (this MPI, or its "
                    "mpiexec, removed it)")
    assert sorted(killed_left) == removed, (killed_left, removed)
    assert not killed_left & mpi_segments()


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


def test_bootstrap_finds_the_mpiexec_of_the_mpi_that_mpicc_names(tmp_path):
    # scripts/mpiexec_for.sh, which bootstrap.sh asks for the launcher it links as
    # .venv/bin/mpiexec under MPICC. Debian's layout with MPICH and Open MPI both
    # installed: /usr/bin/mpicc and /usr/bin/mpiexec are alternatives of their own, here
    # MPICH's mpicc beside Open MPI's mpiexec, whose ranks would each be a job of one.
    from launch import ROOT
    usr, alt, opt = (tmp_path / d for d in ("bin", "alternatives", "opt"))
    for folder in (usr, alt, opt):
        folder.mkdir()
    for name in ("mpicc.mpich", "mpiexec.hydra", "opal_wrapper", "orterun", "gcc"):
        (usr / name).write_text("#!/bin/sh\n")
        (usr / name).chmod(0o755)
    for link, target in [("bin/mpiexec.mpich", "mpiexec.hydra"),  # relative, as Debian's
                         ("bin/mpicc.openmpi", str(usr / "opal_wrapper")),
                         ("bin/mpiexec.openmpi", "orterun"),
                         ("alternatives/mpi", str(usr / "mpicc.mpich")),
                         ("alternatives/mpirun", str(usr / "mpiexec.openmpi")),
                         ("bin/mpicc", str(alt / "mpi")),
                         ("bin/mpiexec", str(alt / "mpirun")),
                         ("opt/mpicc", str(usr / "gcc")),
                         ("opt/mpiexec", str(usr / "orterun"))]:
        (tmp_path / link).symlink_to(target)

    def launcher(mpicc):
        done = subprocess.run(["bash", str(ROOT / "scripts" / "mpiexec_for.sh"), mpicc],
                              capture_output=True, text=True,
                              env={**os.environ, "PATH": f"{usr}{os.pathsep}/usr/bin:/bin"})
        return done.stdout.strip() if done.returncode == 0 else None

    assert launcher(str(usr / "mpicc")) == str(usr / "mpiexec.mpich")
    assert launcher("mpicc") == str(usr / "mpiexec.mpich")  # a name on PATH
    assert launcher(str(usr / "mpicc.mpich")) == str(usr / "mpiexec.mpich")
    assert launcher(str(usr / "mpicc.openmpi")) == str(usr / "mpiexec.openmpi")
    assert launcher(str(opt / "mpicc")) == str(opt / "mpiexec")  # one MPI in a prefix
    assert launcher(str(usr / "gcc")) is None
    assert launcher(str(tmp_path / "missing")) is None
