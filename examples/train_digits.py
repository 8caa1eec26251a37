"""Data-parallel training of a small numpy MLP on scikit-learn's handwritten digits.

    mpiexec -n 2 python -m mpi4py examples/train_digits.py --plot digits.png
    mpiexec -n 2 python -m mpi4py examples/train_digits.py --gpu     # cupy; ranks share the GPUs
    mpiexec -n 2 python -m mpi4py examples/train_digits.py --checkpoint ckpt   # resumable

Every rank holds the same model. Each global batch is cut into one equal shard per
rank; each rank computes the gradient of its shard's mean loss, DistributedOptimizer
averages the gradients over the ranks (the mean loss of the whole batch), and every
rank takes the same step. With the same global batch, 1, 2 or 4 ranks follow the same
loss curve; only the time per step changes.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import pickle
import re
import signal
import sys
import time

# One BLAS thread per rank: the ranks already use every core, and idle BLAS threads
# spinning beside them made this example ten times slower (set before numpy loads).
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ringreduce as rr  # noqa: E402
from mlp import accuracy, init_params, loss_and_grads  # noqa: E402
from ringreduce.compression import PowerSGD  # noqa: E402
from ringreduce.optim import SGD, DistributedOptimizer  # noqa: E402


def load_digits_split(seed: int = 0):
    """8x8 digit images as 64 features in [0, 1]; 80% train, 20% test (fixed split)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float64)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def progress_bar(done: int, total: int, text: str, width: int = 28) -> None:
    if not sys.stderr.isatty():  # a log file gets the per-epoch lines only
        return
    filled = int(width * done / total)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
    sys.stderr.flush()


def save_checkpoint(path: str, checkpoint: dict) -> None:
    """Pickled to path.tmp, then renamed over path: a job killed while writing leaves
    the file path had, never half of one. (The folder is synced too, so that the rename
    is on disk before the ranks agree, after it, that every rank has saved.)"""
    with open(path + ".tmp", "wb") as f:
        pickle.dump(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def on_the_host(state):
    """state (dicts, lists and tuples of arrays and numbers) with every GPU array copied
    to the host: a checkpoint is a numpy file either way, which a run on the CPU can
    resume too (load_state_dict() puts each array where its parameter is)."""
    if isinstance(state, dict):
        return {key: on_the_host(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_the_host(value) for value in state)
    get = getattr(state, "get", None) if hasattr(state, "__cuda_array_interface__") else None
    return get() if callable(get) else state


def slot(pattern: str, rank: int, epoch: int) -> str:
    """The file that a save made in epoch `epoch` (at its end, or partway) goes to.

    Each rank keeps two files, PATTERN.even and PATTERN.odd, and each save replaces the
    one written two epochs before, so the other one, the last epoch's, is never touched.
    That is enough: a rank's saves in epoch e come after all-reduces that no rank gets
    through before every rank has saved epoch e-1 (the stop check after each epoch's
    save; in a resumed job, the agreement on a file of e-1, or of partway into e, that
    every rank has, saved under this same rule). So a job killed at any moment leaves
    every rank with epoch e-1 whole in one file, and in the other e-2 or something
    newer (epoch e, or partway into it: a save there, made where the ranks stop
    together, goes to e's file, and the save at e's end replaces it). A missing .even
    file stands for epoch 0, the start (a rank killed before its first save); a kill
    partway through a save leaves a .tmp file beside the two, which is not read."""
    return f"{pattern.format(rank)}.{'odd' if epoch % 2 else 'even'}"


def position(checkpoint: dict):
    """(epochs done, steps of the next epoch done): where a checkpoint resumes."""
    return checkpoint["epoch"], checkpoint["step"]


def said(where) -> str:
    """A position (epochs done, steps of the next done) in words: "epoch 4", or "10
    steps of epoch 5"."""
    epoch, step = where
    return f"{step} steps of epoch {epoch + 1}" if step else f"epoch {epoch}"


class CheckpointError(RuntimeError):
    """The ranks' checkpoint files do not make one run to resume (raised on every rank)."""


def agree_on_resuming(ring, pattern: str, run: dict):
    """This rank's checkpoint of the newest position (epoch, step) that every rank has
    a file of, of this run; None where that is the start (no files, say). Where a rank
    has a file of another run (or unreadable), or the ranks have no position in
    common, every rank raises alike."""
    mine = {}  # (epoch, step) -> this rank's checkpoint there
    foreign = []  # files of another run, or unreadable: what each holds, in words
    for path in (slot(pattern, ring.rank, 0), slot(pattern, ring.rank, 1)):
        if not os.path.exists(path):
            continue
        try:
            with open(path, "rb") as f:
                checkpoint = pickle.load(f)
            saved_run = checkpoint["run"]
            where = position(checkpoint)
        except Exception as error:
            foreign.append(f"{path} is unreadable ({type(error).__name__}: {error})")
            continue
        differ = [f"{key} {saved_run.get(key)!r} (this run: {value!r})"
                  for key, value in run.items() if saved_run.get(key) != value]
        if differ:
            foreign.append(f"{path} was saved with " + ", ".join(differ))
        else:
            mine[where] = checkpoint
    if not os.path.exists(slot(pattern, ring.rank, 0)):
        mine[(0, 0)] = None  # the start, which every rank can make afresh
    # One small allgather (mpi4py's, of Python objects), so that every rank sees every
    # rank's files and takes the same decision: a rank that resumed alone, or from
    # another epoch, would make other collective calls than the rest, which would wait
    # for it until they timed out.
    views = ring.mpi_comm.allgather((sorted(mine), foreign))
    common = set.intersection(*(set(positions) for positions, _ in views))
    if common and not any(bad for _, bad in views):
        return mine[max(common)]
    ranks = "; ".join(f"rank {r}: " + ", ".join(
        bad + [said(p) if p != (0, 0) else f"the start (no {slot(pattern, r, 0)})"
               for p in positions])
        for r, (positions, bad) in enumerate(views))
    why = "are not all of this run" if any(bad for _, bad in views) else \
        "have no epoch in common"
    raise CheckpointError(f"rank {ring.rank}: the ranks' checkpoints {why} ({ranks}): "
                          f"delete {pattern.format('*')}.* to start afresh, or give each "
                          "rank its files of this run")


def use_a_gpu(comm):
    """cupy, with this rank on one of its machine's GPUs (ranks may share one)."""
    try:
        import cupy
    except ImportError:
        raise RuntimeError("gpu=True (--gpu) needs cupy, e.g. pip install cupy-cuda12x") from None
    if not rr.cuda_available():
        raise RuntimeError(f"gpu=True (--gpu) needs a usable GPU: {rr._core.cuda_status()}")

    local = comm.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    cupy.cuda.Device(local.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    local.Free()
    return cupy


def train(epochs=30, global_batch=64, lr=0.1, momentum=0.9, hidden=64, compression=None,
          overlap=True, comm=None, quiet=False, seed=0, gpu=False, checkpoint=None,
          stop_check_every=10):
    """Trains on every rank of comm; returns the history (same on every rank).
    gpu: the model and data are cupy arrays, and gradients go through the GPU ring.
    checkpoint: each rank saves its state after every epoch to its own two files,
    checkpoint.rank{r}-of-{size}.even and .odd (the epoch's parity), and resumes from
    the newest epoch that every rank has; on SIGTERM the ranks stop together, saved,
    within stop_check_every steps, and the history returned ends with the last whole
    epoch, and with "stopped_at" (epochs done, steps of the next done) where unfinished.
    (From the main thread only: it installs a signal handler.)"""
    if not isinstance(comm, rr.Communicator):  # one of our own, closed when done
        with rr.Communicator(comm) as ring:  # (left unclosed if training raises)
            return train(epochs, global_batch, lr, momentum, hidden, compression, overlap,
                         ring, quiet, seed, gpu, checkpoint, stop_check_every)
    ring = comm
    rank, size = ring.rank, ring.size
    if global_batch % size:
        raise ValueError(f"the global batch ({global_batch}) must divide evenly among "
                         f"{size} ranks")
    if stop_check_every < 1:
        raise ValueError(f"stop_check_every must be at least 1, not {stop_check_every}")
    shard = global_batch // size
    xp = use_a_gpu(ring) if gpu else np
    x_train, y_train, x_test, y_test = (xp.asarray(a) for a in load_digits_split())
    params = [xp.asarray(p) for p in  # differ on purpose...
              init_params((64, hidden, hidden, 10), seed=seed + rank)]
    opt = DistributedOptimizer(SGD(params, lr=lr, momentum=momentum), comm=ring,
                               bucket_mb=0.01, compression=compression)
    opt.broadcast_parameters(root=0)  # ...until rank 0's are broadcast to all
    steps_per_epoch = len(y_train) // global_batch
    history = {"ranks": size, "global_batch": global_batch, "compression": str(compression),
               "device": "GPU (cupy)" if gpu else "CPU (numpy)",
               "epoch": [], "loss": [], "train_accuracy": [], "test_accuracy": [],
               "seconds": [], "comm_seconds": []}
    first_epoch, first_step, so_far = 1, 0, None
    if checkpoint:
        # The settings a checkpoint must have been saved with to go on bit for bit
        # (not epochs: a run may be resumed to go on further than it was meant to).
        run = {"ranks": size, "global_batch": global_batch, "lr": lr,
               "momentum": momentum, "hidden": hidden, "compression": str(compression),
               "seed": seed}
        pattern = f"{checkpoint}.rank{{}}-of-{size}"
        saved = agree_on_resuming(ring, pattern, run)
        if saved is not None:
            opt.load_state_dict(saved["state"])  # collective: every rank, here
            for p, q in zip(params, saved["params"]):
                p[...] = xp.asarray(q)
            opt.bytes_sent = saved["bytes_sent"]  # (a count for the history, going on)
            history, first_epoch = saved["history"], saved["epoch"] + 1
            first_step, so_far = saved["step"], saved["epoch_so_far"]
            if rank == 0 and not quiet:
                sys.stderr.write(f"resuming after {said(position(saved))}, from "
                                 f"{pattern.format('*')}.*\n")
        elif rank == 0 and not quiet:
            # Another run's files, saved on another number of ranks, are not this run's
            # (each rank resumes its own shard's state): say so, rather than start over
            # without a word beside them.
            found = (re.match(r"\.rank\d+-of-(\d+)\.", name[len(checkpoint):])
                     for name in glob.glob(f"{glob.escape(checkpoint)}.rank*-of-*.*"))
            others = sorted({int(match.group(1)) for match in found if match} - {size})
            if others:
                counts = " or ".join(str(n) for n in others)
                sys.stderr.write(f"note: {checkpoint} has checkpoints of a run on {counts} "
                                 f"ranks, which resumes on that many only; this run on "
                                 f"{size} starts afresh (and saves its own beside them)\n")
        # The handler only sets a flag. The signal lands anywhere, often partway through
        # a step, where state_dict() is refused (the step's all-reduces may be in
        # flight); and a rank that saved and left at once would make other collective
        # calls than the others, which would wait for it until they timed out. The ranks
        # act on the flag together, between steps (below).
        stop = []
        previous_handler = signal.signal(signal.SIGTERM, lambda *_: stop.append(True))

        def stop_agreed():
            # Stop where any rank got SIGTERM: one tiny all-reduce, so that all of them
            # leave at the same step.
            return bool(ring.allreduce(np.array(len(stop) > 0, np.int32), op="max"))

        def save(epoch, steps_done, losses, start, comm_before):
            # A save partway into an epoch holds what the rest of the epoch needs: the
            # step to go on from, and the losses of the steps done (for the epoch's
            # mean). The shuffle needs nothing: it is made from the seed and the epoch.
            whole = steps_done == steps_per_epoch
            save_checkpoint(slot(pattern, rank, epoch), {
                "run": run, "epoch": epoch if whole else epoch - 1,
                "step": 0 if whole else steps_done, "params": on_the_host(params),
                "state": on_the_host(opt.state_dict()), "bytes_sent": opt.bytes_sent,
                "history": history, "epoch_so_far": None if whole else {
                    "losses": losses, "seconds": time.perf_counter() - start,
                    "comm_seconds": opt.comm_seconds - comm_before}})
    try:
        for epoch in range(first_epoch, epochs + 1):
            # A generator made afresh each epoch, from the seed and the epoch alone: a
            # resumed run shuffles as the uninterrupted one did with no RNG state saved.
            order = np.random.default_rng(seed * 1000 + epoch).permutation(len(y_train))
            start, comm_before, losses = time.perf_counter(), opt.comm_seconds, []
            if epoch == first_epoch and so_far:  # resumed partway into this epoch
                losses = list(so_far["losses"])
                start, comm_before = start - so_far["seconds"], comm_before - so_far[
                    "comm_seconds"]
            stopped = False
            for step in range(first_step if epoch == first_epoch else 0, steps_per_epoch):
                batch = order[step * global_batch:(step + 1) * global_batch]
                mine = xp.asarray(batch[rank * shard:(rank + 1) * shard])
                if overlap:  # each gradient's bucket starts all-reducing while backward goes on
                    loss, _ = loss_and_grads(params, x_train[mine], y_train[mine],
                                             on_grad=opt.grad_ready)
                    opt.step()
                else:
                    loss, grads = loss_and_grads(params, x_train[mine], y_train[mine])
                    opt.step(grads)
                losses.append(loss)
                if rank == 0 and not quiet:
                    progress_bar(step + 1, steps_per_epoch, f"epoch {epoch}/{epochs}")
                # Every stop_check_every steps too, not at epoch ends only: a cluster's
                # grace period after SIGTERM may be shorter than an epoch. (Not every
                # step: each check makes the ranks wait for the slowest one.)
                if (checkpoint and (step + 1) % stop_check_every == 0
                        and step + 1 < steps_per_epoch and stop_agreed()):
                    save(epoch, step + 1, losses, start, comm_before)
                    history["stopped_at"] = (epoch - 1, step + 1)
                    stopped = True
                    break
            if stopped:
                break
            # The batch loss averaged over ranks: the mean loss of every global batch.
            epoch_loss = ring.allreduce(np.array(np.mean(losses)), op="avg").item()
            history["epoch"].append(epoch)
            history["loss"].append(epoch_loss)
            history["train_accuracy"].append(accuracy(params, x_train, y_train))
            history["test_accuracy"].append(accuracy(params, x_test, y_test))
            history["seconds"].append(time.perf_counter() - start)
            history["comm_seconds"].append(opt.comm_seconds - comm_before)
            if rank == 0 and not quiet:
                sys.stderr.write(
                    ("\r" if sys.stderr.isatty() else "")
                    + f"epoch {epoch:>3}/{epochs}  loss {epoch_loss:.4f}  "
                    f"train acc {history['train_accuracy'][-1]:.3f}  "
                    f"test acc {history['test_accuracy'][-1]:.3f}  "
                    f"{history['seconds'][-1] * 1e3:.0f} ms "
                    f"({history['comm_seconds'][-1] / history['seconds'][-1]:.0%} waiting on "
                    "communication)\n")
            if checkpoint:
                save(epoch, steps_per_epoch, losses, start, comm_before)
                # (After every epoch's save, even with no SIGTERM: the two-file scheme
                # needs every rank's save to be done before any rank writes the next.)
                if stop_agreed():
                    if epoch < epochs:
                        history["stopped_at"] = (epoch, 0)
                    break
    finally:
        if checkpoint:
            signal.signal(signal.SIGTERM, previous_handler)
    history["bytes_sent_per_rank"] = opt.bytes_sent
    history["final_params_checksum"] = float(sum(float(abs(p).sum()) for p in params))
    return history


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--compression", choices=["none", "fp16", "bf16", "powersgd"],
                        default="none")
    parser.add_argument("--no-overlap", action="store_true",
                        help="step(grads) after backward instead of grad_ready during it")
    parser.add_argument("--gpu", action="store_true",
                        help="train on the GPU: cupy arrays, gradients through the GPU ring")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save every epoch to PATH.rank{r}-of-{size}.even or .odd (by "
                             "the epoch's parity: each rank keeps its last two), resume "
                             "from the newest epoch every rank has, and on SIGTERM stop "
                             "within 10 steps, saved (partway into an epoch too)")
    parser.add_argument("--json", help="write the history here")
    parser.add_argument("--plot", help="save the loss and accuracy curves here (PNG)")
    args = parser.parse_args()
    # Checked here, on every rank alike, before anything collective: a usage error, not
    # a traceback (or a run of 0 steps) on every rank. Printed by rank 0 only, and the
    # others exit after it has (under `-m mpi4py` a rank's exit status 2 aborts the job).
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if rank != 0:
        parser.print_usage = parser.print_help = lambda file=None: None

    def exit_together(status=0, message=None):
        if rank == 0 and message:
            sys.stderr.write(message)
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Barrier()
        sys.exit(status)
    parser.exit = exit_together
    train_samples = int(0.8 * 1797)  # (load_digits_split's cut of the 1,797 images)
    if args.epochs < 1 or args.hidden < 1:
        parser.error("--epochs and --hidden must be at least 1")
    if not 0 < args.lr < math.inf or not 0 <= args.momentum < math.inf:
        parser.error("--lr must be a number above 0, and --momentum one of 0 or more")
    if not 1 <= args.global_batch <= train_samples:
        parser.error(f"--global-batch must be from 1 to {train_samples} (the training images)")
    if args.global_batch % size:
        below = args.global_batch - args.global_batch % size
        fits = [b for b in (below, below + size) if 1 <= b <= train_samples]
        parser.error(f"--global-batch {args.global_batch} does not divide evenly among "
                     f"{size} ranks (every rank takes an equal shard); try "
                     + " or ".join(f"--global-batch {b}" for b in fits))
    for path in (args.json, args.plot, args.checkpoint):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"the folder of {path!r} does not exist")
    compression = {"none": None, "fp16": "fp16", "bf16": "bf16",
                   "powersgd": PowerSGD(rank=4)}[args.compression]
    try:
        history = train(args.epochs, args.global_batch, args.lr, args.momentum, args.hidden,
                        compression, overlap=not args.no_overlap, gpu=args.gpu,
                        checkpoint=args.checkpoint)
    except CheckpointError as error:  # (raised on every rank alike)
        parser.error(str(error))
    if rank != 0:
        return
    if "stopped_at" in history:  # (SIGTERM; saved there)
        print(f"\nstopped by SIGTERM after {said(history['stopped_at'])} of {args.epochs}, "
              f"saved in {args.checkpoint}.rank*-of-{size}.*: the same command goes on")
        return
    total, waiting = sum(history["seconds"]), sum(history["comm_seconds"])
    print(f"\n{history['ranks']} rank(s) on {history['device']}, "
          f"global batch {history['global_batch']}, "
          f"compression {args.compression}: final test accuracy "
          f"{history['test_accuracy'][-1]:.3f}, final loss {history['loss'][-1]:.4f}")
    print(f"time: {total:.2f} s training, of which {waiting:.2f} s ({waiting / total:.0%}) "
          f"waiting on communication and {total - waiting:.2f} s computing; "
          f"{history['bytes_sent_per_rank'] / 1e6:.2f} MB handed to all-reduce per rank")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(history, f, indent=1)
    if args.plot:
        plot_histories([history], args.plot)


def plot_histories(histories, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    styles = ["-", "--", ":", "-."]  # curves that coincide stay visible
    for k, h in enumerate(histories):
        label = f"{h['ranks']} rank(s)" + ("" if h["compression"] == "None"
                                           else f", {h['compression']}")
        style = dict(linestyle=styles[k % len(styles)], linewidth=2.5 - 0.5 * (k % 3))
        left.plot(h["epoch"], h["loss"], label=label, **style)
        right.plot(h["epoch"], h["test_accuracy"], label=label, **style)
    left.set_xlabel("epoch")
    left.set_ylabel("training loss (mean cross-entropy)")
    left.set_yscale("log")
    right.set_xlabel("epoch")
    right.set_ylabel("test accuracy")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"numpy MLP on scikit-learn digits, global batch {histories[0]['global_batch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
