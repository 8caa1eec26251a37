r"""Parameter server vs ring, measured with ringreduce's own reference code:

    mpiexec -n 4 python -m mpi4py benchmarks/ps_vs_ring.py --mib 4 \
        --plot docs/images/ps_vs_ring_4.png

Runs reference.naive_allreduce (everything to rank 0 and back) and reference.allreduce
(the ring) on the same data, counts the bytes every rank sends and receives (a thin
wrapper around the communicator counts every Send, Recv and Sendrecv), and times both.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from ringreduce import reference
from timing import at_least, markdown_table, output_file

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()


class CountingComm:
    """Forwards to an mpi4py communicator, counting the bytes this rank moves."""

    def __init__(self, comm):
        self.comm, self.sent, self.received = comm, 0, 0

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def Send(self, buf, dest, tag=0):
        self.sent += buf.nbytes
        self.comm.Send(buf, dest=dest, tag=tag)

    def Recv(self, buf, source, tag=MPI.ANY_TAG):
        self.received += buf.nbytes
        self.comm.Recv(buf, source=source, tag=tag)

    def Sendrecv(self, sendbuf, dest, recvbuf, source):
        self.sent += sendbuf.nbytes
        self.received += recvbuf.nbytes
        self.comm.Sendrecv(sendbuf, dest=dest, recvbuf=recvbuf, source=source)


def measure(fn, x, repeats):
    counter = CountingComm(world)
    result = fn(x, "sum", counter)
    traffic = (counter.sent, counter.received)
    times = []
    for _ in range(repeats):
        world.Barrier()
        start = time.perf_counter()
        fn(x, "sum", world)
        times.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return result, traffic, statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=at_least(0, float), default=16.0,
                        help="buffer size per rank, in MiB (default: 16)")
    parser.add_argument("--repeats", type=at_least(1), default=5,
                        help="timed runs of each; the median is reported (default: 5)")
    parser.add_argument("--plot", type=output_file(plot=True),
                        help="save the bytes each rank moved here (PNG)")
    args = parser.parse_args()
    x = np.random.default_rng(rank).standard_normal(int(args.mib * 2**20) // 4).astype(np.float32)
    ring = reference.ring_order(world)  # (given: else each call asks every rank's machine)
    ring_result, ring_traffic, ring_time = measure(
        lambda x, op, comm: reference.allreduce(x, op, comm, ring), x, args.repeats)
    ps_result, ps_traffic, ps_time = measure(reference.naive_allreduce, x, args.repeats)
    np.testing.assert_allclose(ring_result, ps_result, rtol=1e-4, atol=1e-4)
    rows = world.gather((rank, ring_traffic, ps_traffic), root=0)
    if rank != 0:
        return
    n = x.nbytes
    print(f"{size} ranks, {n / 2**20:g} MiB per rank (N); bytes each rank moved, in units of N\n")
    print(markdown_table(["rank", "ring: sent", "ring: received", "parameter server: sent",
                          "parameter server: received"],
                         [[r, f"{rs / n:.2f}", f"{rr_ / n:.2f}", f"{ps / n:.2f}", f"{pr / n:.2f}"]
                          for r, (rs, rr_), (ps, pr) in rows]))
    print(f"\ntime (median of {args.repeats}): ring {ring_time * 1e3:.1f} ms, parameter server "
          f"{ps_time * 1e3:.1f} ms")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ranks = np.arange(size)
        width = 0.38
        ax.bar(ranks - width / 2, [(t[1][0] + t[1][1]) / n for t in rows], width,
               label="ring (reference.allreduce)")
        ax.bar(ranks + width / 2, [(t[2][0] + t[2][1]) / n for t in rows], width,
               label="parameter server (reference.naive_allreduce)")
        ax.axhline(4 * (size - 1) / size, color="gray", linestyle=":", label="4(p-1)/p·N")
        ax.set_xticks(ranks)
        ax.set_xlabel("rank")
        ax.set_ylabel("bytes sent + received, in units of N")
        ax.set_title(f"All-reduce traffic per rank, {size} ranks (measured)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
