"""The core built with AddressSanitizer and UndefinedBehaviorSanitizer (docs/development.md,
"Sanitizers"), running the kernels' tests in one process and two MPI modules on 3 ranks:
undefined behaviour that x86 forgives, and the plain build's tests cannot see (a float
read at an odd address, say: test_kernels_take_arrays_at_any_address), stops the run
here; and with ThreadSanitizer, the call queue's tests and Communicators of one process
giving up on several threads at once. Each copy is built apart, in a temporary folder,
and leaves the tested build alone. Skipped where gcc has no sanitizer runtime to preload."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ROOT, job_env, mpiexec


def runtime(library: str) -> str | None:
    """The path of gcc's `library` (libasan.so, libubsan.so), if it has one."""
    if shutil.which("gcc") is None:
        return None
    path = subprocess.run(["gcc", f"-print-file-name={library}"], capture_output=True,
                          text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def built_with(sanitize: str, tmp_path_factory) -> Path:
    """A folder holding the package built with RINGREDUCE_SANITIZE=sanitize, and tests/
    beside it."""
    build = tmp_path_factory.mktemp(f"sanitized-{sanitize}")
    for part in ("setup.py", "pyproject.toml", "csrc", "ringreduce", "tests"):
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, build / part,
                            ignore=shutil.ignore_patterns("__pycache__", "_core*.so"))
        else:
            shutil.copy(source, build / part)
    # CUDA off: nvcc's minutes buy nothing here, where no GPU code runs.
    made = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                          cwd=build, capture_output=True, text=True, timeout=1800,
                          env=job_env({"RINGREDUCE_SANITIZE": sanitize,
                                       "RINGREDUCE_CUDA": "0"}))
    assert made.returncode == 0, made.stderr[-4000:]
    return build


def imports_its_own(build: Path, env: dict) -> None:
    found = subprocess.run([sys.executable, "-c", "import ringreduce; print(ringreduce.__file__)"],
                           cwd=build, capture_output=True, text=True, env=env, timeout=120)
    assert found.stdout.strip() == str(build / "ringreduce" / "__init__.py"), \
        (found.stdout, found.stderr[-2000:])


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory):
    """The package built with ASan and UBSan (see built_with), and the environment that
    runs it (the runtimes preloaded: Python is not instrumented)."""
    preload = [runtime("libasan.so"), runtime("libubsan.so")]
    if None in preload:
        pytest.skip("gcc has no AddressSanitizer or UndefinedBehaviorSanitizer runtime")
    build = built_with("address", tmp_path_factory)
    env = job_env({
        "PYTHONPATH": str(build),  # (before the installed ringreduce)
        "LD_PRELOAD": ":".join(preload),
        # Python leaks by design; tests that ask numpy for impossible arrays expect its
        # MemoryError, which the sanitizer's allocator would turn into an abort.
        "ASAN_OPTIONS": "detect_leaks=0:allocator_may_return_null=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    })
    imports_its_own(build, env)
    return build, env


@pytest.fixture(scope="module")
def thread_sanitized(tmp_path_factory):
    """The package built with TSan, and the environment that runs it, as
    docs/development.md sets it up: libtsan preloaded, then scripts/tsan_clocklock.c,
    without which GCC 12's TSan misses a lock that libstdc++ takes; and the `mpich`
    wheel's UCX kept from hooking madvise, where every thread that ends would crash."""
    tsan = runtime("libtsan.so")
    if tsan is None:
        pytest.skip("gcc has no ThreadSanitizer runtime")
    build = built_with("thread", tmp_path_factory)
    shim = build / "clocklock.so"
    made = subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(shim),
                           str(ROOT / "scripts" / "tsan_clocklock.c"), "-ldl"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-4000:]
    env = job_env({
        "PYTHONPATH": str(build),
        "LD_PRELOAD": f"{tsan}:{shim}",
        # (exitcode=0: a report counts where ours_in() finds the core in it, not
        # otherwise; Open MPI's PMIx library races on its own threads under TSan.)
        "TSAN_OPTIONS": "allocator_may_return_null=1 report_signal_unsafe=0 exitcode=0",
        "UCX_MEM_EVENTS": "no",
    })
    imports_its_own(build, env)
    return build, env


def ours_in(stderr: str) -> list:
    """The reports of ThreadSanitizer with the core in their stacks: races of ringreduce,
    not of an MPI library's own threads (which are not instrumented, and not ours)."""
    reports = stderr.split("==================\n")
    return [report for report in reports if "WARNING: ThreadSanitizer" in report and
            ("csrc/" in report or "ringreduce::" in report)]


def races(done) -> str:
    """The core's reports (see ours_in), or else the end of the output."""
    return "\n".join(ours_in(done.stderr))[:6000] or done.stdout[-3000:] + done.stderr[-3000:]


def reports(done) -> str:
    """What the sanitizers said, or else the end of the output."""
    said = [line for line in done.stderr.splitlines()
            if "runtime error" in line or "ERROR: AddressSanitizer" in line]
    return "\n".join(said[:20]) or done.stdout[-3000:] + done.stderr[-3000:]


def test_the_kernels_under_the_sanitizers(sanitized):
    build, env = sanitized
    # -s: a report goes to stderr, which pytest shows only for a failing test, and
    # halt_on_error ends the process before it could.
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           "tests/test_kernels.py"], cwd=build, capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, reports(done)
    assert "runtime error" not in done.stderr and "AddressSanitizer" not in done.stderr, \
        reports(done)


def test_the_ring_under_the_sanitizers_on_3_ranks(sanitized):
    build, env = sanitized
    done = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-m", "mpi4py", "-m", "pytest",
                           "-q", "-s", "-p", "no:cacheprovider", "test_collectives.py",
                           "test_allreduce.py"], cwd=build / "tests" / "mpi",
                          capture_output=True, text=True, timeout=900,
                          env={**env, "RINGREDUCE_TIMEOUT": "120"})
    assert done.returncode == 0, reports(done)
    assert "runtime error" not in done.stderr and "AddressSanitizer" not in done.stderr, \
        reports(done)


def test_the_call_queue_under_thread_sanitizer(thread_sanitized):
    build, env = thread_sanitized
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           "tests/test_call_queue.py"], cwd=build, capture_output=True,
                          text=True, env=env, timeout=900)
    assert done.returncode == 0 and not ours_in(done.stderr), races(done)


def test_communicators_giving_up_on_threads_at_once_under_thread_sanitizer(thread_sanitized):
    build, env = thread_sanitized
    done = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py",
                           "tsan_giving_up_at_once.py"], cwd=build / "tests" / "mpi",
                          capture_output=True, text=True, timeout=300,
                          env={**env, "RINGREDUCE_SHM": "0"})
    assert done.returncode == 0 and not ours_in(done.stderr), races(done)
    assert "rank 0: all 6 calls gave up" in done.stdout, races(done)


@pytest.mark.parametrize("shm", ["0", "1"])
def test_settings_and_counters_touched_while_a_call_runs_under_thread_sanitizer(
        thread_sanitized, shm):
    build, env = thread_sanitized
    done = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py",
                           "tsan_settings_while_a_call_runs.py"], cwd=build / "tests" / "mpi",
                          capture_output=True, text=True, timeout=300,
                          env={**env, "RINGREDUCE_SHM": shm})
    assert done.returncode == 0 and not ours_in(done.stderr), races(done)
    assert "rank 0: settings and counters touched while calls ran" in done.stdout, races(done)
