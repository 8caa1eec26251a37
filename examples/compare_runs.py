"""Overlay the curves of several train_digits.py runs (their --json files):

    python examples/compare_runs.py run1.json run2.json ... --plot curves.png
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import plot_histories  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("histories", nargs="+")
    parser.add_argument("--plot", required=True)
    args = parser.parse_args()
    histories = [json.load(open(path)) for path in args.histories]
    print("| ranks | compression | final loss | final test accuracy | "
          "MB handed to all-reduce per rank | training time | waiting on communication |"
          "\n|---|---|---|---|---|---|---|")
    for h in histories:
        total, waiting = sum(h["seconds"]), sum(h["comm_seconds"])
        print(f"| {h['ranks']} | {h['compression']} | {h['loss'][-1]:.4f} | "
              f"{h['test_accuracy'][-1]:.3f} | {h['bytes_sent_per_rank'] / 1e6:.1f} | "
              f"{total:.2f} s | {waiting:.2f} s ({waiting / total:.0%}) |")
    plot_histories(histories, args.plot)


if __name__ == "__main__":
    main()
