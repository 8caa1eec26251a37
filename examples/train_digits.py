"""Data-parallel training of a small numpy MLP on scikit-learn's handwritten digits.

    mpiexec -n 2 python -m mpi4py examples/train_digits.py --plot digits.png
    mpiexec -n 2 python -m mpi4py examples/train_digits.py --gpu     # cupy; ranks share the GPUs

Every rank holds the same model. Each global batch is cut into one equal shard per
rank; each rank computes the gradient of its shard's mean loss, DistributedOptimizer
averages the gradients over the ranks (the mean loss of the whole batch), and every
rank takes the same step. With the same global batch, 1, 2 or 4 ranks follow the same
loss curve; only the time per step changes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
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
          overlap=True, comm=None, quiet=False, seed=0, gpu=False):
    """Trains on every rank of comm; returns the history (same on every rank).
    gpu: the model and data are cupy arrays, and gradients go through the GPU ring."""
    if not isinstance(comm, rr.Communicator):  # one of our own, closed when done
        with rr.Communicator(comm) as ring:  # (left unclosed if training raises)
            return train(epochs, global_batch, lr, momentum, hidden, compression, overlap,
                         ring, quiet, seed, gpu)
    ring = comm
    rank, size = ring.rank, ring.size
    if global_batch % size:
        raise ValueError(f"the global batch ({global_batch}) must divide evenly among "
                         f"{size} ranks")
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
    for epoch in range(1, epochs + 1):
        order = np.random.default_rng(seed * 1000 + epoch).permutation(len(y_train))
        start, comm_before, losses = time.perf_counter(), opt.comm_seconds, []
        for step in range(steps_per_epoch):
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
                ("\r" if sys.stderr.isatty() else "") + f"epoch {epoch:>3}/{epochs}  loss {epoch_loss:.4f}  "
                f"train acc {history['train_accuracy'][-1]:.3f}  "
                f"test acc {history['test_accuracy'][-1]:.3f}  "
                f"{history['seconds'][-1] * 1e3:.0f} ms "
                f"({history['comm_seconds'][-1] / history['seconds'][-1]:.0%} waiting on "
                "communication)\n")
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
    for path in (args.json, args.plot):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"the folder of {path!r} does not exist")
    compression = {"none": None, "fp16": "fp16", "bf16": "bf16",
                   "powersgd": PowerSGD(rank=4)}[args.compression]
    history = train(args.epochs, args.global_batch, args.lr, args.momentum, args.hidden,
                    compression, overlap=not args.no_overlap, gpu=args.gpu)
    if rank != 0:
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
