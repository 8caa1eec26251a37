"""Asynchronous allreduce (or --collective reduce_scatter, allgather, broadcast) beside
its peers, timed in one run:

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
MPI_Iallreduce. The other collectives go the same way, each against the MPI library's
own nonblocking one (MPI_Ireduce_scatter, MPI_Iallgather, MPI_Ibcast) and, for
allgather and broadcast, gloo's; a bucket is then each rank's input (reduce_scatter:
the whole buffer, of which each rank gets its block; allgather: one rank's part).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from bench_allreduce import progress, sizes_argument
from timing import (at_least, human_bytes, human_time, markdown_table, output_file,
                    start_gloo, time_alternating, write_json)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()

DEFAULT_SIZES = [8, 4 << 10, 64 << 10, 1 << 20, 16 << 20]

# Each collective's name in the MPI library, the peer its speedup is given against.
PEERS = {"allreduce": "MPI_Iallreduce", "reduce_scatter": "MPI_Ireduce_scatter",
         "allgather": "MPI_Iallgather", "broadcast": "MPI_Ibcast"}


def busy_python(seconds: float) -> None:
    """Pure-Python work for `seconds`: it holds the GIL throughout."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def calls(collective: str, comm, count: int, buckets: int):
    """For each of ringreduce async, ringreduce blocking and the MPI library: the
    buckets, each an input and an output (the input itself where the call works in
    place), and how to start a call on one (returning what to wait for)."""
    def buffers(out_count=None):  # (zeros: sums in place, step after step, stay finite)
        made = []
        for _ in range(buckets):
            x = np.zeros(count, np.float32)
            made.append((x, x if out_count is None else np.empty(out_count, np.float32)))
        return made

    if collective == "allreduce":
        return [(buffers(), lambda b: comm.allreduce_async(b[0], out=b[1])),
                (buffers(), lambda b: comm.allreduce(b[0], out=b[1])),
                (buffers(), lambda b: world.Iallreduce(MPI.IN_PLACE, b[1], op=MPI.SUM))]
    if collective == "broadcast":
        return [(buffers(), lambda b: comm.broadcast_async(b[0], root=0)),
                (buffers(), lambda b: comm.broadcast(b[0], root=0)),
                (buffers(), lambda b: world.Ibcast(b[0], root=0))]
    if collective == "reduce_scatter":
        blocks = [len(block) for block in np.array_split(np.empty(count), size)]
        return [(buffers(blocks[rank]), lambda b: comm.reduce_scatter_async(b[0], out=b[1])),
                (buffers(blocks[rank]), lambda b: comm.reduce_scatter(b[0], out=b[1])),
                (buffers(blocks[rank]),
                 lambda b: world.Ireduce_scatter(b[0], b[1], blocks, op=MPI.SUM))]
    return [(buffers(count * size), lambda b: comm.allgather_async(b[0], out=b[1])),
            (buffers(count * size), lambda b: comm.allgather(b[0], out=b[1])),
            (buffers(count * size), lambda b: world.Iallgather(b[0], b[1]))]


def gloo_call(collective: str, dist, torch, count: int):
    """gloo's asynchronous call of `collective` on one tensor (None: gloo has none)."""
    if collective == "allreduce":
        return lambda t: dist.all_reduce(t, async_op=True)
    if collective == "broadcast":
        return lambda t: dist.broadcast(t, src=0, async_op=True)
    if collective == "allgather":
        outputs = {}  # (each bucket's own)
        return lambda t: dist.all_gather(
            outputs.setdefault(id(t), [torch.zeros(count) for _ in range(size)]), t,
            async_op=True)
    return None


def candidates(comm, nbytes: int, buckets: int, compute_s: float, gloo,
               wait_each: bool = False, wait_timeout: float | None = None,
               loss: bool = False, collective: str = "allreduce") -> dict:
    count = nbytes // 4  # (whole float32 elements: see sizes_argument)
    (ours, start_ours), (blocking, start_blocking), (mpi, start_mpi) = calls(
        collective, comm, count, buckets)
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
        step(ours, start_ours, wait_all_ours, ours_loss)

    def ringreduce_blocking():
        step(blocking, start_blocking, lambda results: None, ours_loss)

    def mpi_nonblocking():
        step(mpi, start_mpi, MPI.Request.Waitall,
             lambda: world.Allreduce(MPI.IN_PLACE, loss_value, op=MPI.SUM))

    found = {"ringreduce async": ringreduce_async, "ringreduce blocking": ringreduce_blocking,
             PEERS[collective]: mpi_nonblocking}
    start_gloo_call = None if gloo is None else gloo_call(collective, gloo[1], gloo[0], count)
    if start_gloo_call is not None:
        torch, dist = gloo
        tensors = [torch.zeros(count) for _ in range(buckets)]
        loss_tensor = torch.zeros(1)
        found["gloo async"] = lambda: step(tensors, start_gloo_call, wait_all,
                                           lambda: dist.all_reduce(loss_tensor))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rank 0 prints the table. The defaults take about a minute on 2 ranks.")
    parser.add_argument("--sizes", help="comma-separated bytes per bucket, e.g. 8,64K,1M "
                        f"(default: {','.join(human_bytes(n).replace(' ', '') for n in DEFAULT_SIZES)})")
    parser.add_argument("--collective", choices=sorted(PEERS), default="allreduce",
                        help="the call timed (default: allreduce)")
    parser.add_argument("--buckets", type=int, default=8, help="calls in flight per step "
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
    gloo = None if args.no_gloo or args.collective == "reduce_scatter" else start_gloo()
    peer = PEERS[args.collective]
    comm.allreduce(np.zeros(1, np.float32))  # (the FastPath serves a dtype and op seen before)
    rows = []
    for done, nbytes in enumerate(sizes):
        progress(done, len(sizes), f"{args.buckets} x {human_bytes(nbytes)}")
        steps = max(1, min(100, (16 << 20) // (nbytes * args.buckets)))
        times = time_alternating(candidates(comm, nbytes, args.buckets, args.compute_us * 1e-6,
                                            gloo, args.wait_each, args.wait_timeout,
                                            args.loss, args.collective),
                                 repeats=args.repeats, inner=steps)
        for name, seconds in times.items():
            rows.append({"bytes": nbytes, "implementation": name,
                         "time_s": seconds, "speedup_vs_mpi": times[peer] / seconds})
    progress(len(sizes), len(sizes), "done")
    if rank == 0:
        names = list(dict.fromkeys(r["implementation"] for r in rows))
        flight = ("each waited for at once" if args.wait_each
                  else "in flight per step")
        if args.wait_timeout is not None:
            flight += f" (ringreduce's waits: timeout={args.wait_timeout:g})"
        if args.loss:
            flight += ", then a blocking allreduce of one float"
        print(f"# {size} ranks, float32, {args.buckets} {args.collective} calls {flight}, "
              f"{args.compute_us:g} us of Python before each; median time per step")
        table = []
        for nbytes in dict.fromkeys(r["bytes"] for r in rows):
            mine = {r["implementation"]: r for r in rows if r["bytes"] == nbytes}
            table.append([human_bytes(nbytes)] + [human_time(mine[n]["time_s"]) for n in names]
                         + [f"{mine['ringreduce async']['speedup_vs_mpi']:.2f}x"])
        print(markdown_table(["bucket"] + names + [f"async speedup vs {peer}"], table))
        if args.json:
            write_json(args.json, ranks=size, dtype="float32", collective=args.collective,
                       peer=peer, buckets=args.buckets,
                       wait_each=args.wait_each, wait_timeout=args.wait_timeout,
                       loss=args.loss, compute_us=args.compute_us, repeats=args.repeats,
                       results=rows)


if __name__ == "__main__":
    main()
