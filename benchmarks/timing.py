"""How benchmarks time a collective: every rank starts together (barrier), runs it
`inner` times, and the slowest rank's time counts; the median over `repeats` such
runs is reported. Implementations are timed alternately, repeat by repeat, so that
drift on a shared machine hits them all alike."""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import time

from mpi4py import MPI

# What matplotlib's savefig writes (no suffix: PNG).
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".webp", ".tif",
                 ".tiff", "")


def output_file(plot: bool = False):
    """An argparse type for --json and --plot: the folder must exist and be writable
    (and a plot's suffix one matplotlib writes), checked when the arguments are read,
    not after a run of minutes whose results would then be lost."""
    def check(text: str) -> str:
        folder = os.path.dirname(text) or "."
        suffix = os.path.splitext(text)[1].lower()
        if plot and suffix not in PLOT_SUFFIXES:
            raise argparse.ArgumentTypeError(
                f"{text!r}: a plot is written as {', '.join(PLOT_SUFFIXES[:-1])}")
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file")
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"{text!r}: no folder {folder!r}")
        if not os.access(folder, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r}: cannot write in {folder!r}")
        return text
    return check


def at_least(minimum, kind=int):
    """An argparse type: a finite number of `kind`, at least `minimum` (or above it,
    for a float minimum of 0)."""
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole' if kind is int else 'a'} "
                                             "number") from None
        above = kind is float and minimum == 0
        if not math.isfinite(value) or value < minimum or (above and value == 0):
            raise argparse.ArgumentTypeError(
                f"must be {'above' if above else 'at least'} {minimum}, got {text}")
        return value
    return check


def byte_size(minimum: int, multiple: int = 1, maximum: int = None):
    """An argparse type for a size in bytes, as `ringreduce sim` reads them (8, 64K,
    1.5M, 1G: powers of 1024), at least `minimum`, at most `maximum` (if given) and a
    whole number of `multiple`."""
    def check(text: str) -> int:
        from ringreduce.sim import parse_bytes
        try:
            value = parse_bytes(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 64K, 1M, "
                                             "1.5G)") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is less than {human_bytes(minimum)}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} is more than {human_bytes(maximum)}")
        if value % multiple:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of "
                                             f"{multiple}-byte elements")
        return value
    return check


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


def mpi_library() -> str:
    """The MPI library's name and version, one line."""
    from ringreduce._mpi_check import first_line

    return first_line(MPI.Get_library_version())


def machine() -> str:
    """The CPU's model name and the number of cores."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def write_json(path: str, **fields) -> None:
    """A benchmark's --json file: its fields, and what it was measured on and when."""
    with open(path, "w") as f:
        json.dump({**fields, "machine": machine(), "mpi": mpi_library(),
                   "date": time.strftime("%Y-%m-%d"), "load_average": load_average()},
                  f, indent=1)


def load_average() -> list | None:
    """The machine's load over the last 1, 5 and 15 minutes, as the run ends (on a
    shared machine, how much else ran: small calls' ratios move with it)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def inner_iterations(nbytes: int) -> int:
    """Enough calls per timed run that the clock's resolution does not matter."""
    return max(1, min(1000, (4 << 20) // max(nbytes, 1)))


# Calls each candidate makes before it is timed: first-touch page faults, lazy set-up,
# and the 12 calls in which ringreduce's wire tuner tries each way a size can travel
# (docs/performance.md), so that the timed ones measure the steady state; at most
# WARM_UP_SECONDS of them past the second (the tuner works up to 8 MiB, where calls
# are short: 16 calls of 1 GiB would triple a GPU table's time for nothing).
WARM_UP_CALLS = 16
WARM_UP_SECONDS = 0.25


def time_alternating(candidates: dict, repeats: int, inner: int, comm=MPI.COMM_WORLD) -> dict:
    """{name: median seconds per call} for each zero-argument callable. Each run starts
    with the next candidate in turn (A B C, B C A, ...): none always goes first, after
    the barrier, or last, after the others' traffic."""
    samples = {name: [] for name in candidates}
    for fn in candidates.values():
        start = time.perf_counter()
        for calls in range(WARM_UP_CALLS):
            fn()
            # (Every rank decides alike: the slowest's time, as the timed runs count.)
            if calls >= 1 and comm.allreduce(time.perf_counter() - start,
                                             op=MPI.MAX) > WARM_UP_SECONDS:
                break
    names = list(candidates)
    for run in range(repeats):
        for name in names[run % len(names):] + names[:run % len(names)]:
            fn = candidates[name]
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


def markdown_table(head: list[str], rows: list[list]) -> str:
    """A markdown table: the header, its |---| line, and a line for each row of cells."""
    def line(cells):
        return "| " + " | ".join(map(str, cells)) + " |"
    return "\n".join([line(head), "|" + "---|" * len(head)] + [line(row) for row in rows])


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
