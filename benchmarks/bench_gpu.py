"""cupy allreduce through ringreduce (as shipped; and forced onto each of its two
paths: the device ring, and one copy to the host with the host ring), side by side in
one run with what a user would do without it (copy to pinned host memory, mpi4py's
Allreduce, copy back) and with torch.distributed's gloo on the same device buffers (where torch
is), beside the GPU's own device-to-device copy rate. nccl-tests' columns; median of repeated runs. Every
timed call ends with the stream synchronised, so a call is timed until its result is
there. Each size's results, of every candidate but gloo, are checked against MPI's
whole: a wrong one stops the run.

    mpiexec -n 2 python benchmarks/bench_gpu.py --json gpu.json --markdown gpu.md

Ranks may share one GPU (rank r uses GPU r % count), as on a one-GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ringreduce as rr  # noqa: E402
from ringreduce.sim import need_matplotlib  # noqa: E402
from timing import (at_least, bus_bandwidth, byte_size, human_bytes, human_time,  # noqa: E402
                    mpi_library, output_file, save_size_plot, start_gloo, time_alternating)

world = MPI.COMM_WORLD
RANK, SIZE = world.Get_rank(), world.Get_size()


def host_buffer(n: int) -> np.ndarray:
    """n float32 of host memory for the peer's copies: pinned, as ringreduce stages
    through (pageable memory would cost the peer a bounce through the driver's own
    pinned buffers that ringreduce does not pay), where cupyx can make it."""
    try:
        import cupyx
        return cupyx.empty_pinned((n,), np.float32)
    except (ImportError, AttributeError):  # (the tests' stand-in for cupy has none)
        return np.empty(n, np.float32)


def free_memory(cp) -> None:
    """Gives back what a size's buffers took, on the GPU and pinned (whose blocks are
    handed out again only at the same size: each size would keep its own)."""
    cp.get_default_memory_pool().free_all_blocks()
    pinned = getattr(cp, "get_default_pinned_memory_pool", None)
    if pinned is not None:
        pinned().free_all_blocks()


def say(*args):
    if RANK == 0:
        print(*args, flush=True)


PEERS = ("host_mpi", "gloo")


def labels(big_chunk):
    return {"ring": "ringreduce", "ring_device": "device ring only",
            "ring_big": f"device ring, {human_bytes(big_chunk)} chunks",
            "ring_host": "reduced on host only", "host_mpi": "host copies + MPI_Allreduce",
            "gloo": "gloo (in place)"}


def columns(names, big_chunk):
    label = labels(big_chunk)
    head = ["size"]
    for name in names:
        head += [label[name], "busbw"]
    head += [{"host_mpi": "speedup vs host + MPI", "gloo": "speedup vs gloo"}[name]
             for name in names if name in PEERS]
    head.append("D2D copy")
    return "| " + " | ".join(head) + " |\n|" + "---|" * len(head)


def table_row(r, names) -> str:
    """One size's markdown row: each candidate's time and busbw, the speedup of
    ringreduce as shipped over each peer, and the copy rate."""
    cells = [human_bytes(r["bytes"])]
    for name in names:
        cells += [human_time(r[name]["seconds"]), f"{r[name]['busbw'] / 1e9:.2f} GB/s"]
    cells += [f"{r[name]['seconds'] / r['ring']['seconds']:.2f}x"
              for name in names if name in PEERS]
    cells.append(f"{r['d2d_bytes_per_s'] / 1e9:.0f} GB/s")
    return "| " + " | ".join(cells) + " |"


def check_result(cp, name: str, got, want, what: str) -> None:
    """Stops the run if candidate `name`'s result (a device array) differs from the host
    MPI's (`want`, on the device too: compared there, as 1 GiB compared on the host
    would take seconds): float32 sums in another order differ by a few units in the
    last place, scaled by the ranks. A fast wrong answer is no result."""
    if bool(cp.allclose(got, want, rtol=1e-5, atol=1e-5 * SIZE)):
        return
    got, want = cp.asnumpy(got).ravel(), cp.asnumpy(want).ravel()
    bad = np.flatnonzero(~np.isclose(got, want, rtol=1e-5, atol=1e-5 * SIZE))
    i = bad[0]
    raise SystemExit(f"rank {RANK}: {name} {what} gave a wrong result: element {i} is "
                     f"{got[i]!r}, MPI gives {want[i]!r} ({bad.size} of {got.size} differ)")


def synced(stream, fn):
    """fn, then wait for the stream: a call is timed until its result is there."""
    def call():
        fn()
        stream.synchronize()
    return call


OTHERS_HEADER = ("| collective | size | ringreduce | busbw | device ring only | busbw | "
                 "host copies + MPI | busbw | speedup vs host + MPI |\n|" + "---|" * 9)


def other_collectives(cp, comm, device_only, sizes, repeats):
    """reduce_scatter, allgather and broadcast of cupy float32 buffers of each total size:
    ringreduce as shipped, its device ring forced (device_only), and copying to the host
    for MPI_Reduce_scatter_block / MPI_Allgather / MPI_Bcast and back. Rows for the
    JSON; each printed as it is measured."""
    rows = []
    stream = cp.cuda.get_current_stream()
    for nbytes in sizes:
        n = nbytes // 4 // SIZE * SIZE  # MPI_Reduce_scatter_block: equal blocks
        block = n // SIZE
        original = np.random.default_rng(RANK).standard_normal(n).astype(np.float32)
        x = cp.asarray(original)
        mine = x[:block].copy()
        seg, gathered = cp.empty(block, cp.float32), cp.empty(n, cp.float32)
        host_x, host_seg = host_buffer(n), host_buffer(block)
        host_mine, host_all = host_buffer(block), host_buffer(n)

        def mpi_reduce_scatter():
            x.get(out=host_x)
            world.Reduce_scatter_block(host_x, host_seg, op=MPI.SUM)
            seg.set(host_seg)

        def mpi_allgather():
            mine.get(out=host_mine)
            world.Allgather(host_mine, host_all)
            gathered.set(host_all)

        def mpi_broadcast():
            if RANK == 0:
                x.get(out=host_x)
            world.Bcast(host_x, root=0)
            if RANK != 0:
                x.set(host_x)

        cases = {
            "reduce_scatter": (lambda c: lambda: c.reduce_scatter(x, out=seg),
                               mpi_reduce_scatter),
            "allgather": (lambda c: lambda: c.allgather(mine, out=gathered), mpi_allgather),
            "broadcast": (lambda c: lambda: c.broadcast(x, root=0), mpi_broadcast),
        }
        for name, (ours, theirs) in cases.items():
            inner = max(1, min(100, (16 << 20) // nbytes))
            times = time_alternating({"ring": synced(stream, ours(comm)),
                                      "ring_device": synced(stream, ours(device_only)),
                                      "host_mpi": synced(stream, theirs)},
                                     repeats=repeats, inner=inner)
            row = {"collective": name, "bytes": n * 4}
            for who, seconds in times.items():
                algbw, busbw = bus_bandwidth(n * 4, seconds, SIZE, name)
                row[who] = {"seconds": seconds, "algbw": algbw, "busbw": busbw}
            rows.append(row)
            say(others_row(row))
        # Each variant's whole result against MPI's, once more after the timing, from
        # this rank's own x again (the timed broadcasts made it root's).
        what = f"of {human_bytes(n * 4)}"
        for name, variant in (("ring", comm), ("ring_device", device_only)):
            x.set(original)
            mpi_reduce_scatter()
            want = seg.copy()
            seg[...] = np.nan
            variant.reduce_scatter(x, out=seg)
            check_result(cp, name, seg, want, "reduce_scatter " + what)
            mpi_allgather()
            want = gathered.copy()
            gathered[...] = np.nan
            variant.allgather(mine, out=gathered)
            check_result(cp, name, gathered, want, "allgather " + what)
            mpi_broadcast()
            want = x.copy()
            x.set(original)
            variant.broadcast(x, root=0)
            check_result(cp, name, x, want, "broadcast " + what)
        del x, mine, seg, gathered, host_x, host_seg, host_mine, host_all
        free_memory(cp)
    return rows


def others_row(r) -> str:
    cells = [r["collective"], human_bytes(r["bytes"])]
    for who in ("ring", "ring_device", "host_mpi"):
        cells += [human_time(r[who]["seconds"]), f"{r[who]['busbw'] / 1e9:.2f} GB/s"]
    cells.append(f"{r['host_mpi']['seconds'] / r['ring']['seconds']:.2f}x")
    return "| " + " | ".join(cells) + " |"


def copy_rate(cp, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of one device-to-device copy of nbytes (bytes copied / time)."""
    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats + 1):
        start.record()
        dst[...] = src
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return nbytes / float(np.median(times[1:]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-bytes", type=byte_size(4, 4), default=1 << 10, metavar="SIZE",
                        help="the first size, doubled up to --max-bytes (e.g. 1K)")
    parser.add_argument("--max-bytes", type=byte_size(4, 4), default=1 << 30, metavar="SIZE",
                        help="the largest size (e.g. 256M)")
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--big-chunk", type=byte_size(1, maximum=rr._core.MAX_CHUNK_BYTES),
                        default=4 << 20, metavar="SIZE",
                        help="a device ring column with this chunk size (e.g. 4M)")
    parser.add_argument("--json", type=output_file())
    parser.add_argument("--markdown", type=output_file())
    parser.add_argument("--plot", type=output_file(plot=True),
                        help="busbw vs size, beside the copy rate")
    parser.add_argument("--no-gloo", action="store_true", help="skip torch's gloo")
    parser.add_argument("--others", action="store_true",
                        help="also reduce_scatter, allgather and broadcast at 64 KiB, "
                             "1 MiB and 16 MiB (in total per rank)")
    parser.add_argument("--replot", metavar="RUN.json",
                        help="only draw --plot from an earlier run's --json (no GPU needed)")
    parser.add_argument("--note", default="", help="added to the plot's title, e.g. 'MPS'")
    args = parser.parse_args()
    if args.min_bytes > args.max_bytes:
        parser.error("--min-bytes is larger than --max-bytes")
    if args.replot:
        need_matplotlib(parser, "--replot")
        try:
            with open(args.replot) as f:
                rows, names, big_chunk = replot_rows(json.load(f))
        except (OSError, ValueError) as e:
            parser.error(f"--replot: {args.replot!r} is not a bench_gpu.py --json run "
                         f"({type(e).__name__}: {e})")
        plot(rows, names, args.plot or "gpu.png", big_chunk, args.note)
        return
    if args.plot:  # on every rank, before any collective: not after the tables on rank 0 only
        need_matplotlib(parser, "--plot")

    try:
        import cupy as cp
    except ImportError as e:
        sys.exit(f"bench_gpu.py needs cupy and a GPU ({e}); --replot RUN.json needs neither")
    if not rr.cuda_available():
        sys.exit(f"no usable GPU: {rr._core.cuda_status()}")
    device = RANK % cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(device).use()
    gloo = None
    if not args.no_gloo:
        try:
            gloo = start_gloo()
            if gloo is not None:
                gloo[0].cuda.set_device(device)
        except Exception as e:  # the table is worth having without this column
            say(f"# gloo left out: {type(e).__name__}: {e}")
            gloo = None
    names = (["ring", "ring_device", "ring_big", "ring_host", "host_mpi"]
             + (["gloo"] if gloo is not None else []))
    ring = rr.Communicator()
    device_only = rr.Communicator()
    big = rr.Communicator(chunk_bytes=args.big_chunk)
    host_only = rr.Communicator()
    for comm, limit in ((device_only, 0), (big, 0), (host_only, 1 << 62)):
        comm._core.device_host_reduce_bytes = limit  # the same on every rank
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    mode = ("CUDA-aware MPI" if ring._cuda_direct() else "staged through pinned host memory")
    say(f"# {SIZE} ranks on {gpu} ({cp.cuda.runtime.getDeviceCount()} GPU(s) here), "
        f"device buffers {mode} ({rr._core.mpi_cuda_aware_reason()}); float32; median of "
        f"{args.repeats}")
    say(f"# MPI: {mpi_library()}")

    rows = []
    header = columns(names, args.big_chunk)
    say(header)
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        n = nbytes // 4
        x = cp.asarray(np.random.default_rng(RANK).standard_normal(n).astype(np.float32))
        out = cp.empty_like(x)
        host_in, host_out = host_buffer(n), host_buffer(n)

        stream = cp.cuda.get_current_stream()

        def staged_by_hand():
            x.get(out=host_in)
            world.Allreduce(host_in, host_out, op=MPI.SUM)
            out.set(host_out)

        def ring_call(comm):
            return synced(stream, lambda: comm.allreduce(x, out=out))

        candidates = {"ring": ring_call(ring), "ring_device": ring_call(device_only),
                      "ring_big": ring_call(big), "ring_host": ring_call(host_only),
                      "host_mpi": synced(stream, staged_by_hand)}
        if gloo is not None:
            torch, dist = gloo
            tensor = torch.from_dlpack(x.copy())  # gloo only reduces in place

            def gloo_call():
                dist.all_reduce(tensor)
                torch.cuda.synchronize()
            candidates["gloo"] = gloo_call
        # Few calls per timed run: a 1 GiB call takes a good part of a second.
        inner = max(1, min(200, (16 << 20) // nbytes))
        times = time_alternating(candidates, repeats=args.repeats, inner=inner)
        # Every candidate's whole result, once more after the timing (whose calls write
        # the same out), against MPI's sum of the same inputs.
        staged_by_hand()
        want = out.copy()
        for name, comm in (("ring", ring), ("ring_device", device_only), ("ring_big", big),
                           ("ring_host", host_only)):
            out[...] = np.nan
            comm.allreduce(x, out=out)
            check_result(cp, name, out, want, f"allreduce of {human_bytes(nbytes)}")
        d2d = copy_rate(cp, nbytes) if RANK == 0 else 0.0
        row = {"bytes": nbytes, "ranks": SIZE, "gpu": gpu, "mode": mode, "d2d_bytes_per_s": d2d}
        for name, seconds in times.items():
            algbw, busbw = bus_bandwidth(nbytes, seconds, SIZE)
            row[name] = {"seconds": seconds, "algbw": algbw, "busbw": busbw}
        rows.append(row)
        say(table_row(row, names))
        del x, out, host_in, host_out, candidates
        tensor = None
        free_memory(cp)
        nbytes *= 4

    others = []
    if args.others:
        say("\n" + OTHERS_HEADER)
        others = other_collectives(cp, ring, device_only, [64 << 10, 1 << 20, 16 << 20],
                                   args.repeats)

    if RANK == 0:
        meta = {"host": platform.node(), "ranks": SIZE, "gpu": gpu, "mode": mode,
                "mpi": mpi_library(), "rows": rows,
                "others": others, "big_chunk": args.big_chunk}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(meta, f, indent=1)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(f"{SIZE} ranks on one {gpu}, {mode}, float32, median of "
                        f"{args.repeats}.\n\n")
                f.write(header + "\n")
                f.writelines(table_row(r, names) + "\n" for r in rows)
                if others:
                    f.write("\n" + OTHERS_HEADER + "\n")
                    f.writelines(others_row(r) + "\n" for r in others)
        if args.plot:
            plot(rows, names, args.plot, args.big_chunk)
    for comm in (ring, device_only, big, host_only):
        comm.close()
    if gloo is not None:
        gloo[1].destroy_process_group()


def replot_rows(run):
    """(rows, the methods measured, the run's chunk size) of an earlier --json run, or
    ValueError saying what is missing."""
    rows = run.get("rows") if isinstance(run, dict) else None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError("no 'rows': a list of one object per size")
    known = set(labels(1))
    names = [k for k, v in rows[0].items() if isinstance(v, dict) and k in known]
    if not names:
        raise ValueError(f"no measured method in its first row (one of {sorted(known)})")
    for row in rows:
        for key in ["bytes", "d2d_bytes_per_s", "ranks", "gpu"]:
            if key not in row:
                raise ValueError(f"a row without {key!r}")
        for key in names:
            if not isinstance(row.get(key), dict) or "busbw" not in row[key]:
                raise ValueError(f"the row of {row['bytes']} bytes has no busbw for {key!r}")
    # The run's own chunk size (runs before it was recorded used the default).
    big_chunk = run.get("big_chunk", 4 << 20)
    if not isinstance(big_chunk, int) or big_chunk < 1:
        raise ValueError(f"big_chunk is {big_chunk!r}")
    return rows, names, big_chunk


def plot(rows, names, path, big_chunk, note=""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    sizes = [r["bytes"] for r in rows]
    label_of = dict(labels(big_chunk), host_mpi="copy to host + MPI_Allreduce + copy back",
                    gloo="torch.distributed gloo (in place)")
    for key in names:
        label = label_of[key]
        forced = key in ("ring_device", "ring_big", "ring_host")  # thin: not what ships
        ax.plot(sizes, [r[key]["busbw"] / 1e9 for r in rows], label=label,
                **(dict(marker=".", linewidth=1, linestyle=":") if forced
                   else dict(marker="o", linewidth=2.5 if key == "ring" else 1.5)))
    ax.plot(sizes, [r["d2d_bytes_per_s"] / 1e9 for r in rows], linestyle="--", color="gray",
            label="device-to-device copy (one GPU)")
    save_size_plot(fig, ax, path, "GB/s (busbw; copy: bytes copied / s)",
                   f"cupy allreduce, float32, {rows[0]['ranks']} ranks on one {rows[0]['gpu']}"
                   + (f", {note}" if note else ""))


if __name__ == "__main__":
    main()
