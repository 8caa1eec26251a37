"""ringreduce refuses to load beside an mpi4py of another MPI, and says why, instead of
crashing at its first call; and building or importing it where that cannot work says
what to do."""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
from mpi4py import MPI

import ringreduce as rr
from launch import ROOT, job_env
from ringreduce import _core
from ringreduce._mpi_check import (check_same_mpi, first_line, loaded_mpi_library,
                                   mpiexec_of_loaded_mpi, rebuild_hint)

OPEN_MPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4"
MPICH = "MPICH Version:      5.0.2\nMPICH Release date: ..."
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS"  # (MPICH's ABI)


@pytest.mark.parametrize("built, loaded, comm_bytes", [
    (("MPICH", 4), OPEN_MPI, 8),     # the crash helper 129 found: a segfault at the first call
    (("Open MPI", 8), MPICH, 4),
    (("MPICH", 4), INTEL, 8),        # same family by name, another handle: still refused
])
def test_a_core_built_for_another_mpi_is_refused_before_any_mpi_call(built, loaded, comm_bytes):
    called = []
    with pytest.raises(ImportError, match=r"built for another MPI than the one mpi4py loaded"
                                          r"(.|\n)*--force-reinstall") as refused:
        check_same_mpi(built, loaded, comm_bytes, lambda: called.append(1) or loaded)
    assert not called  # (the core's own MPI call, on a library of another ABI, would crash)
    # (helper 244) The other way too: a system MPI meant, and PyPI's mpi4py wheel loaded
    # another; the hint said only to rebuild ringreduce for the MPI mpi4py found.
    assert "\nOr, where ringreduce's MPI is the one you meant, rebuild mpi4py with its " \
           "mpicc: `MPICC=/path/to/that/mpicc pip install --force-reinstall --no-cache-dir " \
           "--no-binary=mpi4py mpi4py`" in str(refused.value)


@pytest.mark.parametrize("built, loaded, comm_bytes", [
    (("MPICH", 4), MPICH, 4), (("MPICH", 4), INTEL, 4), (("Open MPI", 8), OPEN_MPI, 8),
    (("other", 8), OPEN_MPI, 8), (("MPICH", 4), MPICH, None)])
def test_a_core_built_for_the_loaded_mpis_abi_passes(built, loaded, comm_bytes):
    check_same_mpi(built, loaded, comm_bytes, lambda: loaded)
    with pytest.raises(ImportError, match="built against a different MPI"):  # (as before)
        check_same_mpi(built, loaded, comm_bytes, lambda: loaded + " (another build)")


def test_the_rebuild_hint_names_the_mpicc_of_the_loaded_mpi(tmp_path, monkeypatch):
    # (From a review: "MPICC=/path/to/mpicc" left the user to find it.) Beside the
    # library, as an mpich wheel lays out a venv; else Debian's name for the family's.
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "bin").mkdir()
    library = tmp_path / "venv" / "lib" / "libmpi.so.12"
    library.write_bytes(b"")
    mpicc = tmp_path / "venv" / "bin" / "mpicc"
    mpicc.write_text("#!/bin/sh\n")
    mpicc.chmod(0o755)
    maps = (f"7f0000-7f1000 r-xp 00000000 08:01 12 {tmp_path}/lib/libc.so.6\n"
            f"7f2000-7f3000 r-xp 00000000 08:01 13 {library}\n")
    assert loaded_mpi_library(maps) == str(library)
    hint = rebuild_hint(MPICH, maps)
    assert f"of mpi4py's MPI ({library}): `MPICC={mpicc} pip install" in hint
    # A core built against the other family has its library mapped too, first (from
    # a review): mpi4py's is the one of the family it reports.
    both = ("7f0000-7f1000 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libmpi.so.40.30.4\n"
            + maps)
    assert f"of mpi4py's MPI ({library}): `MPICC={mpicc} pip install" in rebuild_hint(MPICH, both)
    assert loaded_mpi_library(both, "Open MPI").endswith("libmpi.so.40.30.4")
    debian = tmp_path / "debian"
    debian.mkdir()
    for name in ("mpicc.mpich", "mpicc.openmpi"):
        (debian / name).write_text("#!/bin/sh\n")
        (debian / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(debian))
    elsewhere = ("7f2000-7f3000 r-xp 00000000 08:01 13 "
                 "/usr/lib/x86_64-linux-gnu/nowhere/libmpi.so.40\n")
    assert f"`MPICC={debian}/mpicc.openmpi pip" in rebuild_hint(OPEN_MPI, elsewhere)
    assert f"`MPICC={debian}/mpicc.mpich pip" in rebuild_hint(MPICH, elsewhere)
    assert "`MPICC=/path/to/mpicc pip" in rebuild_hint(MPICH, "")  # (nothing to go on)
    # Intel MPI's layout: intel64/lib/release/libmpi.so.12, intel64/bin/mpicc.
    intel = tmp_path / "intel64"
    (intel / "lib" / "release").mkdir(parents=True)
    (intel / "bin").mkdir()
    (intel / "bin" / "mpicc").write_text("#!/bin/sh\n")
    (intel / "bin" / "mpicc").chmod(0o755)
    there = f"7f2000-7f3000 r-xp 00000000 08:01 13 {intel}/lib/release/libmpi.so.12\n"
    assert f"`MPICC={intel}/bin/mpicc pip" in rebuild_hint(INTEL, there)
    # This process: mpi4py's library, which is loaded, named.
    if sys.platform.startswith("linux"):
        assert os.path.basename(loaded_mpi_library() or "").startswith(("libmpi", "libmpich"))


def test_this_build_says_what_it_was_built_for():
    family, comm_bytes = _core.mpi_built_for()
    assert comm_bytes == MPI._sizeof(MPI.Comm)
    assert family == ("Open MPI" if MPI.get_vendor()[0] == "Open MPI" else "MPICH")
    assert rr.Communicator is not None  # (and it imported: the check passed)


def _copy_without_core(tmp_path):
    """The package's Python files in tmp_path/ringreduce, without the built extension."""
    shutil.copytree(ROOT / "ringreduce", tmp_path / "ringreduce",
                    ignore=shutil.ignore_patterns("_core*", "__pycache__"))


def _import_fails(tmp_path) -> str:
    """What importing the copy in tmp_path said (it must fail), past the editable
    install's finder, which would find this checkout's extension."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
            "import ringreduce")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    return done.stderr


def test_importing_the_source_tree_before_a_build_says_so(tmp_path):
    # "cannot import name '_core' from partially initialized module 'ringreduce' (most
    # likely due to a circular import)" was all it said.
    _copy_without_core(tmp_path)
    stderr = _import_fails(tmp_path)
    assert (f"ringreduce._core is not built in {tmp_path / 'ringreduce'} (is this the source "
            "tree, before a build?)") in stderr, stderr


def test_a_built_core_that_cannot_load_says_so_and_how_to_rebuild(tmp_path):
    # As when the libmpi it was linked against is gone: "not built" would be wrong, and
    # the loader's words alone do not say what to do.
    _copy_without_core(tmp_path)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    (tmp_path / "gone.c").write_text("int gone(void) { return 1; }\n")
    (tmp_path / "core.c").write_text("int gone(void);\nint PyInit__core(void) { return gone(); }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", tmp_path / "libgone.so",
                    tmp_path / "gone.c"], check=True, timeout=60)
    core = tmp_path / "ringreduce" / ("_core" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([compiler, "-shared", "-fPIC", "-o", core, tmp_path / "core.c",
                    f"-L{tmp_path}", "-lgone"], check=True, timeout=60)
    (tmp_path / "libgone.so").unlink()
    stderr = _import_fails(tmp_path)
    assert ("ImportError: ringreduce._core is built but cannot load: libgone.so: cannot open "
            "shared object file") in stderr, stderr
    assert f"mpi4py loaded: {first_line(MPI.Get_library_version())}" in stderr
    assert "Rebuild ringreduce with the mpicc of mpi4py's MPI" in stderr
    assert "not built" not in stderr


def _failed_build(tmp_path, **environ) -> str:
    """What a build of the extension (into tmp_path) with these variables said, once it
    failed, as it must."""
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib",
                           str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **environ))
    assert done.returncode != 0
    return done.stdout + done.stderr


def test_an_mpicc_that_does_not_exist_stops_the_build(tmp_path):
    # It was passed over for the next candidate: a build against another MPI than asked.
    assert "ringreduce: MPICC=/no/such/mpicc: no such executable" in _failed_build(
        tmp_path, MPICC="/no/such/mpicc")


def test_no_cpp_compiler_stops_the_build_saying_so(tmp_path):
    # With nvcc present it said only "nvcc fatal: Failed to preprocess host compiler
    # properties"; without, setuptools' "No such file or directory".
    assert "ringreduce: no C++ compiler: /no/such/gcc was not found" in _failed_build(
        tmp_path, CC="/no/such/gcc", CXX="/no/such/g++")


def test_gcc_without_g_plus_plus_stops_the_build_saying_so(tmp_path):
    # (From a review.) Only the compiler of compiler_so was looked for (gcc, CC's): with
    # g++ missing, the build failed at the first C++ file or at the link, in a traceback.
    assert "ringreduce: no C++ compiler: /no/such/g++ was not found" in _failed_build(
        tmp_path, CXX="/no/such/g++")


def test_bootstrap_stops_at_once_on_an_mpicc_that_does_not_exist(tmp_path):
    # (From a review.) It uninstalled the wheel's MPICH and mpi4py, built mpi4py for
    # nothing for two minutes, and left a .venv that no longer imported ringreduce.
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    done = subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, MPICC="/no/such/mpicc"))
    assert done.returncode == 1
    assert "bootstrap: MPICC=/no/such/mpicc: no such executable" in done.stderr, done.stderr
    assert not (tmp_path / ".venv").exists()


def test_bootstrap_keeps_the_mpi_chosen_before_until_mpicc_names_another(tmp_path):
    # (From a review.) A run without MPICC (scripts/test.sh, scripts/demo.sh) swapped a
    # system MPI's .venv for the wheel's, and going back cost a new build of mpi4py.
    # Here the MPI chosen before is one that has gone since, so that bootstrap.sh
    # stops at once, having said which it took; and a .venv whose python fails, so
    # that MPICC=wheel stops at its first step, having said which MPI it installs.
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / ".ringreduce-deps").write_text("mpi=/gone/mpicc numpy\nmpi4py\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 3\n")
    python.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k != "MPICC"}

    def bootstrap(**extra):
        return subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=tmp_path, text=True,
                              capture_output=True, timeout=60, env=dict(environ, **extra))

    kept = bootstrap()
    assert kept.returncode == 1
    assert "bootstrap: keeping .venv's MPI, MPICC=/gone/mpicc" in kept.stdout, kept
    assert "bootstrap: MPICC=/gone/mpicc: no such executable" in kept.stderr, kept
    wheel = bootstrap(MPICC="wheel")
    assert wheel.returncode != 0 and "keeping" not in wheel.stdout, wheel
    assert "installing dependencies (MPICH from PyPI)" in wheel.stdout, wheel
    # Without a choice before (a fresh clone: CI), the wheel's, without a word.
    (tmp_path / ".venv" / ".ringreduce-deps").unlink()
    fresh = bootstrap()
    assert fresh.returncode != 0 and "keeping" not in fresh.stdout, fresh
    assert "installing dependencies (MPICH from PyPI)" in fresh.stdout, fresh


@pytest.mark.parametrize("theirs", [None, "0"])
def test_demo_lets_a_system_open_mpi_oversubscribe_and_run_as_root(tmp_path, theirs):
    # (From helper 244.) Under MPICC=/usr/bin/mpicc (Open MPI), scripts/demo.sh stopped
    # at its first mpiexec: as root ("detected an attempt to run as root"), and with
    # RANKS=4 on 2 cores ("not enough slots available"), where the tests' launches pass
    # (tests/conftest.py sets the same variables). A value of the user's own stays.
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    (tmp_path / "scripts" / "bootstrap.sh").write_text("exit 0\n")  # .venv is made
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    mpiexec = tmp_path / ".venv" / "bin" / "mpiexec"
    mpiexec.write_text('#!/bin/sh\nenv | grep "^OMPI_" | sort >> "$0.env"\necho "=" >> "$0.env"\n')
    mpiexec.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    if theirs is not None:
        environ["OMPI_MCA_rmaps_base_oversubscribe"] = theirs
    done = subprocess.run(["bash", "scripts/demo.sh"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=dict(environ, RANKS="4"))
    assert done.returncode == 0, done
    launches = (tmp_path / ".venv" / "bin" / "mpiexec.env").read_text().split("=\n")[:-1]
    assert len(launches) == 2, launches  # the check and timing, then the training
    root = ["OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"]
    for launch in launches:
        assert launch.split() == sorted(
            [f"OMPI_MCA_rmaps_base_oversubscribe={theirs or 1}"]
            + (root if os.geteuid() == 0 else [])), launches


@pytest.mark.parametrize("world, environ, warned", [
    (1, {"PMI_SIZE": "4"}, "PMI_SIZE=4"),                # another MPI's Hydra
    (1, {"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE=2"),  # Open MPI's mpirun
    (1, {"PMI_SIZE": "1"}, None),                        # mpiexec -n 1
    (1, {}, None),                                       # plain python: a singleton
    (1, {"PMI_SIZE": "x"}, None),
    (4, {"PMI_SIZE": "4"}, None),                        # the right mpiexec
])
def test_a_singleton_that_the_launcher_says_is_one_of_several_is_warned(world, environ,
                                                                      warned):
    from ringreduce._mpi_check import warn_if_alone_by_mistake
    said = []
    warn_if_alone_by_mistake(world, environ, said.append)
    assert (said == []) if warned is None else (len(said) == 1 and warned in said[0]
                                                and "every process runs alone" in said[0])
    # It names the launcher of mpi4py's MPI, where there is one beside its mpicc (from a
    # review: Debian's MPICH is started by mpiexec.mpich, not the mpiexec on PATH).
    right = mpiexec_of_loaded_mpi(MPI.Get_library_version())
    if warned is not None and right is not None:
        assert said[0].endswith(f"start the job with that MPI's mpiexec ({right})"), said


@pytest.mark.skipif(not os.path.exists("/usr/lib/x86_64-linux-gnu/libmpich.so.12"),
                    reason="needs a second MPICH library to load")
def test_a_library_loaded_after_the_import_does_not_pass_for_mpi4pys():
    # (From a review.) A core built against another MPICH has that library mapped
    # too, once it has loaded, at a lower address: the hint named it, the very MPI the
    # core was built for. The map is read before the core loads.
    code = ("import ctypes, ringreduce\n"
            "from ringreduce._mpi_check import loaded_mpi_library\n"
            "before = loaded_mpi_library(family='MPICH')\n"
            "ctypes.CDLL('/usr/lib/x86_64-linux-gnu/libmpich.so.12')\n"
            "print(before, loaded_mpi_library(family='MPICH'), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=job_env())
    before, after = done.stdout.split()
    assert before == after != "/usr/lib/x86_64-linux-gnu/libmpich.so.12", done.stdout


def test_the_launcher_of_the_loaded_mpi_is_found_beside_its_mpicc(tmp_path, monkeypatch):
    for name in ("mpicc.mpich", "mpiexec.mpich", "mpicc.openmpi"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    maps = "7f2000-7f3000 r-xp 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/nowhere/libmpich.so.12\n"
    assert mpiexec_of_loaded_mpi(MPICH, maps) == str(tmp_path / "mpiexec.mpich")
    assert mpiexec_of_loaded_mpi(OPEN_MPI, maps) is None  # (no mpiexec.openmpi beside it)
    assert mpiexec_of_loaded_mpi(MPICH, "") is None
    library = loaded_mpi_library() or ""
    if os.path.realpath(library).startswith(os.path.realpath(sys.prefix) + os.sep):
        # (This venv's mpich wheel: its lib/libmpi.so.12 and bin/mpiexec.)
        assert mpiexec_of_loaded_mpi(MPI.Get_library_version()) == os.path.join(
            os.path.realpath(sys.prefix), "bin", "mpiexec")


def test_the_warning_comes_once_from_the_first_communicator(tmp_path):
    # A job started by another MPI's mpiexec: p singletons, each training alone, silently
    # (mpi4py 4.1 warns of a "suspicious MPI execution environment"; older ones do not).
    code = ("import warnings, numpy as np, ringreduce as rr\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    for _ in range(2):\n"
            "        with rr.Communicator() as comm:\n"
            "            comm.allreduce(np.ones(2))\n"
            "print(sum('every process runs alone' in str(w.message) for w in seen))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "PMIX"))}
    # (The other MPI's launcher's variable: this MPI's own would start it as launched.)
    other = "PMI_SIZE" if MPI.get_vendor()[0] == "Open MPI" else "OMPI_COMM_WORLD_SIZE"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(env, **{other: "3"}), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "1"
