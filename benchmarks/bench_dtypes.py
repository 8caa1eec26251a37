"""The floating-point dtypes of gradients side by side: ringreduce's allreduce of the same
number of elements as float32, float16 and bfloat16 (where ml_dtypes is installed), with
`sum` and `avg`, timed in one run:

    mpiexec -n 2 python -m mpi4py benchmarks/bench_dtypes.py --json out.json

MPI has no 16-bit float op to compare with, so the peer here is float32, which moves
twice the bytes: a 16-bit format should take less time, unless its conversions to and
from float32 cost more than the bytes it saves. Timed alternately, run by run;
reported: the median time per call (the slowest rank's), and each time over float32's
with the same op and element count.
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from bench_allreduce import progress
from ringreduce.sim import parse_bytes
from timing import (at_least, human_time, inner_iterations, markdown_table, output_file,
                    time_alternating, write_json)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
DEFAULT_COUNTS = [1 << 14, 1 << 18, 1 << 20, 1 << 22]  # 64 KiB to 16 MiB of float32


def dtypes() -> list:
    found = [np.dtype(np.float32), np.dtype(np.float16)]
    try:
        import ml_dtypes
    except ImportError:
        return found
    return found + [np.dtype(ml_dtypes.bfloat16)]


def counts_argument(parser, text) -> list:
    """--counts as element counts, or a usage error (on every rank, before anything
    collective)."""
    if not text:
        return DEFAULT_COUNTS
    counts = []
    for item in text.split(","):
        try:
            count = parse_bytes(item)  # (K, M: powers of 1024, as --sizes elsewhere)
        except (ValueError, OverflowError):
            count = 0
        if count < 1:
            parser.error(f"--counts: {item!r} is not a count of elements (e.g. 1000, 16K, 1M)")
        counts.append(count)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rank 0 prints the table. The default counts take about a minute.")
    parser.add_argument("--counts", help="comma-separated element counts, e.g. 16K,1M "
                        "(K, M: powers of 1024; default 16K,256K,1M,4M)")
    parser.add_argument("--repeats", type=at_least(1), default=9,
                        help="timed runs per candidate; the median is reported (default: 9)")
    parser.add_argument("--json", type=output_file(), help="write every measurement here")
    args = parser.parse_args()
    counts = counts_argument(parser, args.counts)
    comm = rr.Communicator()
    rng = np.random.default_rng(rank)
    rows = []
    kinds = dtypes()
    jobs = [(count, op) for count in counts for op in ("sum", "avg")]
    for done, (count, op) in enumerate(jobs):
        progress(done, len(jobs), f"{count} elements, {op}")  # (rank 0's only)
        data = rng.standard_normal(count)
        candidates = {}
        for dtype in kinds:
            x = data.astype(dtype)
            out = np.empty_like(x)
            candidates[dtype.name] = (lambda x=x, out=out, op=op:
                                      comm.allreduce(x, op=op, out=out))
        times = time_alternating(candidates, repeats=args.repeats,
                                 inner=inner_iterations(count * 4))
        for name, seconds in times.items():
            rows.append({"count": count, "op": op, "dtype": name, "time_s": seconds,
                         "vs_float32": seconds / times["float32"]})
    progress(len(jobs), len(jobs), "done")
    comm.close()
    if rank != 0:
        return
    print(f"# {size} ranks, median of {args.repeats} runs")
    print(markdown_table(["elements", "op", "dtype", "time", "time / float32's"], [
        [r["count"], r["op"], r["dtype"], human_time(r["time_s"]), f"{r['vs_float32']:.2f}"]
        for r in rows]))
    if args.json:
        write_json(args.json, ranks=size, repeats=args.repeats, results=rows)


if __name__ == "__main__":
    main()
