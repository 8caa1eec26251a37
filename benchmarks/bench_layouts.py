"""allreduce of arrays other than contiguous float32, against MPI_Allreduce: other dtypes
(float64, int32, int8, complex128), sizes that are no power of two, and strided arrays
(every other element of a bigger one), timed alternately in one run:

    mpiexec -bind-to core -n 2 python -m mpi4py benchmarks/bench_layouts.py --json out.json

MPI's call takes contiguous buffers only, so its side of a strided case is the copy a
user makes first (np.ascontiguousarray) and then MPI_Allreduce: what the same job costs
without ringreduce. Both write into an out= array. Reported: the median time per call
(the slowest rank's) and MPI's time over ringreduce's (above 1: ringreduce is faster).
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from bench_allreduce import progress
from timing import (at_least, byte_size, human_bytes, human_time, inner_iterations,
                    markdown_table, output_file, time_alternating, write_json)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
DTYPES = ("float32", "float64", "int32", "int8", "complex128")
DEFAULT_SIZES = [8, 4 << 10, 64 << 10, 1 << 20, 16 << 20]
PRIME = 7919  # elements added to make a size no power of two


def cases(sizes: list) -> list:
    """(dtype, layout, bytes) of every case: each dtype contiguous, then float32 strided
    and of a size that is no power of two."""
    found = [(dtype, "contiguous", n) for dtype in DTYPES for n in sizes]
    for n in sizes:
        found.append(("float32", "strided", n))
        found.append(("float32", "odd size", n + 4 * PRIME))
    return found


def arrays(dtype: str, layout: str, nbytes: int, rng):
    """x as the case has it, out for ringreduce and out for MPI."""
    dt = np.dtype(dtype)
    count = max(1, nbytes // dt.itemsize)
    data = rng.integers(-50, 50, 2 * count).astype(dt)
    x = data[::2] if layout == "strided" else data[:count].copy()
    return x, np.empty(count, dt), np.empty(count, dt)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rank 0 prints the table. The default sizes take a few seconds.")
    parser.add_argument("--sizes", type=lambda text: [byte_size(8)(item)
                                                      for item in text.split(",")],
                        help="comma-separated sizes in bytes, e.g. 4K,1M (K, M: powers of "
                        "1024; default 8,4K,64K,1M,16M)")
    parser.add_argument("--repeats", type=at_least(1), default=7,
                        help="timed runs per candidate; the median is reported (default: 7)")
    parser.add_argument("--json", type=output_file(), help="write every measurement here")
    args = parser.parse_args()
    comm = rr.Communicator()
    rng = np.random.default_rng(rank)
    rows = []
    jobs = cases(args.sizes or DEFAULT_SIZES)
    for done, (dtype, layout, nbytes) in enumerate(jobs):
        progress(done, len(jobs), f"{dtype} {layout} {human_bytes(nbytes)}")  # (rank 0's)
        x, out, mpi_out = arrays(dtype, layout, nbytes, rng)
        candidates = {
            "ringreduce": lambda: comm.allreduce(x, op="sum", out=out),
            "MPI_Allreduce": lambda: world.Allreduce(np.ascontiguousarray(x), mpi_out,
                                                     op=MPI.SUM),
        }
        times = time_alternating(candidates, repeats=args.repeats,
                                 inner=inner_iterations(out.nbytes))
        if not np.array_equal(out, mpi_out):  # (integers: exact; the floats here too)
            raise SystemExit(f"rank {rank}: {dtype} {layout} {nbytes} B: ringreduce's "
                             "result differs from MPI's")
        rows.append({"dtype": dtype, "layout": layout, "bytes": out.nbytes,
                     "ringreduce_s": times["ringreduce"], "mpi_s": times["MPI_Allreduce"],
                     "speedup": times["MPI_Allreduce"] / times["ringreduce"]})
    progress(len(jobs), len(jobs), "done")
    comm.close()
    if rank != 0:
        return
    print(f"# {size} ranks, median of {args.repeats} runs; speedup = MPI's time / ringreduce's")
    print(markdown_table(["dtype", "layout", "size", "ringreduce", "MPI_Allreduce", "speedup"], [
        [r["dtype"], r["layout"], human_bytes(r["bytes"]), human_time(r["ringreduce_s"]),
         human_time(r["mpi_s"]), f"{r['speedup']:.2f}x"] for r in rows]))
    if args.json:
        write_json(args.json, ranks=size, repeats=args.repeats, results=rows)


if __name__ == "__main__":
    main()
