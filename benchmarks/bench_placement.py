"""The ring machine by machine against the ring in rank order, timed in one run, on a
job whose ranks span several machines:

    mpiexec -n 16 -f hosts python -m mpi4py benchmarks/bench_placement.py --json out.json

Where mpiexec placed the ranks round-robin (a host file without counts: rank r on host
r mod H), ringreduce goes round each machine's ranks in turn (Communicator.ring), so
that the ring crosses the network once per machine; in rank order it would cross at
every link. This makes one Communicator each way (RINGREDUCE_RING=ranks for the
second) and times allreduce on both, alternately, beside MPI_Allreduce: median of
--repeats runs, each the slowest rank's time, as bench_allreduce.py times. On one
machine, or ranks placed machine by machine, the two rings are the same, and so are
their times. (The development machine has no second one: the tests run this script on
ranks that pretend to be on two, RINGREDUCE_TEST_MACHINE=a,b, which says nothing about
speed.)
"""
from __future__ import annotations

import argparse
import os

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from bench_allreduce import progress, sizes_argument
from ringreduce import reference
from ringreduce.sim import crossings
from timing import (at_least, bus_bandwidth, human_bytes, human_time, inner_iterations,
                    markdown_table, output_file, time_alternating, write_json)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def communicators():
    """(machine by machine, rank order): the second made with RINGREDUCE_RING=ranks,
    which every rank sets (any one would decide for all)."""
    by_machine = rr.Communicator()
    before = os.environ.get("RINGREDUCE_RING")
    os.environ["RINGREDUCE_RING"] = "ranks"
    try:
        in_rank_order = rr.Communicator()
    finally:
        if before is None:
            del os.environ["RINGREDUCE_RING"]
        else:
            os.environ["RINGREDUCE_RING"] = before
    return by_machine, in_rank_order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", help="comma-separated byte sizes, e.g. 64K,1M,64M "
                        f"(default: {','.join(human_bytes(n).replace(' ', '') for n in DEFAULT_SIZES)})")
    parser.add_argument("--repeats", type=at_least(1), default=9,
                        help="timed runs per size; the median is reported (default: 9)")
    parser.add_argument("--json", type=output_file(), help="write every measurement here")
    args = parser.parse_args()
    sizes = sizes_argument(parser, args.sizes, DEFAULT_SIZES)
    by_machine, in_rank_order = communicators()
    # (the machine each rank is on, as the core names it)
    machines = world.allgather(reference.machine_of_this_process())
    rows = []
    for done, nbytes in enumerate(sizes):
        progress(done, len(sizes), f"allreduce {human_bytes(nbytes)}")
        x = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
        outs = [np.empty_like(x) for _ in range(3)]
        candidates = {
            "machine by machine": lambda: by_machine.allreduce(x, out=outs[0]),
            "rank order": lambda: in_rank_order.allreduce(x, out=outs[1]),
            "MPI_Allreduce": lambda: world.Allreduce(x, outs[2], op=MPI.SUM),
        }
        times = time_alternating(candidates, repeats=args.repeats, inner=inner_iterations(nbytes))
        for name, seconds in times.items():
            algbw, busbw = bus_bandwidth(nbytes, seconds, size)
            rows.append({"bytes": nbytes, "implementation": name, "time_s": seconds,
                         "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9,
                         "speedup_over_rank_order": times["rank order"] / seconds})
    progress(len(sizes), len(sizes), "done")
    if rank == 0:
        print(f"# {size} ranks on {len(set(machines))} machine(s); ring machine by machine: "
              f"{by_machine.ring} ({crossings(by_machine.ring, machines)} links between "
              f"machines); in rank order: {crossings(in_rank_order.ring, machines)} links "
              "between machines")
        compared = ("machine by machine", "rank order", "MPI_Allreduce")
        table = []
        for nbytes in sizes:
            got = {r["implementation"]: r for r in rows if r["bytes"] == nbytes}
            table.append([human_bytes(nbytes)]
                         + [cell for name in compared for cell in (
                             human_time(got[name]["time_s"]), f"{got[name]['busbw_GBps']:.2f}")]
                         + [f"{got['machine by machine']['speedup_over_rank_order']:.2f}x"])
        print(markdown_table(["size"] + [cell for name in compared for cell in (name, "busbw")]
                             + ["machine by machine vs rank order"], table))
        if args.json:
            write_json(args.json, ranks=size, machines=machines,
                       ring_by_machine=list(by_machine.ring),
                       ring_in_rank_order=list(in_rank_order.ring), dtype="float32",
                       repeats=args.repeats, results=rows)
    by_machine.close()
    in_rank_order.close()


if __name__ == "__main__":
    main()
