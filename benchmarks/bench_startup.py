"""What ringreduce costs a short job before its first useful byte moves and after its
last, beside mpi4py alone doing the same, in fresh jobs launched one after another:

    python benchmarks/bench_startup.py --ranks 2 --jobs 9 --json out.json

(not under mpiexec: it starts the jobs itself, alternately a ringreduce job and a peer
job). Each job, on every rank: import numpy and mpi4py (MPI_Init); `import ringreduce`
(the peer: nothing); make the communicator (`rr.Communicator(COMM_WORLD)`, against
`COMM_WORLD.Dup()`); a first 8-byte allreduce with out= (against `Allreduce`), and the
median of the next 20; a 1 MiB allreduce's first 13 calls together (ringreduce's wire
tuner tries each way a size can travel in a size's first 12, docs/performance.md) and
the median of the next 10; `close()` (against `Free()`); then the process ends (atexit,
MPI_Finalize). A barrier stands between the phases; each phase counts the slowest rank's
time, and the table gives its median over the jobs of each kind. "exit" runs from the
script's last line to mpiexec's return; "whole job" is mpiexec's wall time. Where
ringreduce's bytecode is not cached (PYTHONDONTWRITEBYTECODE in a source checkout), its
import compiles it every time: the run says so.
"""
from __future__ import annotations

import json
import os
import sys
import time

SMALL_CALLS, LEARNING_CALLS, BIG_CALLS = 20, 13, 10
MIB = 1 << 20


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _shared_memory_kib() -> int:
    """KiB of ringreduce's shared-memory files this process has mapped (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            spans = [line.split()[0] for line in f if "memfd:ringreduce" in line]
    except OSError:
        return -1
    return sum(int(b, 16) - int(a, 16) for a, b in (s.split("-") for s in spans)) // 1024


def run_job(mode: str, folder: str) -> None:
    """One rank of one job: its phases' times into folder/<rank>.json."""
    out = {}
    start = time.perf_counter()
    import numpy as np
    from mpi4py import MPI
    out["mpi_init_s"] = time.perf_counter() - start
    world = MPI.COMM_WORLD
    threads_before = _threads()
    world.Barrier()
    if mode == "ringreduce":
        start = time.perf_counter()
        import ringreduce as rr
        out["import_s"] = time.perf_counter() - start
    else:
        out["import_s"] = 0.0
    world.Barrier()
    start = time.perf_counter()
    comm = rr.Communicator(world) if mode == "ringreduce" else world.Dup()
    out["make_s"] = time.perf_counter() - start
    shared_kib = _shared_memory_kib()

    def call(x, y):
        if mode == "ringreduce":
            comm.allreduce(x, out=y)
        else:
            comm.Allreduce(x, y)

    def timed(x, y, calls: int) -> list:
        times = []
        for _ in range(calls):
            begun = time.perf_counter()
            call(x, y)
            times.append(time.perf_counter() - begun)
        return times

    x, y = np.ones(1), np.empty(1)
    world.Barrier()
    out["first_call_s"] = timed(x, y, 1)[0]
    out["small_call_s"] = sorted(timed(x, y, SMALL_CALLS))[SMALL_CALLS // 2]
    x, y = np.ones(MIB // 8), np.empty(MIB // 8)
    y.fill(0)  # (its pages touched: first-touch faults are not the tuner's)
    world.Barrier()
    out["learning_1MiB_s"] = sum(timed(x, y, LEARNING_CALLS))
    out["call_1MiB_s"] = sorted(timed(x, y, BIG_CALLS))[BIG_CALLS // 2]
    threads_after = _threads()
    world.Barrier()
    start = time.perf_counter()
    comm.close() if mode == "ringreduce" else comm.Free()
    out["close_s"] = time.perf_counter() - start
    world.Barrier()
    out.update(shared_memory_kib=shared_kib, threads_before=threads_before,
               threads_after_calls=threads_after, end=time.time())
    with open(os.path.join(folder, f"{world.Get_rank()}.json"), "w") as f:
        json.dump(out, f)


PHASES = [("import_s", "import ringreduce"), ("make_s", "make the communicator"),
          ("first_call_s", "first 8 B allreduce"), ("small_call_s", "a later 8 B allreduce"),
          ("learning_1MiB_s", f"first {LEARNING_CALLS} allreduces of 1 MiB"),
          ("call_1MiB_s", "a later 1 MiB allreduce"), ("close_s", "close / Free"),
          ("exit_s", "exit (atexit, MPI_Finalize, mpiexec)"), ("job_s", "whole job"),
          ("mpi_init_s", "(import numpy, mpi4py: MPI_Init)")]
KINDS = ("ringreduce", "mpi4py")


def launch(mpiexec: str, ranks: int, kind: str, timeout: float) -> dict:
    """One job of `kind`: per phase, the slowest rank's seconds, and what rank 0 saw."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench_startup_") as folder:
        begun = time.time()
        done = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, os.path.abspath(__file__),
                               "--job", kind, folder], capture_output=True, text=True,
                              timeout=timeout, env=dict(os.environ))
        ended = time.time()
        rows = []
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name)) as f:
                rows.append(json.load(f))
    if done.returncode != 0 or len(rows) != ranks:
        raise SystemExit(f"a {kind} job failed (exit status {done.returncode}, {len(rows)} of "
                         f"{ranks} ranks finished):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    job = {key: max(row[key] for row in rows) for key in rows[0] if key.endswith("_s")}
    job["exit_s"] = ended - max(row["end"] for row in rows)
    job["job_s"] = ended - begun
    for key in ("shared_memory_kib", "threads_before", "threads_after_calls"):
        job[key] = rows[0][key]
    return job


def bytecode_cached() -> bool:
    import importlib.util

    import ringreduce.communicator as module
    return os.path.exists(importlib.util.cache_from_source(module.__file__))


def main() -> None:
    import argparse
    import statistics

    import mpi4py
    mpi4py.rc.initialize = False  # (this process only starts jobs: no MPI of its own)
    mpi4py.rc.finalize = False
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from timing import at_least, human_time, markdown_table, output_file, write_json

    from ringreduce._mpi_check import mpiexec_beside_python

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Prints one table. The default takes about 10 s on 2 ranks of the "
               "development machine.")
    parser.add_argument("--ranks", type=at_least(1), default=2,
                        help="ranks per job (default: 2)")
    parser.add_argument("--jobs", type=at_least(1), default=9,
                        help="jobs of each kind; medians over them are reported (default: 9)")
    parser.add_argument("--mpiexec", help="the launcher (default: the mpiexec beside this "
                        "python, else PATH's)")
    parser.add_argument("--json", type=output_file(), help="write every job's phases here")
    args = parser.parse_args()
    mpiexec = args.mpiexec or mpiexec_beside_python(or_on_path=True)
    if not mpiexec:
        parser.error("no mpiexec beside this python or on PATH: name one with --mpiexec")
    for kind in KINDS:  # (not counted: files into the page cache, bytecode written)
        launch(mpiexec, args.ranks, kind, timeout=120)
    jobs = {kind: [] for kind in KINDS}
    for run in range(args.jobs):
        for kind in (KINDS if run % 2 == 0 else KINDS[::-1]):
            jobs[kind].append(launch(mpiexec, args.ranks, kind, timeout=120))
    medians = {kind: {key: statistics.median(job[key] for job in jobs[kind])
                      for key, _ in PHASES} for kind in KINDS}
    cached = bytecode_cached()
    print(f"# {args.ranks} rank{'s' if args.ranks > 1 else ''}, median of {args.jobs} jobs of each kind (each phase: the "
          "slowest rank)" + ("" if cached else "; ringreduce's bytecode is not cached, so "
                             "its import compiles it"))
    rows = []
    for key, label in PHASES:
        ours, theirs = medians["ringreduce"][key], medians["mpi4py"][key]
        rows.append([label, human_time(ours), human_time(theirs) if theirs else "-",
                     f"{(ours - theirs) * 1e3:+.2f} ms"])
    print(markdown_table(["phase", "ringreduce", "mpi4py alone", "difference"], rows))
    first = jobs["ringreduce"][0]
    print(f"\nringreduce: {first['shared_memory_kib']} KiB of shared memory mapped per rank; "
          f"threads per process {first['threads_before']} before, "
          f"{first['threads_after_calls']} after its blocking calls")
    if args.json:
        write_json(args.json, ranks=args.ranks, jobs=args.jobs, bytecode_cached=cached,
                   medians=medians, results=[{"kind": kind, **job} for kind in KINDS
                                             for job in jobs[kind]])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job"]:
        run_job(sys.argv[2], sys.argv[3])
    else:
        main()
