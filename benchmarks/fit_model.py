"""The alpha-beta-gamma cost model of the ring, fitted on this machine:

    mpiexec -n 2 python -m mpi4py benchmarks/fit_model.py --json model.json --plot model.png

    T(n) = 2(p-1)·α + 2(p-1)/p·n·β + (p-1)/p·n·γ

α (seconds per message) and β (seconds per byte moved) come from timing mpi4py's
Sendrecv between ring neighbours, small and large; γ (seconds per byte reduced) from
timing ringreduce's own float32 sum kernel on every rank at once. The model then
predicts ringreduce's allreduce time, which is printed beside the measured one. The
pipeline overlaps reducing with moving, so the measured time may beat the model.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from ringreduce import _core
from timing import (at_least, human_bytes, human_time, inner_iterations, markdown_table,
                    output_file, save_size_plot, time_alternating, write_json)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
left, right = (rank - 1) % size, (rank + 1) % size
SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def sendrecv_time(nbytes: int, repeats: int) -> float:
    send = np.ones(max(nbytes, 1), np.uint8)
    recv = np.empty_like(send)
    return time_alternating({"sendrecv": lambda: world.Sendrecv(send, right, recvbuf=recv,
                                                                 source=left)},
                            repeats, inner_iterations(nbytes))["sendrecv"]


def reduce_time(nbytes: int, repeats: int) -> float:
    a = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
    b, out = a.copy(), np.empty_like(a)
    code, op = _core.DTYPES.index("float32"), _core.OPS.index("sum")
    return time_alternating({"reduce": lambda: _core.reduce(out, a, b, code, op)},
                            repeats, inner_iterations(nbytes))["reduce"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=at_least(1), default=7,
                        help="timed runs of each measurement; the median is used (default: 7)")
    parser.add_argument("--json", type=output_file(), help="write the fitted model here")
    parser.add_argument("--plot", type=output_file(plot=True),
                        help="save the model against the measurements here (PNG)")
    args = parser.parse_args()
    if size < 2:
        parser.error("run it on 2 ranks or more (mpiexec -n 2 ...): one rank sends nothing, "
                     "and the model of its allreduce is 0")

    if rank == 0:
        print("timing Sendrecv and the reduce kernel ...", file=sys.stderr, flush=True)
    alpha = sendrecv_time(8, args.repeats)
    big = 64 << 20
    beta = (sendrecv_time(big, args.repeats) - alpha) / big
    gamma = reduce_time(big, args.repeats) / big
    p = size

    def model(n):
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma

    comm = rr.Communicator()
    rows = []
    for n in SIZES:
        if rank == 0:
            print(f"timing allreduce of {human_bytes(n)} ...", file=sys.stderr, flush=True)
        x = np.random.default_rng(rank).standard_normal(n // 4).astype(np.float32)
        out = np.empty_like(x)
        measured = time_alternating({"rr": lambda: comm.allreduce(x, out=out)}, args.repeats,
                                    inner_iterations(n))["rr"]
        rows.append({"bytes": n, "measured_s": measured, "model_s": model(n)})
    if rank != 0:
        return
    print(f"# alpha-beta-gamma model, {p} ranks, float32 sum")
    print(f"alpha = {alpha * 1e6:.2f} us per message (Sendrecv of 8 B)")
    print(f"beta  = {beta * 1e9:.4f} ns per byte moved (1/beta = {1 / beta / 1e9:.2f} GB/s)")
    print(f"gamma = {gamma * 1e9:.4f} ns per byte reduced (1/gamma = {1 / gamma / 1e9:.2f} GB/s)")
    print("\n" + markdown_table(["size", "model", "measured", "measured / model"], [
        [human_bytes(r["bytes"]), human_time(r["model_s"]), human_time(r["measured_s"]),
         f"{r['measured_s'] / r['model_s']:.2f}"] for r in rows]))
    if args.json:
        write_json(args.json, ranks=p, alpha_s=alpha, beta_s_per_byte=beta,
                   gamma_s_per_byte=gamma, rows=rows)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r["bytes"] for r in rows]
        ax.plot(xs, [r["model_s"] * 1e3 for r in rows], "--", label="model 2(p-1)α + "
                "2(p-1)/p·nβ + (p-1)/p·nγ")
        ax.plot(xs, [r["measured_s"] * 1e3 for r in rows], "o-", label="ringreduce, measured")
        save_size_plot(fig, ax, args.plot, "time (ms)",
                       f"allreduce cost model vs measurement, {p} ranks")


if __name__ == "__main__":
    main()
