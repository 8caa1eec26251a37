"""A scalar reduced across the ranks, as a training loop does once a step (its loss,
whether any rank's is NaN), beside the ways mpi4py does it, timed in one run:

    mpiexec -n 2 python -m mpi4py benchmarks/bench_scalar.py --json out.json

For a float32 loss (op sum) and a bool flag (any rank's: op max, MPI.LOR for MPI):
ringreduce given a numpy scalar, a Python scalar and a 0-d array; mpi4py's pickling
`comm.allreduce(value)`, what mpi4py code writes for a scalar; and `MPI_Allreduce` of a
1-element array. Timed alternately, run by run; reported: the median time per call
(the slowest rank's) and the speedup of each of ringreduce's over mpi4py's pickling
allreduce and over MPI_Allreduce.
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from timing import (at_least, human_time, markdown_table, output_file, time_alternating,
                    write_json)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
INNER = 2000  # calls per timed run: each takes a microsecond or a few


def candidates(comm, kind: str) -> dict:
    if kind == "float32 loss (sum)":
        value, dtype, op, mpi_op = 0.25 + rank, np.float32, "sum", MPI.SUM
    else:
        value, dtype, op, mpi_op = rank == size - 1, np.bool_, "max", MPI.LOR
    scalar, zero_d = dtype(value), np.array(value, dtype)
    one, out = np.array([value], dtype), np.empty(1, dtype)
    return {"ringreduce, numpy scalar": lambda: comm.allreduce(scalar, op=op),
            "ringreduce, Python scalar": lambda: comm.allreduce(value, op=op),
            "ringreduce, 0-d array": lambda: comm.allreduce(zero_d, op=op),
            "mpi4py allreduce (pickled)": lambda: world.allreduce(value, op=mpi_op),
            "MPI_Allreduce (1 element)": lambda: world.Allreduce(one, out, op=mpi_op)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rank 0 prints the table. The default repeats take a few seconds.")
    parser.add_argument("--repeats", type=at_least(1), default=9,
                        help="timed runs per candidate; the median is reported (default: 9)")
    parser.add_argument("--json", type=output_file(), help="write every measurement here")
    args = parser.parse_args()
    comm = rr.Communicator()
    rows = []
    for kind in ("float32 loss (sum)", "bool flag (max)"):
        times = time_alternating(candidates(comm, kind), repeats=args.repeats, inner=INNER)
        for name, seconds in times.items():
            rows.append({"value": kind, "implementation": name, "time_s": seconds,
                         "speedup_vs_pickled": times["mpi4py allreduce (pickled)"] / seconds,
                         "speedup_vs_mpi": times["MPI_Allreduce (1 element)"] / seconds})
    comm.close()
    if rank != 0:
        return
    print(f"# {size} ranks, median of {args.repeats} runs of {INNER} calls")
    print(markdown_table(
        ["value", "implementation", "time", "vs mpi4py allreduce (pickled)", "vs MPI_Allreduce"],
        [[r["value"], r["implementation"], human_time(r["time_s"]),
          f"{r['speedup_vs_pickled']:.2f}x", f"{r['speedup_vs_mpi']:.2f}x"] for r in rows]))
    if args.json:
        write_json(args.json, ranks=size, repeats=args.repeats, inner=INNER, results=rows)


if __name__ == "__main__":
    main()
