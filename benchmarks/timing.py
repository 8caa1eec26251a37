"""How benchmarks time a collective: every rank starts together (barrier), runs it
`inner` times, and the slowest rank's time counts; the median over `repeats` such
runs is reported. Implementations are timed alternately, repeat by repeat, so that
drift on a shared machine hits them all alike."""
from __future__ import annotations

import socket
import statistics
import time

from mpi4py import MPI


def start_gloo(comm=MPI.COMM_WORLD):
    """torch.distributed with gloo on the same ranks, or None without torch."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    return torch, dist


def inner_iterations(nbytes: int) -> int:
    """Enough calls per timed run that the clock's resolution does not matter."""
    return max(1, min(1000, (4 << 20) // max(nbytes, 1)))


def time_alternating(candidates: dict, repeats: int, inner: int, comm=MPI.COMM_WORLD) -> dict:
    """{name: median seconds per call} for each zero-argument callable."""
    samples = {name: [] for name in candidates}
    for fn in candidates.values():  # warm up: first-touch page faults, lazy set-up
        fn()
    for _ in range(repeats):
        for name, fn in candidates.items():
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            elapsed = (time.perf_counter() - start) / inner
            samples[name].append(comm.allreduce(elapsed, op=MPI.MAX))
    return {name: statistics.median(values) for name, values in samples.items()}


def bus_bandwidth(nbytes: int, seconds: float, size: int, collective: str = "allreduce"):
    """(algbw, busbw) in bytes/s, as nccl-tests define them."""
    algbw = nbytes / seconds if seconds > 0 else float("inf")
    factor = {"allreduce": 2 * (size - 1) / size, "broadcast": 1.0}.get(collective,
                                                                      (size - 1) / size)
    return algbw, algbw * factor


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def human_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def size_axis(ax) -> None:
    """A log2 x axis of message sizes, ticked in B / KiB / MiB."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda n, _: human_bytes(int(n))))
    ax.set_xlabel("message size (bytes per rank)")


def save_size_plot(fig, ax, path: str, ylabel: str, title: str) -> None:
    """Log-log axes over message size, labelled, saved as `path`."""
    size_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
