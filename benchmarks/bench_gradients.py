"""rr.allreduce_gradients beside what one would write with MPI instead, timed in one run:

    mpiexec -n 2 python -m mpi4py benchmarks/bench_gradients.py --json out.json

A model's gradients are --models, each COUNTxSIZE: COUNT float32 arrays of SIZE bytes.
Every candidate averages them in place across the ranks:

- ringreduce: rr.allreduce_gradients(grads) (packed into buckets of 25 MB, the
  ranks' layouts checked in the first bucket's call);
- MPI packed: the same packing by hand (numpy.concatenate, MPI_Allreduce in place,
  a division, then back into the arrays): allreduce_gradients with the MPI library's
  allreduce, and no check;
- MPI per array: one MPI_Allreduce per gradient, then a division: the shortest code;
- gloo packed, where torch is installed: the packing with torch.distributed's gloo.

Timed alternately, run by run; reported: the median time per call (the slowest
rank's) and ringreduce's speedup over each.
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from bench_allreduce import progress
from timing import at_least, byte_size, human_bytes, human_time, markdown_table, output_file, \
    start_gloo, time_alternating, write_json

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()

DEFAULT_MODELS = "8x2K,200x1K,48x64K,8x1M,3x16M"


def models_argument(parser, text: str) -> list[tuple[int, int]]:
    """--models as (count, bytes) pairs, or a usage error (on every rank alike)."""
    models = []
    for item in text.split(","):
        count, _, nbytes = item.partition("x")
        if not count.isdigit() or int(count) < 1 or not nbytes:
            parser.error(f"--models: {item!r} is not COUNTxSIZE (e.g. 8x1M)")
        try:
            nbytes = byte_size(4, multiple=4)(nbytes)
        except argparse.ArgumentTypeError as error:
            parser.error(f"--models: {item!r}: {error}")
        models.append((int(count), nbytes))
    return models


def candidates(comm, count: int, nbytes: int, gloo) -> dict:
    elements = nbytes // 4

    def arrays():
        # Zeros: averaged in place again and again, they stay what they are.
        return [np.zeros(elements, np.float32) for _ in range(count)]
    ours, packed, each = arrays(), arrays(), arrays()

    def unpack(grads, flat):
        for i, g in enumerate(grads):
            g[...] = flat[i * elements:(i + 1) * elements]

    def ringreduce():
        rr.allreduce_gradients(ours, comm=comm)

    def mpi_packed():
        flat = np.concatenate(packed)
        world.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        flat /= size
        unpack(packed, flat)

    def mpi_per_array():
        for g in each:
            world.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            g /= size

    found = {"ringreduce": ringreduce, "MPI packed": mpi_packed,
             "MPI per array": mpi_per_array}
    if gloo is not None:
        torch, dist = gloo
        tensors = [torch.zeros(elements) for _ in range(count)]

        def gloo_packed():
            flat = torch.cat(tensors)
            dist.all_reduce(flat)
            flat /= size
            for i, t in enumerate(tensors):
                t.copy_(flat[i * elements:(i + 1) * elements])
        found["gloo packed"] = gloo_packed
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rank 0 prints the table. The defaults take about a minute on 2 ranks.")
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma-separated COUNTxSIZE (default: {DEFAULT_MODELS})")
    parser.add_argument("--repeats", type=at_least(1), default=15,
                        help="timed runs per model; the median is reported (default: 15)")
    parser.add_argument("--no-gloo", action="store_true", help="skip torch's gloo")
    parser.add_argument("--json", type=output_file(), help="write every measurement here")
    args = parser.parse_args()
    models = models_argument(parser, args.models)

    comm = rr.Communicator()
    gloo = None if args.no_gloo else start_gloo()
    rows = []
    for done, (count, nbytes) in enumerate(models):
        label = f"{count} x {human_bytes(nbytes)}"
        progress(done, len(models), label)
        calls = max(1, min(50, (32 << 20) // (count * nbytes)))
        times = time_alternating(candidates(comm, count, nbytes, gloo), repeats=args.repeats,
                                 inner=calls)
        for name, seconds in times.items():
            rows.append({"arrays": count, "bytes_each": nbytes, "implementation": name,
                         "time_s": seconds, "speedup": seconds / times["ringreduce"]})
    progress(len(models), len(models), "done")
    if rank != 0:
        return
    names = list(dict.fromkeys(r["implementation"] for r in rows))
    others = [n for n in names if n != "ringreduce"]
    print(f"# {size} ranks, float32, averaged in place; median time per call; "
          "ringreduce's speedup = the other's time / ringreduce's")
    table = []
    for count, nbytes in models:
        mine = {r["implementation"]: r for r in rows
                if (r["arrays"], r["bytes_each"]) == (count, nbytes)}
        table.append([f"{count} x {human_bytes(nbytes)}", human_bytes(count * nbytes)]
                     + [human_time(mine[n]["time_s"]) for n in names]
                     + [f"{mine[n]['speedup']:.2f}x" for n in others])
    print(markdown_table(["gradients", "in all"] + names + [f"speedup vs {n}" for n in others],
                         table))
    if args.json:
        write_json(args.json, ranks=size, dtype="float32", repeats=args.repeats,
                   torch=None if gloo is None else gloo[0].__version__, results=rows)


if __name__ == "__main__":
    main()
