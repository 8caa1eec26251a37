"""rr.allreduce_gradients beside what one would write with MPI instead, timed in one run:

    mpiexec -n 2 python -m mpi4py benchmarks/bench_gradients.py --json out.json

A model's gradients are --models, each COUNTxSIZE: COUNT float32 arrays of SIZE bytes.
Every candidate averages them in place across the ranks:

- ringreduce: rr.allreduce_gradients(grads) (arrays of 64 KiB or more reduced in
  place, one call each, the rest packed into buckets of 25 MB; the ranks' layouts
  checked in the first call);
- MPI, same plan: ringreduce's own plan with the MPI library's allreduce: the same
  arrays alone, in place, and the same buckets, packed into buffers made once (no
  check): what ringreduce adds over MPI with the same work to do;
- MPI packed: every array packed into one buffer made once (numpy.concatenate into
  it, MPI_Allreduce in place, a division, then back into the arrays): the usual way
  by hand;
- MPI per array: one MPI_Allreduce per gradient, then a division: the shortest code;
- gloo packed, where torch is installed: MPI packed's way with torch.distributed's
  gloo (a buffer made once too).

Rank r's gradients start at r + 1, so that one average gives (p + 1) / 2 everywhere and
later ones keep it; every candidate's arrays are checked for it after the timing (a
candidate that did nothing, or did it wrong, would fail). Timed alternately, run by
run; reported: the median time per call (the slowest rank's) and ringreduce's speedup
over each.
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from bench_allreduce import progress
from ringreduce import gradients
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


def models_table(models, rows: list[dict], count_key: str, names: list[str],
                 ratios: list[str], ratio_key: str, head: list[str]) -> str:
    """One line per model: its count x size and total, each of `names`' median time,
    then each of `ratios`' row[ratio_key]; `head`: the first column's name and the
    ratio columns' (rows: as written to --json, count_key naming the model's count)."""
    table = []
    for count, nbytes in models:
        mine = {r["implementation"]: r for r in rows
                if (r[count_key], r["bytes_each"]) == (count, nbytes)}
        table.append([f"{count} x {human_bytes(nbytes)}", human_bytes(count * nbytes)]
                     + [human_time(mine[n]["time_s"]) for n in names]
                     + [f"{mine[n][ratio_key]:.2f}x" for n in ratios])
    return markdown_table([head[0], "in all"] + names + head[1:], table)

def candidates(comm, count: int, nbytes: int, gloo) -> tuple[dict, dict]:
    """({name: one call}, {name: the arrays it averages}), each set of arrays its own."""
    elements = nbytes // 4

    def arrays():
        return [np.full(elements, rank + 1.0, np.float32) for _ in range(count)]
    ours, planned, packed, each = arrays(), arrays(), arrays(), arrays()

    def unpack(grads, indices, flat):
        for k, i in enumerate(indices):
            grads[i][...] = flat[k * elements:(k + 1) * elements]

    def ringreduce():
        rr.allreduce_gradients(ours, comm=comm)

    plan = gradients._gradient_plan(planned, 25 << 20)  # (bucket_mb=25, the default)
    flats = {tuple(b): np.empty(len(b) * elements, np.float32) for b in plan if len(b) > 1}

    def mpi_same_plan():
        for bucket in plan:
            if len(bucket) == 1:
                g = planned[bucket[0]]
                world.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
                g /= size
                continue
            flat = flats[tuple(bucket)]
            np.concatenate([planned[i] for i in bucket], out=flat)
            world.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
            flat /= size
            unpack(planned, bucket, flat)

    whole = np.empty(count * elements, np.float32)

    def mpi_packed():
        np.concatenate(packed, out=whole)
        world.Allreduce(MPI.IN_PLACE, whole, op=MPI.SUM)
        np.divide(whole, size, out=whole)
        unpack(packed, range(count), whole)

    def mpi_per_array():
        for g in each:
            world.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            g /= size

    found = {"ringreduce": ringreduce, "MPI, same plan": mpi_same_plan,
             "MPI packed": mpi_packed, "MPI per array": mpi_per_array}
    averaged = {"ringreduce": ours, "MPI, same plan": planned, "MPI packed": packed,
                "MPI per array": each}
    if gloo is not None:
        torch, dist = gloo
        tensors = [torch.full((elements,), rank + 1.0) for _ in range(count)]
        flat = torch.empty(count * elements)

        def gloo_packed():
            torch.cat(tensors, out=flat)
            dist.all_reduce(flat)
            flat.div_(size)
            for i, t in enumerate(tensors):
                t.copy_(flat[i * elements:(i + 1) * elements])
        found["gloo packed"] = gloo_packed
        averaged["gloo packed"] = [t.numpy() for t in tensors]
    return found, averaged


def check_averaged(averaged: dict, label: str) -> None:
    """Every candidate's arrays hold the ranks' average, (p + 1) / 2, everywhere."""
    want = np.float32((size + 1) / 2)
    wrong = [name for name, grads in averaged.items() if not all((g == want).all() for g in grads)]
    # (Agreed: where p is odd, rank (p-1)/2 starts at the average, and could not tell a
    # candidate that did nothing; it must stop with the others, not wait for them.)
    everyone = world.allgather(wrong)
    wrong = [name for name in averaged if any(name in theirs for theirs in everyone)]
    if wrong:
        raise SystemExit(f"rank {rank}: {label}: wrong results from {', '.join(wrong)} "
                         f"(every element should be {want})")


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
        timed, averaged = candidates(comm, count, nbytes, gloo)
        times = time_alternating(timed, repeats=args.repeats, inner=calls)
        check_averaged(averaged, label)
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
    print(models_table(models, rows, "arrays", names, others, "speedup",
                       ["gradients"] + [f"speedup vs {n}" for n in others]))
    if args.json:
        write_json(args.json, ranks=size, dtype="float32", repeats=args.repeats,
                   torch=None if gloo is None else gloo[0].__version__, results=rows)


if __name__ == "__main__":
    main()
