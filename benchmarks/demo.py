"""ringreduce's first demo: run with `mpiexec -n 2 python -m mpi4py benchmarks/demo.py`.

Checks ringreduce's allreduce against numpy on every rank, then times it beside the
MPI library's own MPI_Allreduce (through mpi4py) and prints nccl-tests' columns.
"""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from timing import bus_bandwidth, human_bytes, human_time, inner_iterations, time_alternating

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
comm = rr.Communicator()


def say(*args):
    if rank == 0:
        print(*args, flush=True)


def verify() -> None:
    """ringreduce == numpy's reduction of every rank's data, on every rank."""
    rng = np.random.default_rng(rank)
    checks = 0
    for dtype in (np.float32, np.float64, np.int32, np.complex64):
        for op in ("sum", "max", "avg", "prod"):
            if (op == "max" and dtype == np.complex64) or (op == "avg" and dtype == np.int32):
                continue
            for count in (0, 1, size + 1, 100_003):
                x = (rng.standard_normal(count) * 100).astype(dtype)
                y = comm.allreduce(x, op=op)
                everyone = np.stack(world.allgather(x)) if count else np.zeros((size, 0), dtype)
                reduce = {"sum": np.sum, "max": np.max, "prod": np.prod, "avg": np.mean}[op]
                if np.issubdtype(dtype, np.integer):
                    # In the dtype itself, exactly: a product of four ranks' values can
                    # pass 2**31 and wrap, as it does in C (and in numpy).
                    ok = np.array_equal(y, reduce(everyone, axis=0).astype(dtype))
                else:
                    wide = np.complex128 if dtype == np.complex64 else np.float64
                    ok = np.allclose(y, reduce(everyone.astype(wide), axis=0),
                                     rtol=1e-4, atol=1e-3)
                if not ok:
                    print(f"rank {rank}: MISMATCH {np.dtype(dtype).name} {op} count={count}",
                          file=sys.stderr)
                    world.Abort(1)
                checks += 1
    say(f"verified: {checks} allreduce calls (float32, float64, int32, complex64 x sum, max, "
        f"avg, prod where defined x 4 sizes) agree with numpy on all {size} ranks")


def benchmark() -> None:
    sizes = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
    say(f"\nallreduce, float32, {size} ranks, median of 7 runs (out-of-place)")
    header = (f"{'size':>8} | {'ringreduce':>10} {'algbw':>7} {'busbw':>7} | "
              f"{'MPI_Allreduce':>13} {'algbw':>7} {'busbw':>7} | {'speedup':>7}")
    say(header)
    say("-" * len(header))
    for nbytes in sizes:
        x = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
        out_rr, out_mpi = np.empty_like(x), np.empty_like(x)
        times = time_alternating(
            {"ringreduce": lambda: comm.allreduce(x, out=out_rr),
             "mpi": lambda: world.Allreduce(x, out_mpi, op=MPI.SUM)},
            repeats=7, inner=inner_iterations(nbytes))
        gbs = []
        for name in ("ringreduce", "mpi"):
            algbw, busbw = bus_bandwidth(nbytes, times[name], size)
            gbs.append((human_time(times[name]), algbw / 1e9, busbw / 1e9))
        (t1, a1, b1), (t2, a2, b2) = gbs
        say(f"{human_bytes(nbytes):>8} | {t1:>10} {a1:>7.2f} {b1:>7.2f} | {t2:>13} {a2:>7.2f} "
            f"{b2:>7.2f} | {times['mpi'] / times['ringreduce']:>6.2f}x")
    say("(algbw, busbw in GB/s as nccl-tests define them; speedup = MPI time / ringreduce time)")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        say(__doc__.strip())
        sys.exit(0)
    verify()
    benchmark()
