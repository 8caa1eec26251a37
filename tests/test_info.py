"""python -m ringreduce info: in this process, and under mpiexec (the ring, and ranks
whose installation differs)."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import ringreduce as rr
from ringreduce import _core, _mpi_check, info
from ringreduce._mpi_check import loaded_family

from launch import job_env, mpiexec, run_script


def fake_launcher(tmp_path, name, script):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("output, family", [
    ("HYDRA build details:\n    Version:                                 5.0.2\n",
     "MPICH (Hydra 5.0.2)"),
    ("mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n",
     "Open MPI 4.1.4"),
    ("mpirun (Open MPI) 5.0.3\n", "Open MPI 5.0.3"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n"
     "HYDRA build details:\n", "Intel MPI (MPICH's ABI)"),
    ("srun: unrecognized option '--version'\n", "unknown (srun: unrecognized option"),
])
def test_the_launchers_family_is_read_from_its_version(tmp_path, output, family):
    path = fake_launcher(tmp_path, "mpiexec", f"printf '%s' '{output}'")
    assert info.launcher_family(path).startswith(family)


def test_a_launcher_that_hangs_or_is_missing_is_unknown_not_a_hang(tmp_path):
    slow = fake_launcher(tmp_path, "slow", "sleep 30")
    assert info.launcher_family(slow, timeout=0.5) == "unknown (TimeoutExpired)"
    assert info.launcher_family(str(tmp_path / "missing")).startswith("unknown (")


def test_the_mpiexec_beside_python_comes_before_paths(tmp_path, monkeypatch):
    # _mpi_check.mpiexec_beside_python finds it for `python -m ringreduce info`,
    # tests/launch.py and benchmarks/bench_startup.py: an executable file named mpiexec
    # in sys.executable's folder, else (where asked) PATH's. info lists PATH's as well,
    # where it is another file.
    venv, system = tmp_path / "venv" / "bin", tmp_path / "usr" / "bin"
    venv.mkdir(parents=True)
    system.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", str(system))
    monkeypatch.delenv("RINGREDUCE_MPIEXEC", raising=False)
    assert _mpi_check.mpiexec_beside_python(or_on_path=True) is None
    assert info._launchers() == []
    with pytest.raises(RuntimeError, match="mpiexec not found"):
        mpiexec()
    on_path = fake_launcher(system, "mpiexec", "true")
    assert _mpi_check.mpiexec_beside_python() is None
    assert _mpi_check.mpiexec_beside_python(or_on_path=True) == on_path == mpiexec()
    (venv / "mpiexec").write_text("not a program")  # (not executable: passed over)
    assert _mpi_check.mpiexec_beside_python(or_on_path=True) == on_path
    assert info._launchers() == [("on PATH", on_path)]
    beside = fake_launcher(venv, "mpiexec", "true")
    assert _mpi_check.mpiexec_beside_python() == beside == mpiexec()
    assert info._launchers() == [("beside this Python", beside), ("on PATH", on_path)]
    monkeypatch.setenv("PATH", f"{venv}{os.pathsep}{system}")  # (an activated venv)
    assert info._launchers() == [("beside this Python", beside)]


def test_the_tests_own_mpiexec_is_mpi4pys_mpi():
    family = info.launcher_family(mpiexec())
    assert family.startswith(loaded_family(MPI.Get_library_version()))


def test_installation_names_what_runs_here(monkeypatch):
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "77")
    values = info.installation()
    assert values["ringreduce"].startswith(rr.__version__ + " in ")
    assert values["numpy"] == np.__version__
    assert values["MPI"].startswith(" ".join(MPI.Get_library_version().split()[:3]))
    assert values["core built for"].startswith(_core.mpi_built_for()[0])
    assert values["CUDA kernels"] == ("built" if _core.cuda_built() else
                                      "not built (a CPU-only build)")
    assert values["GPUs"].startswith("none (") != rr.cuda_available()
    assert values["settings"] == "RINGREDUCE_TIMEOUT=77"
    monkeypatch.delenv("RINGREDUCE_TIMEOUT")
    assert info.installation()["settings"] == "none set (the defaults)"


def test_another_mpis_launcher_is_warned_about(tmp_path):
    other = ("mpiexec (OpenRTE) 4.1.4" if loaded_family(MPI.Get_library_version()) == "MPICH"
             else "HYDRA build details:\n    Version: 4.3.0")
    path = fake_launcher(tmp_path, "mpiexec", f"printf '%s\\n' '{other}'")
    text = info.report(MPI.COMM_SELF, launchers=[("on PATH", path)])
    assert re.search(rf"^mpiexec on PATH +{re.escape(path)}: (Open MPI 4.1.4|MPICH \(Hydra 4.3.0\))$",
                     text, re.M), text
    assert "warning: the mpiexec on PATH is another MPI's than mpi4py's" in text
    right = _mpi_check.mpiexec_of_loaded_mpi(MPI.Get_library_version())
    assert right is None or f"start jobs with {loaded_family(MPI.Get_library_version())}'s " \
        f"mpiexec, {right}" in text  # (named: from a review)
    same = info.report(MPI.COMM_SELF, launchers=[("beside this Python", mpiexec())])
    assert "warning" not in same
    assert "ring:" not in same  # (one process: no ring to show)


def test_the_command_prints_the_report_and_says_so_in_its_help():
    run = subprocess.run([sys.executable, "-m", "ringreduce", "info"], capture_output=True,
                         text=True, timeout=120, env=job_env())
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ringreduce ") and "\nmpi4py " in run.stdout
    usage = subprocess.run([sys.executable, "-m", "ringreduce", "--help"],
                           capture_output=True, text=True, timeout=120, env=job_env())
    assert "info " in usage.stdout


def test_under_mpiexec_rank_0_shows_the_ring_and_a_rank_that_differs(tmp_path):
    run = run_script(tmp_path, "info_job.py", """
import os
from mpi4py import MPI
if MPI.COMM_WORLD.Get_rank() == 2:
    os.environ["RINGREDUCE_CUDA_AWARE"] = "0"  # (read only where a GPU call is made)
from ringreduce import info
info.main([])
""", ranks=3, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.count("ringreduce ") == 1  # rank 0 alone prints
    assert "3 ranks on 1 machine: " in out
    assert "ring: 0 -> 1 -> 2 -> 0" in out
    assert "wire: " in out and "chunk: " in out
    # Through shared memory the chunk is at most a slot (it said "chunk: 262144 bytes"
    # alone, the chunk of none of the calls that go through shared memory).
    if "wire: shared memory" in out:
        assert (f"chunk: {_core.DEFAULT_CHUNK_BYTES} bytes ({_core.SHM_SLOT_BYTES} through "
                f"shared memory, a slot, which calls of up to {_core.SHM_MAX_BYTES} bytes may "
                "take); timeout: ") in out, out
    assert "  settings RINGREDUCE_CUDA_AWARE=0 on rank 2 (" in out, out
    assert "; rank 0: none set (the defaults)" in out
    assert "rank 1" not in out


def test_under_mpiexec_ranks_as_two_machines_go_round_each_in_turn(tmp_path):
    run = run_script(tmp_path, "info_job.py", "from ringreduce import info; info.main([])",
                     ranks=4, timeout=120, env={"RINGREDUCE_TEST_MACHINE": "a,b"})
    assert run.returncode == 0, run.stderr
    assert "4 ranks on 2 machines: a (2), b (2)" in run.stdout
    assert "ring: 0 -> 2 -> 1 -> 3 -> 0" in run.stdout
    assert "every rank runs the same installation" in run.stdout


def test_a_process_alone_that_the_launcher_called_one_of_four_is_warned(monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "4")  # (as another MPI's mpiexec leaves it)
    text = info.report(MPI.COMM_SELF, launchers=[])
    assert "warning: MPI_COMM_WORLD has 1 rank here, but the launcher said 4" in text
    monkeypatch.delenv("PMI_SIZE")
    assert "warning" not in info.report(MPI.COMM_SELF, launchers=[])


def test_settings_a_communicator_would_refuse_are_warned_about_on_one_process(monkeypatch):
    # (From a review.) Alone, where no Communicator is made, the report listed them as
    # if they were fine ("GPU pointers to MPI  yes (RINGREDUCE_CUDA_AWARE=2)").
    monkeypatch.setenv("RINGREDUCE_CUDA_AWARE", "2")
    monkeypatch.setenv("RINGREDUCE_SHM", "yes")  # (each one, not the first alone)
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "soon")
    text = info.report(MPI.COMM_SELF, launchers=[])
    assert ("warning: a Communicator refuses this setting: RINGREDUCE_CUDA_AWARE must be 0 "
            "(GPU buffers staged") in text, text
    assert ("warning: a Communicator refuses this setting: RINGREDUCE_TIMEOUT must be a number "
            "of seconds >= 0") in text, text
    assert "warning: a Communicator refuses this setting: RINGREDUCE_SHM must be" in text, text


def test_the_chunk_through_shared_memory_is_said_to_be_a_slot_at_most():
    # (The job above shows it where shared memory can be made; here whatever the wire.)
    everyone = [({}, "vm/boot")] * 2
    for transport, chunk, said in (
            ("shared memory", 262144, f"chunk: 262144 bytes ({_core.SHM_SLOT_BYTES} through "
                                      "shared memory, a slot, which calls of up to "
                                      f"{_core.SHM_MAX_BYTES} bytes may take); timeout: 60 s"),
            ("shared memory", _core.SHM_SLOT_BYTES,
             f"chunk: {_core.SHM_SLOT_BYTES} bytes; timeout: 60 s"),
            ("MPI", 262144, "chunk: 262144 bytes; timeout: 60 s")):
        lines = info._ring_lines(everyone, ((0, 1), transport, "", chunk, 60.0))
        assert lines[3] == said


def test_many_ranks_are_shown_short_and_grouped():
    assert info._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert info._ring_text(tuple(range(64))) == "0 -> 1 -> ... -> 63 -> 0 (rank order)"
    assert info._ring_text((0, 2, 1, 3)) == "0 -> 2 -> 1 -> 3 -> 0"
    machine_ring = tuple(range(0, 32, 2)) + tuple(range(1, 32, 2))
    assert info._ring_text(machine_ring) == (
        "0 -> 2 -> 4 -> 6 -> 8 -> 10 -> 12 -> 14 -> ... -> 25 -> 27 -> 29 -> 31 -> 0")
    base = {"numpy": "2.4.6", "mpi4py": "4.1.2"}
    everyone = [(dict(base), f"node{r // 4 + 1}/boot") for r in range(12)]
    for r in range(4, 8):  # (node2 has another numpy)
        everyone[r][0]["numpy"] = "1.26.4"
    everyone[11][0]["mpi4py"] = "3.1.6"
    lines = info._ring_lines(everyone, (tuple(range(12)), "MPI", "why", 262144, None))
    assert lines[0] == "12 ranks on 3 machines: node1 (4), node2 (4), node3 (4)"
    assert lines[3] == "chunk: 262144 bytes; timeout: none"
    assert lines[-3:] == ["ranks whose installation differs from rank 0's:",
                          "  numpy 1.26.4 on ranks 4-7 (node2); rank 0: 2.4.6",
                          "  mpi4py 3.1.6 on rank 11 (node3); rank 0: 4.1.2"]
