r"""Shared memory or MPI messages: how the timed choice of wire (csrc/wire_tuner.h) holds
up on a shared machine, measured for minutes on end:

    mpiexec -n 2 python -m mpi4py benchmarks/wire_choice.py --seconds 420 \
        --json wire.json --plot wire.png

Round after round (each implementation first in its turn): a 1 MiB reduce_scatter, a
1 MiB allgather and a 4 MiB allreduce by ringreduce choosing its wire (the default), by
ringreduce always through shared memory (RINGREDUCE_SHM=1), the same with its slots
written by streaming stores (RINGREDUCE_SHM=stream), by ringreduce always over MPI
messages (RINGREDUCE_SHM=0, which also exchanges its call headers by MPI_Iallgather and
inlines only 256 bytes), and by the MPI library itself. Each point is the slowest rank's mean over a batch of calls.
Rounds in which shared memory's ordinary stores took over 1.5x as long as its streaming
stores (which are up to 1.55x slower in the usual phase) are counted as the machine's slow
phases, and summarised apart.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from timing import at_least, markdown_table, output_file, write_json

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
WAYS = {"chosen": None, "shared memory": "1", "streaming stores": "stream",
        "MPI messages": "0"}


LABELS = {"MPI library": "MPI library",
          "streaming stores": "ringreduce, always shared memory, streaming stores",
          "shared memory": "ringreduce, always shared memory"}


def communicator(shm_setting):
    # RINGREDUCE_SHM is read when a communicator is made.
    saved = os.environ.pop("RINGREDUCE_SHM", None)
    if shm_setting is not None:
        os.environ["RINGREDUCE_SHM"] = shm_setting
    try:
        return rr.Communicator()
    finally:
        os.environ.pop("RINGREDUCE_SHM", None)
        if saved is not None:
            os.environ["RINGREDUCE_SHM"] = saved


def timed(call, n):
    world.Barrier()
    start = time.perf_counter()
    for _ in range(n):
        call()
    mean = np.array((time.perf_counter() - start) / n)
    world.Allreduce(MPI.IN_PLACE, mean, op=MPI.MAX)
    return float(mean)


def main() -> None:
    parser = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=at_least(0, float), default=420,
                        help="how long to alternate the ways (default: 420)")
    parser.add_argument("--json", type=output_file(), help="write every round here")
    parser.add_argument("--plot", type=output_file(plot=True),
                        help="save the times against the clock here (PNG)")
    args = parser.parse_args()

    rings = {name: communicator(setting) for name, setting in WAYS.items()}
    if rings["chosen"].transport != "shared memory":
        sys.exit("wire_choice.py: the ranks do not share memory; there is no choice to make")
    x = np.random.default_rng(rank).standard_normal((1 << 20) // 4).astype(np.float32)
    counts = [len(part) for part in np.array_split(x, size)]
    part = np.empty(counts[rank], np.float32)
    y = np.random.default_rng(rank).standard_normal((4 << 20) // 4).astype(np.float32)
    out = np.empty_like(y)
    x_all = np.empty(len(x) // size * size, np.float32)
    tests = {"reduce_scatter 1 MiB": ({name: (lambda r=r: r.reduce_scatter(x, out=part))
                                       for name, r in rings.items()}
                                      | {"MPI library": lambda: world.Reduce_scatter(x, part, counts)},
                                      40),
             "allgather 1 MiB": ({name: (lambda r=r: r.allgather(x[:len(x) // size], out=x_all))
                                  for name, r in rings.items()}
                                 | {"MPI library": lambda: world.Allgather(x[:len(x) // size],
                                                                          x_all)}, 40),
             "allreduce 4 MiB": ({name: (lambda r=r: r.allreduce(y, out=out))
                                  for name, r in rings.items()}
                                 | {"MPI library": lambda: world.Allreduce(y, out)}, 10)}
    rounds = []
    start = time.time()
    next_line = 30.0  # (progress, when stderr is not a terminal)
    while True:
        stop = np.array(time.time() - start > args.seconds, dtype=np.int32)
        world.Bcast(stop, root=0)
        if stop:
            break
        row = {"t": time.time() - start}
        for test, (calls, n) in tests.items():
            names = list(calls)
            turn = len(rounds) % len(names)  # each goes first in turn: no one always runs cold
            for name in names[turn:] + names[:turn]:
                row[f"{test}: {name}"] = timed(calls[name], n)
        rounds.append(row)
        if rank == 0 and sys.stderr.isatty():
            sys.stderr.write(f"\r{row['t']:.0f}/{args.seconds:.0f} s, {len(rounds)} rounds")
        elif rank == 0 and row["t"] >= next_line:  # a pipe (mpiexec's): a line now and then
            next_line = row["t"] + 30
            sys.stderr.write(f"{row['t']:.0f}/{args.seconds:.0f} s, {len(rounds)} rounds\n")
            sys.stderr.flush()
    for ring in rings.values():
        ring.close()
    if rank != 0:
        return
    print(f"\n{len(rounds)} rounds in {args.seconds:.0f} s, {size} ranks")
    summary = summarise(rounds, tests)
    if args.json:
        write_json(args.json, ranks=size, seconds=args.seconds, rounds=rounds, summary=summary)
    if args.plot:
        plot(rounds, tests, args.plot)


def summarise(rounds, tests) -> dict:
    summary = {}
    for test, (calls, _) in tests.items():
        slow = [r for r in rounds
                if r[f"{test}: shared memory"] > 1.5 * r[f"{test}: streaming stores"]]
        usual = [r for r in rounds if r not in slow]
        print(f"\n{test}: {len(slow)} of {len(rounds)} rounds in a slow phase")
        summary[test] = {"slow_rounds": len(slow), "rounds": len(rounds)}
        table = []
        for name in calls:
            key = f"{test}: {name}"
            med = [statistics.median(r[key] for r in part) * 1e6 if part else float("nan")
                   for part in (usual, slow)]
            summary[test][name] = {"usual_us": med[0], "slow_us": med[1]}
            label = LABELS.get(name, f"ringreduce, {name}")
            shown = [f"{m:.0f} us" if m == m else "-" for m in med]  # (no slow rounds: NaN)
            table.append([label] + shown)
        print(markdown_table(["implementation", "usual rounds (median)", "slow rounds (median)"],
                             table))
    return summary


def plot(rounds, tests, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib is not installed: no plot written to {path})")
        return
    fig, axes = plt.subplots(len(tests), 1, figsize=(9, 3.2 * len(tests)), sharex=True)
    for ax, (test, (calls, _)) in zip(axes, tests.items()):
        for name in calls:
            label = LABELS.get(name, f"ringreduce, {name}")
            ax.plot([r["t"] for r in rounds], [r[f"{test}: {name}"] * 1e6 for r in rounds],
                    lw=0.8, label=label)
        ax.set_yscale("log")
        ax.set_ylabel("time per call (us)")
        ax.set_title(test)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
