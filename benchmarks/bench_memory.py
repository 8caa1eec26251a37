"""Peak extra memory of one call: how much a rank's resident set grows beyond what it
held before the call (its inputs, out=, the Communicator), measured in a fresh process
per case.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_memory.py CASE [DTYPE] [MIB] [--json out.json]

Linux only: the peak is VmHWM from /proc/self/status, reset to the current resident set
before each call by writing 5 to /proc/self/clear_refs, so it counts everything the call
touches, the C++ core's and MPI's buffers too. tracemalloc's peak counts only what
numpy and Python allocate (numpy reports its data buffers to tracemalloc). Each case
is run twice: the first call (which may make buffers the Communicator keeps) and a
second, like it, after the first result was dropped. Prints one JSON line per rank, with
the RINGREDUCE_* variables it ran under (env: RINGREDUCE_SHM=0, say).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tracemalloc

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from ringreduce.optim import SGD, Adam, DistributedOptimizer
from timing import at_least, output_file, write_json


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def filled(n, dtype):
    """An array of n elements, every page touched (resident)."""
    a = np.empty(n, dtype)
    a[...] = 1
    return a


def every_other(n, dtype):
    """(an array of 2n elements, filled; its strided view of every other one, n)"""
    base = filled(2 * n, dtype)
    return base, base[::2]


def case_setup(name, dtype, nbytes, comm):
    """(inputs to keep alive, the call to measure, bytes of a result the call makes)"""
    n = nbytes // np.dtype(dtype).itemsize
    world = MPI.COMM_WORLD
    p = comm.size
    op = "sum"
    if name.startswith("allreduce") and name.endswith(("-avg", "-max")):
        op = name.rsplit("-", 1)[1]
        name = name.rsplit("-", 1)[0]
    x = filled(n, dtype)
    own_part = n // p + (comm.rank < n % p)  # (reduce_scatter's block: as array_split cuts)
    if name == "allreduce":
        return [x], lambda: comm.allreduce(x, op), nbytes
    if name == "allreduce-inplace":
        return [x], lambda: comm.allreduce(x, op, out=x), 0
    if name == "allreduce-out":
        y = filled(n, dtype)
        return [x, y], lambda: comm.allreduce(x, op, out=y), 0
    if name == "allreduce-noncontig":
        base, v = every_other(n, dtype)
        return [base], lambda: comm.allreduce(v, op), nbytes
    if name == "allreduce-noncontig-out":
        base, v = every_other(n, dtype)
        y = filled(n, dtype)
        return [base, y], lambda: comm.allreduce(v, op, out=y), 0
    if name == "allreduce_async":
        return [x], lambda: comm.allreduce_async(x, op).wait(), nbytes
    if name == "allreduce_async-inplace":
        return [x], lambda: comm.allreduce_async(x, op, out=x).wait(), 0
    if name == "reduce_scatter":
        return [x], lambda: comm.reduce_scatter(x, op), nbytes // p
    if name == "reduce_scatter-out":
        y = filled(own_part, dtype)
        return [x, y], lambda: comm.reduce_scatter(x, op, out=y), 0
    if name == "reduce_scatter-noncontig":
        base, v = every_other(n, dtype)
        return [base], lambda: comm.reduce_scatter(v, op), nbytes // p
    if name == "reduce_scatter-noncontig-out":
        base, v = every_other(n, dtype)
        y = filled(own_part, dtype)
        return [base, y], lambda: comm.reduce_scatter(v, op, out=y), 0
    if name == "allgather-noncontig":
        base, v = every_other(n // p, dtype)
        return [base], lambda: comm.allgather(v), (n // p) * p * v.itemsize
    if name == "allgather-noncontig-out":
        base, v = every_other(n // p, dtype)
        y = filled((n // p) * p, dtype)
        return [base, y], lambda: comm.allgather(v, out=y), 0
    if name == "allgather":  # each rank's x is N/p: the result is N
        x = filled(n // p, dtype)
        return [x], lambda: comm.allgather(x), (n // p) * p * x.itemsize
    if name == "allgather-out":
        x = filled(n // p, dtype)
        y = filled((n // p) * p, dtype)
        return [x, y], lambda: comm.allgather(x, out=y), 0
    if name == "broadcast":
        return [x], lambda: comm.broadcast(x, root=0), 0
    if name == "broadcast-noncontig":
        base, v = every_other(n, dtype)
        return [base], lambda: comm.broadcast(v, root=0), 0
    if name == "mpi4py-inplace":
        return [x], lambda: world.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM), 0
    if name == "mpi4py-out":
        y = filled(n, dtype)
        return [x, y], lambda: world.Allreduce(x, y, op=MPI.SUM), 0
    if name == "gradients":  # 3 big arrays and 1024 of 16 KiB, N in all
        small = [filled(16384 // x.itemsize, dtype) for _ in range(1024)]
        rest = n - 1024 * small[0].size
        big = [filled(rest // 3, dtype) for _ in range(3)]
        grads = big[:1] + small[:512] + big[1:2] + small[512:] + big[2:]
        return [grads], lambda: rr.allreduce_gradients(grads, comm=comm), 0
    if name.startswith("optimizer"):  # 4 parameters, N in all; their gradients N more
        params = [filled(n // 4, dtype) for _ in range(4)]
        grads = [filled(n // 4, dtype) for _ in range(4)]
        if name.endswith("adam"):
            inner = Adam(params, lr=1e-3)
        else:
            inner = SGD(params, lr=1e-3, momentum=0.9 if "momentum" in name else 0.0)
        opt = DistributedOptimizer(inner, comm=comm)
        if "nosync" in name:
            def run():
                with opt.no_sync():
                    opt.step(grads)
            return [params, grads, opt], run, 0
        return [params, grads, opt], lambda: opt.step(grads), 0
    raise SystemExit(f"unknown case {name}")


CASES = ["allreduce", "allreduce-avg", "allreduce-max", "allreduce-inplace",
         "allreduce-inplace-avg", "allreduce-out", "allreduce-out-avg", "allreduce-noncontig",
         "allreduce-noncontig-out", "allreduce_async", "allreduce_async-inplace",
         "reduce_scatter", "reduce_scatter-out", "reduce_scatter-noncontig",
         "reduce_scatter-noncontig-out", "allgather", "allgather-out", "allgather-noncontig",
         "allgather-noncontig-out", "broadcast",
         "broadcast-noncontig", "mpi4py-inplace", "mpi4py-out", "gradients",
         "optimizer-sgd", "optimizer-sgd-momentum", "optimizer-adam",
         "optimizer-sgd-nosync"]


def measure(call):
    gc.collect()
    MPI.COMM_WORLD.Barrier()
    before = status_kib("VmRSS")
    tracemalloc.start()
    tracemalloc.reset_peak()
    reset_peak()
    result = call()
    peak = status_kib("VmHWM")
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del result
    gc.collect()
    return (peak - before) * 1024, traced


def numpy_dtype(text: str) -> np.dtype:
    """An argparse type: a dtype numpy knows by this name."""
    try:
        return np.dtype(text)
    except TypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a numpy dtype (float32, float16, "
                                         "int64, ...)") from None


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="One case a job: a fresh process per case keeps one case's buffers out of\n"
               "another's peak. docs/api.md's \"Memory a call takes\" is made of these rows.")
    parser.add_argument("case", metavar="CASE", choices=CASES,
                        help="the call to measure: " + ", ".join(CASES))
    parser.add_argument("dtype", metavar="DTYPE", nargs="?", type=numpy_dtype,
                        default="float32", help="the arrays' dtype (default: float32)")
    parser.add_argument("mib", metavar="MIB", nargs="?", type=at_least(0, float),
                        default=256.0,
                        help="N, the input's size in MiB (default: 256); allgather's x is N/p "
                             "on each rank, the gradients' and the parameters' N in all")
    parser.add_argument("--json", type=output_file(),
                        help="also write every rank's row here (rank 0 writes it, with the "
                             "machine and the MPI)")
    return parser.parse_args()


def main():
    args = arguments()
    name, dtype = args.case, args.dtype
    nbytes = int(args.mib * (1 << 20))
    comm = rr.Communicator()
    comm.allreduce(np.ones(1024, dtype))  # (the Communicator's own set-up, not counted)
    keep, call, result_bytes = case_setup(name, dtype, nbytes, comm)
    first, first_traced = measure(call)
    second, second_traced = measure(call)
    row = {"case": name, "dtype": dtype.name, "ranks": comm.size, "rank": comm.rank,
           "transport": comm.transport, "N": nbytes, "result": result_bytes, "first": first,
           "first_traced": first_traced, "second": second, "second_traced": second_traced,
           "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RINGREDUCE_")}}
    print(json.dumps(row), flush=True)
    if args.json:
        rows = MPI.COMM_WORLD.gather(row, root=0)
        if comm.rank == 0:
            write_json(args.json, case=name, dtype=dtype.name, ranks=comm.size, N=nbytes,
                       results=rows)
    del keep
    comm.close()


if __name__ == "__main__":
    main()
