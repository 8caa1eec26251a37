"""Summarise several runs of bench_allreduce.py (their --json files) as one markdown
table: per size, the median time of each implementation over the runs, and
ringreduce's speedup over MPI in every run.

    python benchmarks/summarize.py benchmarks/results/allreduce_p2_run*.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from timing import human_bytes, human_time, markdown_table, output_file, size_axis


def pick(results, nbytes: int, name: str) -> dict:
    """One run's measurement of implementation `name` at `nbytes`."""
    return next(r for r in results if r["bytes"] == nbytes and r["implementation"] == name)


def plot(runs, path: str) -> None:
    """Speedup over MPI against size, one panel per collective: a dot per run, the
    median as a line, and 1.0x (as fast as MPI) marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib is not installed: no plot written to {path})")
        return
    collectives = [c for c in ("allreduce", "reduce_scatter", "allgather", "broadcast")
                   if any(r["collective"] == c for r in runs[0]["results"])]
    from matplotlib.ticker import FixedLocator, FuncFormatter

    rows = (len(collectives) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(10, 3.6 * rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(collectives):]:
        ax.remove()
    for ax, collective in zip(axes.flat, collectives):
        results = [[r for r in run["results"] if r["collective"] == collective] for run in runs]
        peer = next(r["implementation"] for r in results[0]
                    if r["implementation"].startswith("MPI_"))
        sizes = sorted({r["bytes"] for r in results[0]})
        per_size = []
        for nbytes in sizes:
            speedups = [pick(run, nbytes, peer)["time_s"]
                        / pick(run, nbytes, "ringreduce")["time_s"] for run in results]
            ax.scatter([nbytes] * len(speedups), speedups, s=14, color="tab:blue", alpha=0.6)
            per_size.append(statistics.median(speedups))
        ax.plot(sizes, per_size, color="tab:blue", label=f"median of {len(runs)} runs")
        ax.axhline(1.0, color="black", lw=0.8, ls="--", label=f"as fast as {peer}")
        size_axis(ax)
        ax.xaxis.set_major_locator(FixedLocator([2.0 ** k for k in range(4, 33, 4)]))
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_locator(FixedLocator([0.25, 0.5, 1, 2, 4, 8]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
        how = {"allgather": " (size: the gathered result)", "broadcast": " (in place)"}.get(
            collective, " (out-of-place)")
        ax.set_title(f"{collective} vs {peer}{how}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    for row in axes:
        row[0].set_ylabel("speedup (MPI time / ours)")
    fig.suptitle(f"ringreduce's speedup over the MPI library, {runs[0]['ranks']} ranks, "
                 "float32; one dot per run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def load(path: str) -> dict:
    """One --json file of bench_allreduce.py; SystemExit saying what is wrong otherwise."""
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"summarize.py: cannot read {path}: {e}") from None
    results = run.get("results") if isinstance(run, dict) else None
    if not results or not all(isinstance(r, dict) and "collective" in r for r in results):
        raise SystemExit(f"summarize.py: {path} is not a --json file of bench_allreduce.py "
                         "(bench_async.py's, say, has no collectives to compare)")
    return run


def main(paths: list[str], plot_path: str | None = None) -> None:
    runs = [load(p) for p in paths]
    print(f"{len(runs)} runs, {runs[0]['ranks']} ranks, float32; {runs[0]['machine']}; "
          f"{runs[0]['mpi']}\n")
    for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast"):
        rows = [[r for r in run["results"] if r["collective"] == collective] for run in runs]
        if not rows[0]:
            continue
        names = list(dict.fromkeys(r["implementation"] for r in rows[0]))
        peer = next(n for n in names if n.startswith("MPI_"))
        print(f"### {collective}\n")
        variants = [n for n in names if n.startswith("ringreduce") and n != "ringreduce"
                    and "in place" not in n]  # e.g. "ringreduce out=": a speedup column each
        table = []
        for nbytes in sorted({r["bytes"] for r in rows[0]}):
            def speedups(name):
                return ", ".join(f"{pick(run, nbytes, peer)['time_s'] / pick(run, nbytes, name)['time_s']:.2f}x"
                                 for run in rows)
            times = [statistics.median(pick(run, nbytes, n)["time_s"] for run in rows)
                     for n in names]
            busbw = statistics.median(pick(run, nbytes, "ringreduce")["busbw_GBps"]
                                      for run in rows)
            table.append([human_bytes(nbytes)] + [human_time(t) for t in times]
                         + [f"{busbw:.2f} GB/s", speedups("ringreduce")]
                         + [speedups(v) for v in variants])
        print(markdown_table(["size"] + names + ["ringreduce busbw", "speedup vs MPI, each run"]
                             + [f"{v}: speedup, each run" for v in variants], table))
        print()
    if plot_path:
        plot(runs, plot_path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="e.g. python benchmarks/summarize.py "
                                            "benchmarks/results/allreduce_p2_run*.json")
    parser.add_argument("runs", nargs="+", metavar="RUN.json",
                        help="--json files of bench_allreduce.py, one per run")
    parser.add_argument("--plot", type=output_file(plot=True),
                        help="also save speedup vs size, every run, here (PNG)")
    args = parser.parse_args()
    try:
        main(args.runs, args.plot)
    except BrokenPipeError:  # piped into `head`, which stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
