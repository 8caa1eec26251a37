"""Asynchronous allreduce beside its peers, timed in one run:

    mpiexec -n 2 python -m mpi4py benchmarks/bench_async.py --json out.json

One step is what a data-parallel optimizer does with its gradient buckets: start an
allreduce of each of --buckets buffers (in place), optionally with --compute-us of
Python work before each start (the backward pass producing the next bucket, holding
the GIL as pure-Python code does), then wait for them all (--wait-each: wait for each
one at once, as a caller that needs every result before it goes on; --wait-timeout:
ringreduce's waits with a timeout, as a program with a deadline of its own makes them),
and with --loss end the step with a blocking allreduce of one float (the loss, or a
metric, that a training step sums after its gradients). Timed alternately, step by
step: ringreduce's allreduce_async, ringreduce's blocking allreduce (the same work
after each compute), the MPI library's MPI_Iallreduce through mpi4py (Waitall at the
end) and torch.distributed's gloo all_reduce(async_op=True) where torch is installed.
Reported: the median time per step (the slowest rank's), and ringreduce's speedup over
MPI_Iallreduce.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from bench_allreduce import progress, sizes_argument
from timing import (at_least, human_bytes, human_time, output_file, start_gloo,
                    time_alternating, write_json)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()

DEFAULT_SIZES = [8, 4 << 10, 64 << 10, 1 << 20, 16 << 20]


def busy_python(seconds: float) -> None:
    """Pure-Python work for `seconds`: it holds the GIL throughout."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def candidates(comm, nbytes: int, buckets: int, compute_s: float, gloo,
               wait_each: bool = False, wait_timeout: float | None = None,
               loss: bool = False) -> dict:
    count = nbytes // 4  # (whole float32 elements: see sizes_argument)
    # Zeros: sums in place, step after step, stay finite.
    ours, blocking, mpi = ([np.zeros(count, np.float32) for _ in range(buckets)]
                           for _ in range(3))
    loss_value = np.zeros(1, np.float32)

    def compute():
        if compute_s > 0:
            busy_python(compute_s)

    def step(buffers, start, finish, end=lambda: None):
        """compute, then start(buffer), for each buffer; then finish(what they returned)
        (wait_each: finish([it]) for each at once); then end() (the loss's allreduce)."""
        started = []
        for b in buffers:
            compute()
            started.append(start(b))
            if wait_each:
                finish(started)
                started = []
        finish(started)
        if loss:
            end()

    def wait_all(handles):
        for h in handles:
            h.wait()

    def wait_all_ours(handles):
        for h in handles:
            h.wait(wait_timeout)

    def ours_loss():
        comm.allreduce(loss_value, out=loss_value)

    def ringreduce_async():
        step(ours, lambda b: comm.allreduce_async(b, out=b), wait_all_ours, ours_loss)

    def ringreduce_blocking():
        step(blocking, lambda b: comm.allreduce(b, out=b), lambda results: None, ours_loss)

    def mpi_iallreduce():
        step(mpi, lambda b: world.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM), MPI.Request.Waitall,
             lambda: world.Allreduce(MPI.IN_PLACE, loss_value, op=MPI.SUM))

    found = {"ringreduce async": ringreduce_async, "ringreduce blocking": ringreduce_blocking,
             "MPI_Iallreduce": mpi_iallreduce}
    if gloo is not None:
        torch, dist = gloo
        tensors = [torch.zeros(count) for _ in range(buckets)]
        loss_tensor = torch.zeros(1)
        found["gloo async"] = lambda: step(
            tensors, lambda t: dist.all_reduce(t, async_op=True), wait_all,
            lambda: dist.all_reduce(loss_tensor))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rank 0 prints the table. The defaults take about a minute on 2 ranks.")
    parser.add_argument("--sizes", help="comma-separated bytes per bucket, e.g. 8,64K,1M "
                        f"(default: {','.join(human_bytes(n).replace(' ', '') for n in DEFAULT_SIZES)})")
    parser.add_argument("--buckets", type=int, default=8, help="allreduces in flight per step "
                        "(default: 8)")
    parser.add_argument("--compute-us", type=float, default=0.0,
                        help="Python work before each start, in microseconds (default: 0)")
    parser.add_argument("--wait-each", action="store_true",
                        help="wait for each call at once instead of for all at the end")
    parser.add_argument("--wait-timeout", type=float, metavar="SECONDS",
                        help="ringreduce's waits with this timeout (which leaves the calls "
                        "to the worker thread) instead of none")
    parser.add_argument("--loss", action="store_true",
                        help="end each step with a blocking allreduce of one float32")
    parser.add_argument("--repeats", type=at_least(1), default=15,
                        help="timed runs per size; the median is reported (default: 15)")
    parser.add_argument("--no-gloo", action="store_true", help="skip torch's gloo")
    parser.add_argument("--json", type=output_file(), help="write every measurement here")
    args = parser.parse_args()
    if args.buckets < 1:
        parser.error("--buckets must be at least 1")
    if not 0 <= args.compute_us < float("inf"):
        parser.error("--compute-us must be >= 0")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.wait_timeout is not None and not 0 < args.wait_timeout < float("inf"):
        parser.error("--wait-timeout must be a positive number of seconds")
    sizes = sizes_argument(parser, args.sizes, DEFAULT_SIZES)

    comm = rr.Communicator()
    gloo = None if args.no_gloo else start_gloo()
    comm.allreduce(np.zeros(1, np.float32))  # (the FastPath serves a dtype and op seen before)
    rows = []
    for done, nbytes in enumerate(sizes):
        progress(done, len(sizes), f"{args.buckets} x {human_bytes(nbytes)}")
        steps = max(1, min(100, (16 << 20) // (nbytes * args.buckets)))
        times = time_alternating(candidates(comm, nbytes, args.buckets, args.compute_us * 1e-6,
                                            gloo, args.wait_each, args.wait_timeout,
                                            args.loss),
                                 repeats=args.repeats, inner=steps)
        for name, seconds in times.items():
            rows.append({"bytes": nbytes, "implementation": name,
                         "time_s": seconds, "speedup_vs_mpi": times["MPI_Iallreduce"] / seconds})
    progress(len(sizes), len(sizes), "done")
    if rank == 0:
        names = list(dict.fromkeys(r["implementation"] for r in rows))
        flight = ("each waited for at once" if args.wait_each
                  else "in flight per step")
        if args.wait_timeout is not None:
            flight += f" (ringreduce's waits: timeout={args.wait_timeout:g})"
        if args.loss:
            flight += ", then a blocking allreduce of one float"
        print(f"# {size} ranks, float32, {args.buckets} allreduces {flight}, "
              f"{args.compute_us:g} us of Python before each; median time per step")
        print("| bucket | " + " | ".join(names) + " | async speedup vs MPI_Iallreduce |")
        print("|---" * (len(names) + 2) + "|")
        for nbytes in dict.fromkeys(r["bytes"] for r in rows):
            mine = {r["implementation"]: r for r in rows if r["bytes"] == nbytes}
            print(f"| {human_bytes(nbytes)} | "
                  + " | ".join(human_time(mine[n]["time_s"]) for n in names)
                  + f" | {mine['ringreduce async']['speedup_vs_mpi']:.2f}x |")
        if args.json:
            write_json(args.json, ranks=size, dtype="float32", buckets=args.buckets,
                       wait_each=args.wait_each, wait_timeout=args.wait_timeout,
                       loss=args.loss, compute_us=args.compute_us, repeats=args.repeats,
                       results=rows)


if __name__ == "__main__":
    main()
