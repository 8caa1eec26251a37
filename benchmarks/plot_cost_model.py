r"""The cost-model figure of docs/cost-model.md: modelled all-reduce time against the
number of ranks for ring, naive, recursive doubling and Rabenseifner's (ringreduce.sim, with
alpha, beta and gamma as fit_model.py measured them), and ringreduce's measured times at 2
ranks.

    python benchmarks/plot_cost_model.py --model benchmarks/results/model_p2.json \
        --measured 'benchmarks/results/allreduce_p2_run*.json' --plot docs/images/cost_model_ranks.png
"""
from __future__ import annotations

import argparse
import glob
import json
import statistics

from ringreduce import sim
from timing import human_bytes, markdown_table, output_file

SIZES = [4 << 10, 1 << 20, 64 << 20]
RANKS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
STYLE = {"ring": "-", "naive": ":", "recursive doubling": "--", "Rabenseifner": "-."}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="fit_model.py --json output")
    parser.add_argument("--measured", help="glob of bench_allreduce.py --json outputs")
    parser.add_argument("--plot", required=True, type=output_file(plot=True),
                        help="save the figure here (PNG)")
    args = parser.parse_args()
    try:
        with open(args.model) as f:
            fitted = json.load(f)
        alpha, beta, gamma = (fitted["alpha_s"], fitted["beta_s_per_byte"],
                              fitted["gamma_s_per_byte"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--model {args.model}: not a fit_model.py --json file ({e!r})")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab10")
    print(f"alpha={alpha:.3g} s, beta={beta:.3g} s/B, gamma={gamma:.3g} s/B")
    table = []
    for c, nbytes in enumerate(SIZES):
        curves = {name: [] for name in STYLE}
        for p in RANKS:
            for name, fn in sim.ALGORITHMS.items():
                r = fn(p, nbytes // 4, 4, alpha, beta, gamma)
                curves[r.algorithm].append(r.seconds)
            if p in (2, 64, 1024):
                table.append([human_bytes(nbytes), p]
                             + [f"{curves[n][-1] * 1e3:.3f} ms" for n in STYLE])
        for name, times in curves.items():
            ax.plot(RANKS, [t * 1e3 for t in times], STYLE[name], color=colors(c),
                    label=f"{name}, {human_bytes(nbytes)}")
    print(markdown_table(["size", "ranks", *STYLE], table))
    if args.measured:
        runs = [json.load(open(p)) for p in sorted(glob.glob(args.measured))]
        for c, nbytes in enumerate(SIZES):
            times = [r["time_s"] for run in runs for r in run["results"]
                     if r["collective"] == "allreduce" and r["bytes"] == nbytes
                     and r["implementation"] == "ringreduce"]
            if times:
                ax.plot([2], [statistics.median(times) * 1e3], "o", color=colors(c),
                        markersize=8, label=f"ringreduce measured, {human_bytes(nbytes)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("modelled time (ms)")
    ax.set_title("all-reduce: ring vs naive, recursive doubling and Rabenseifner's "
                 "(alpha-beta-gamma model)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
