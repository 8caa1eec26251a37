"""Summarise several runs of bench_allreduce.py (their --json files) as one markdown
table: per size, the median time of each implementation over the runs, and
ringreduce's speedup over MPI in every run.

    python benchmarks/summarize.py benchmarks/results/allreduce_p2_run*.json
"""
from __future__ import annotations

import argparse
import json
import statistics

from timing import human_bytes, human_time


def main(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
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
        print("| size | " + " | ".join(f"{n}" for n in names)
              + " | ringreduce busbw | speedup vs MPI, each run |"
              + "".join(f" {v}: speedup, each run |" for v in variants))
        print("|---" * (len(names) + 3 + len(variants)) + "|")
        for nbytes in sorted({r["bytes"] for r in rows[0]}):
            def pick(run, name):
                return next(r for r in run if r["bytes"] == nbytes and r["implementation"] == name)
            times = {n: statistics.median(pick(run, n)["time_s"] for run in rows) for n in names}
            busbw = statistics.median(pick(run, "ringreduce")["busbw_GBps"] for run in rows)
            speedups = [pick(run, peer)["time_s"] / pick(run, "ringreduce")["time_s"]
                        for run in rows]
            extra = "".join(
                " " + ", ".join(f"{pick(run, peer)['time_s'] / pick(run, v)['time_s']:.2f}x"
                                for run in rows) + " |" for v in variants)
            print(f"| {human_bytes(nbytes)} | " + " | ".join(human_time(times[n]) for n in names)
                  + f" | {busbw:.2f} GB/s | " + ", ".join(f"{s:.2f}x" for s in speedups) + " |"
                  + extra)
        print()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="e.g. python benchmarks/summarize.py "
                                            "benchmarks/results/allreduce_p2_run*.json")
    parser.add_argument("runs", nargs="+", metavar="RUN.json",
                        help="--json files of bench_allreduce.py, one per run")
    main(parser.parse_args().runs)
