"""ringreduce beside its peers, timed in one run:

    mpiexec -n 2 python -m mpi4py benchmarks/bench_allreduce.py --json out.json --plot out.png

For every size, alternately: ringreduce's allreduce (out-of-place and in place), the MPI
library's own MPI_Allreduce through mpi4py (out-of-place), the numpy reference ring, and
torch.distributed's gloo all_reduce (in place, as gloo only offers) where torch is
installed. Then reduce_scatter, allgather and broadcast beside MPI's. The tables show
nccl-tests' columns, time, algbw and busbw (the --json file has them too): algbw =
bytes/time, busbw = algbw * 2(p-1)/p for allreduce, (p-1)/p for reduce_scatter and
allgather (whose bytes are the output's), 1 for broadcast; median over --repeats runs,
each run the slowest rank's time.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from ringreduce import reference
from ringreduce.sim import need_matplotlib, parse_bytes
from timing import (at_least, bus_bandwidth, human_bytes, human_time, inner_iterations,
                    markdown_table, output_file, save_size_plot, start_gloo, time_alternating, write_json)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()

DEFAULT_SIZES = [8, 64, 512, 4 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20,
                 16 << 20, 64 << 20, 256 << 20]
COLLECTIVE_SIZES = [64, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def sizes_argument(parser, text, default: list) -> list:
    """--sizes as byte counts (default if not given), each a whole number of float32
    elements, or a usage error (on every rank, before anything collective)."""
    if not text:
        return default
    sizes = []
    for item in text.split(","):
        try:
            size = parse_bytes(item)  # (K, M, G: powers of 1024, as `ringreduce sim`)
        except (ValueError, OverflowError):
            parser.error(f"--sizes: {item!r} is not a size (e.g. 8, 64K, 1M, 1.5G)")
        if size < 4 or size % 4:
            parser.error(f"--sizes: {item!r} is not a whole number of float32 elements "
                         "(4 bytes), at least one")
        if size not in sizes:
            sizes.append(size)
    return sizes


_last_line = [0.0]  # when progress() last wrote a line (not on a terminal)


def progress(done: int, total: int, what: str) -> None:
    """A bar on a terminal; else (under mpiexec stderr is a pipe, even from a terminal)
    a line every few seconds, and at the end."""
    if rank != 0:
        return
    if sys.stderr.isatty():
        width = 30
        filled = int(width * done / total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<40}")
        if done == total:
            sys.stderr.write("\n")
    elif done == total or time.monotonic() - _last_line[0] >= 5:
        _last_line[0] = time.monotonic()
        sys.stderr.write(f"[{done}/{total}] {what}\n")
    sys.stderr.flush()


def same_results(pairs, what: str) -> None:
    """After the timing: each (name, ours, the peer's) holds the same numbers (up to
    the order of a sum), or the run stops: a candidate that did nothing, or did it
    wrong, is not a result."""
    wrong = [name for name, ours, theirs in pairs
             if ours.shape != theirs.shape or not np.allclose(ours, theirs, rtol=1e-5, atol=1e-5)]
    if wrong:
        raise SystemExit(f"rank {rank}: {what}: {', '.join(wrong)} gave other results than "
                         "the MPI library")


def allreduce_candidates(comm, x, gloo, with_reference, mpi_op=False):
    """({name: one call}, a check of the results once they have run)."""
    out_rr, out_mpi, inplace = np.empty_like(x), np.empty_like(x), x.copy()
    candidates = {
        "ringreduce": lambda: comm.allreduce(x, out=out_rr),
        "ringreduce in place": lambda: comm.allreduce(inplace, out=inplace),
        "MPI_Allreduce": lambda: world.Allreduce(x, out_mpi, op=MPI.SUM),
    }
    if mpi_op:
        out_op = np.empty_like(x)
        candidates["ringreduce op=MPI.SUM"] = lambda: comm.allreduce(x, op=MPI.SUM, out=out_op)
    if with_reference:
        ring = comm.ring  # (given: the reference would ask every rank's machine each call)
        candidates["numpy reference"] = lambda: reference.allreduce(x, "sum", world, ring)
    if gloo is not None:
        torch, dist = gloo
        tensor = torch.from_numpy(x.copy())
        candidates["gloo (in place)"] = lambda: dist.all_reduce(tensor)
    # (In place, the sum grows each call: its numbers are not checked, only that it ran.)
    outputs = {"ringreduce": out_rr}
    if mpi_op:
        outputs["ringreduce op=MPI.SUM"] = out_op
    return candidates, lambda what: same_results(
        [(name, out, out_mpi) for name, out in outputs.items()], what)


def collective_candidates(comm, collective, x):
    """({name: one call}, a check of the results once they have run)."""
    if collective == "reduce_scatter":
        counts = [len(part) for part in np.array_split(x, size)]
        part = np.empty(counts[rank], x.dtype)
        part_mpi = np.empty_like(part)
        return ({"ringreduce": lambda: comm.reduce_scatter(x, out=part),
                 "MPI_Reduce_scatter": lambda: world.Reduce_scatter(x, part_mpi, counts)},
                lambda what: same_results([("ringreduce", part, part_mpi)], what))
    if collective == "broadcast":  # from rank 0, in place, as MPI_Bcast
        ours, theirs = x.copy(), x.copy()
        return ({"ringreduce": lambda: comm.broadcast(ours, root=0),
                 "MPI_Bcast": lambda: world.Bcast(theirs, root=0)},
                lambda what: same_results([("ringreduce", ours, theirs)], what))
    mine = x[: len(x) // size]  # allgather: the output is the size reported
    gathered = np.empty(len(mine) * size, x.dtype)
    reused = np.empty_like(gathered)  # like MPI's: allocated once, pages already touched
    # (Without out=, each result is dropped at once, so that the Communicator's kept
    # result buffers are handed out again: the best case, where the caller keeps none.)
    new = [gathered]

    def ringreduce_new():
        new[0] = comm.allgather(mine)
    return ({"ringreduce": ringreduce_new,
             "ringreduce out=": lambda: comm.allgather(mine, out=reused),
             "MPI_Allgather": lambda: world.Allgather(mine, gathered)},
            lambda what: same_results([("ringreduce", new[0], gathered),
                                       ("ringreduce out=", reused, gathered)], what))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rank 0 prints the tables. The default sizes and repeats take 15 s on 2 ranks "
               "of the development machine, about a minute with gloo (torch) beside them.")
    parser.add_argument("--sizes", help="comma-separated byte sizes, e.g. 8,64K,1M,256M "
                        f"(default: {','.join(human_bytes(n).replace(' ', '') for n in DEFAULT_SIZES)})")
    parser.add_argument("--repeats", type=at_least(1), default=9,
                        help="timed runs per size; the median is reported (default: 9)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the numpy reference ring (slow at large sizes)")
    parser.add_argument("--no-gloo", action="store_true", help="skip torch's gloo")
    parser.add_argument("--mpi-op", action="store_true",
                        help="also time ringreduce given mpi4py's MPI.SUM as its op, as code "
                             "ported from mpi4py passes it (the default passes 'sum')")
    parser.add_argument("--json", type=output_file(), help="write every measurement here")
    parser.add_argument("--plot", type=output_file(plot=True),
                        help="save busbw vs size here (PNG, or by its suffix: PDF, SVG, ...)")
    args = parser.parse_args()
    if args.plot:  # on every rank, before any collective: not after the tables on rank 0 only
        need_matplotlib(parser, "--plot")
    sizes = sizes_argument(parser, args.sizes, DEFAULT_SIZES)

    comm = rr.Communicator()
    gloo = None if args.no_gloo else start_gloo()
    rows = []
    jobs = [("allreduce", n) for n in sizes]
    jobs += [(c, n) for c in ("reduce_scatter", "allgather", "broadcast") for n in sizes
             if n in COLLECTIVE_SIZES or args.sizes]
    for done, (collective, nbytes) in enumerate(jobs):
        progress(done, len(jobs), f"{collective} {human_bytes(nbytes)}")
        count = nbytes // 4  # (whole float32 elements: see sizes_argument)
        x = np.random.default_rng(rank).standard_normal(count).astype(np.float32)
        if collective == "allreduce":
            candidates, check = allreduce_candidates(comm, x, gloo, not args.no_reference,
                                                     args.mpi_op)
        else:
            candidates, check = collective_candidates(comm, collective, x)
        times = time_alternating(candidates, repeats=args.repeats,
                                 inner=inner_iterations(nbytes))
        check(f"{collective} {human_bytes(nbytes)}")
        peer = next(name for name in times if name.startswith("MPI_"))
        if collective == "allgather":  # (its output, the size reported: whole rows)
            nbytes = count // size * size * 4
        for name, seconds in times.items():
            algbw, busbw = bus_bandwidth(nbytes, seconds, size, collective)
            rows.append({"collective": collective, "bytes": nbytes, "implementation": name,
                         "time_s": seconds, "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9,
                         "speedup_vs_mpi": times[peer] / seconds})
    progress(len(jobs), len(jobs), "done")
    if rank == 0:
        print_tables(rows)
        if args.json:
            write_json(args.json, ranks=size, dtype="float32", repeats=args.repeats,
                       results=rows)
        if args.plot:
            plot(rows, args.plot)


def print_tables(rows) -> None:
    print(f"# {size} ranks, float32, median of repeated runs; times and GB/s as nccl-tests")
    for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast"):
        mine = [r for r in rows if r["collective"] == collective]
        if not mine:
            continue
        names = list(dict.fromkeys(r["implementation"] for r in mine))
        print(f"\n## {collective}")
        ours = [n for n in names if n.startswith("ringreduce") and "in place" not in n]
        table = []
        for nbytes in sorted({r["bytes"] for r in mine}):
            got = {r["implementation"]: r for r in mine if r["bytes"] == nbytes}
            table.append([human_bytes(nbytes)]
                         + [cell for name in names for cell in (
                             human_time(got[name]["time_s"]), f"{got[name]['algbw_GBps']:.2f}",
                             f"{got[name]['busbw_GBps']:.2f}")]
                         + [" / ".join(f"{got[name]['speedup_vs_mpi']:.2f}x" for name in ours)])
        print(markdown_table(
            ["size"] + [cell for n in names for cell in (f"{n} time", "algbw", "busbw")]
            + [f"speedup vs MPI ({' / '.join(ours)})"], table))


def plot(rows, path: str) -> None:
    import matplotlib  # (main() refused --plot without it, before any work)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mine = [r for r in rows if r["collective"] == "allreduce"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r["implementation"] for r in mine):
        points = sorted((r["bytes"], r["busbw_GBps"]) for r in mine if r["implementation"] == name)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    save_size_plot(fig, ax, path, "busbw (GB/s)", f"allreduce, float32, {size} ranks on one machine")


if __name__ == "__main__":
    main()
