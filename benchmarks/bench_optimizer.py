"""DistributedOptimizer's step beside the same step written with MPI instead, timed in
one run:

    mpiexec -n 2 python -m mpi4py benchmarks/bench_optimizer.py --json out.json

A model is --models, each COUNTxSIZE: COUNT float32 parameters of SIZE bytes each; the
optimizer is --optimizer: sgd (lr 0.01, momentum 0.9) or adam (lr 0.001, betas (0.9,
0.999), eps 1e-8). A step averages one gradient per parameter across the ranks, then
updates every parameter with it. Every candidate has parameters and state of its own,
starting alike:

- ringreduce: opt.step(grads), opt = DistributedOptimizer(SGD(params, ...), comm) (or
  Adam; ringreduce.optim's, buckets of 25 MB, the default);
- ringreduce grad_ready: opt.grad_ready(i, g) for each gradient, last first (the order
  backward produces them, as a hook on each parameter reports them), then opt.step();
- MPI by hand: the gradients packed into one buffer made once (numpy.concatenate into
  it), MPI_Allreduce in place, a division by p, then the update written in numpy on
  views of that buffer (made once): SGD's buf *= momentum; buf += g; p -= lr * buf, or
  Adam's two moments and p -= lr * (m / (1 - b1 ** t)) / (sqrt(v / (1 - b2 ** t)) + eps):
  the usual step by hand;
- ringreduce update alone: ringreduce's SGD or Adam given the averaged gradients,
  without any communication: the floor under ringreduce's two (what its update costs);
- numpy update alone: MPI by hand's update, given the averaged gradients: the floor
  under MPI by hand. Each side's time less its floor is what averaging costs it.

Rank r's gradient of each parameter is (r + 1) times that parameter's fixed values, in
multiples of 1/64 up to 1, so that every sum and average is exact in float32 whatever
order the ranks add in: every candidate averages to the same bits, every step. After
the timing (whose untimed warm-up may stop at a different step for each candidate),
each candidate takes the steps it lacks, up to the same count, and its parameters are
checked: the same bits on every rank (a candidate that did not average differs), within
float32 rounding of ringreduce update alone's (one that missed a step, or updated
otherwise, differs), and that one's within 1e-3 of the closed form of as many steps of a
constant gradient (one that did nothing, or got the wrong average, differs). Timed
alternately, run by run; reported: the median time per step (the slowest rank's), and
the speedup of ringreduce's two over MPI by hand (MPI by hand's time / theirs).
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import ringreduce as rr
from ringreduce.optim import SGD, Adam, DistributedOptimizer
from bench_allreduce import progress
from bench_gradients import models_argument, models_table
from timing import at_least, human_bytes, output_file, \
    time_alternating, write_json

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()

DEFAULT_MODELS = "200x1K,48x64K,8x1M"

# Each optimizer's settings, the same for every candidate.
SETTINGS = {"sgd": {"lr": 0.01, "momentum": 0.9},
            "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}}

PEER, FLOOR, NUMPY_FLOOR = "MPI by hand", "ringreduce update alone", "numpy update alone"


class Model:
    """COUNT float32 parameters of SIZE bytes, as every rank starts them, this rank's
    gradients, and their average over the ranks (exact: see the docstring)."""

    def __init__(self, count: int, nbytes: int):
        elements = nbytes // 4
        rng = np.random.default_rng(7)  # (the same on every rank)
        self.start = [rng.standard_normal(elements).astype(np.float32) for _ in range(count)]
        self.values = [(rng.integers(-64, 65, elements) / 64).astype(np.float32)
                       for _ in range(count)]
        self.grads = [np.float32(rank + 1) * v for v in self.values]
        self.average = [np.float32((size + 1) / 2) * v for v in self.values]

    def params(self) -> list:
        return [p.copy() for p in self.start]


def optimizer_of(name: str, params):
    return (SGD if name == "sgd" else Adam)(params, **SETTINGS[name])


def update_by_hand(optimizer: str, params: list):
    """The update as one writes it in numpy: a function of the averaged gradients that
    updates `params` in place, with state of its own."""
    if optimizer == "sgd":
        lr, momentum = SETTINGS["sgd"]["lr"], SETTINGS["sgd"]["momentum"]
        bufs = [np.zeros_like(p) for p in params]

        def sgd(grads):
            for p, g, buf in zip(params, grads, bufs):
                buf *= momentum
                buf += g
                p -= lr * buf
        return sgd
    lr, (b1, b2), eps = (SETTINGS["adam"][k] for k in ("lr", "betas", "eps"))
    ms = [np.zeros_like(p) for p in params]
    vs = [np.zeros_like(p) for p in params]
    t = [0]

    def adam(grads):
        t[0] += 1
        c1, c2 = 1 - b1 ** t[0], 1 - b2 ** t[0]
        for p, g, m, v in zip(params, grads, ms, vs):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p -= lr * (m / c1) / (np.sqrt(v / c2) + eps)
    return adam


def candidates(comm, model: Model, optimizer: str) -> tuple[dict, dict, dict]:
    """({name: one step}, {name: the parameters it updates}, {name: steps taken}), each
    with parameters and state of its own."""
    steps = {}
    stepped = {}

    def counted(name, params, step):
        steps[name] = 0
        stepped[name] = params

        def one_step():
            step()
            steps[name] += 1
        return name, one_step

    found = []
    grads, count = model.grads, len(model.grads)

    ours = DistributedOptimizer(optimizer_of(optimizer, model.params()), comm)
    found.append(counted("ringreduce", ours.params, lambda: ours.step(grads)))

    hooked = DistributedOptimizer(optimizer_of(optimizer, model.params()), comm)

    def grad_ready():
        for i in reversed(range(count)):
            hooked.grad_ready(i, grads[i])
        hooked.step()
    found.append(counted("ringreduce grad_ready", hooked.params, grad_ready))

    params = model.params()
    flat = np.empty(sum(g.size for g in grads), np.float32)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.size].reshape(p.shape))
        offset += p.size
    update = update_by_hand(optimizer, params)

    def by_hand():
        np.concatenate(grads, out=flat)
        world.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        np.divide(flat, size, out=flat)
        update(views)
    found.append(counted(PEER, params, by_hand))

    numpy_alone = model.params()
    update_alone = update_by_hand(optimizer, numpy_alone)
    found.append(counted(NUMPY_FLOOR, numpy_alone, lambda: update_alone(model.average)))

    alone = optimizer_of(optimizer, model.params())
    found.append(counted(FLOOR, alone.params, lambda: alone.step(model.average)))
    return dict(found), stepped, steps


def catch_up(timed: dict, steps: dict) -> int:
    """Steps each candidate up to the count of the one that took the most (the same on
    every rank: the warm-up decides collectively where to stop); that count."""
    most = max(steps.values())
    for name, step in timed.items():
        while steps[name] < most:
            step()
    return most


def expected(model: Model, optimizer: str, steps: int) -> list:
    """The parameters after `steps` steps with the average as every step's gradient,
    in float64, from the closed form: SGD's buffer after k steps is g (1 - m^k) / (1 - m);
    Adam's m / (1 - b1^t) is g and v / (1 - b2^t) is g^2 at every step."""
    settings = SETTINGS[optimizer]
    out = []
    for p, g in zip(model.start, model.average):
        p, g = p.astype(np.float64), g.astype(np.float64)
        if optimizer == "sgd":
            m = settings["momentum"]
            total = (steps - m * (1 - m ** steps) / (1 - m)) / (1 - m)
            out.append(p - settings["lr"] * total * g)
        else:
            out.append(p - steps * settings["lr"] * g / (np.abs(g) + settings["eps"]))
    return out


def check_stepped(model: Model, optimizer: str, stepped: dict, steps: dict,
                  label: str) -> None:
    """Every candidate took as many steps as the others and left the same parameters:
    the same bits on every rank, those of ringreduce update alone within float32's
    rounding, and that one's those of the closed form (see the docstring)."""
    taken = steps[FLOOR]
    want = np.concatenate([p.ravel() for p in expected(model, optimizer, taken)])
    start = np.concatenate([p.ravel() for p in model.start]).astype(np.float64)
    moved = np.abs(want - start).max()
    floor = np.concatenate([p.ravel() for p in stepped[FLOOR]])
    wrong = {}
    if not np.allclose(floor, want, rtol=0, atol=1e-3 * moved + 1e-6):
        wrong[FLOOR] = (f"{np.abs(floor - want).max():.3g} away from the closed form of "
                        f"{taken} steps, which moved {moved:.3g}")
    for name, params in stepped.items():
        mine = np.concatenate([p.ravel() for p in params])
        bits = mine.view(np.int32)
        low, high = bits.copy(), bits.copy()
        world.Allreduce(MPI.IN_PLACE, low, op=MPI.MIN)
        world.Allreduce(MPI.IN_PLACE, high, op=MPI.MAX)
        if steps[name] != taken:
            wrong[name] = f"{steps[name]} steps where {FLOOR} took {taken}"
        elif not (low == high).all():
            wrong[name] = "not the same bits on every rank"
        elif name != FLOOR and not np.allclose(mine, floor, rtol=1e-5, atol=1e-6):
            wrong[name] = f"{np.abs(mine - floor).max():.3g} away from {FLOOR}'s"
    everyone = world.allgather(wrong)
    wrong = {name: why for theirs in everyone for name, why in theirs.items()}
    if wrong:
        raise SystemExit(f"rank {rank}: {label}: wrong results from "
                         + "; ".join(f"{name} ({why})" for name, why in wrong.items()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rank 0 prints the table. The defaults take about a minute on 2 ranks.")
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma-separated COUNTxSIZE (default: {DEFAULT_MODELS})")
    parser.add_argument("--optimizer", choices=sorted(SETTINGS), default="sgd",
                        help="the update (default: sgd)")
    parser.add_argument("--repeats", type=at_least(1), default=15,
                        help="timed runs per model; the median is reported (default: 15)")
    parser.add_argument("--json", type=output_file(), help="write every measurement here")
    args = parser.parse_args()
    models = models_argument(parser, args.models)

    comm = rr.Communicator()
    rows = []
    for done, (count, nbytes) in enumerate(models):
        label = f"{count} x {human_bytes(nbytes)}"
        progress(done, len(models), label)
        calls = max(1, min(50, (32 << 20) // (count * nbytes)))
        model = Model(count, nbytes)
        timed, stepped, steps = candidates(comm, model, args.optimizer)
        times = time_alternating(timed, repeats=args.repeats, inner=calls)
        taken = catch_up(timed, steps)
        check_stepped(model, args.optimizer, stepped, steps, label)
        for name, seconds in times.items():
            rows.append({"parameters": count, "bytes_each": nbytes, "implementation": name,
                         "time_s": seconds, "speedup_vs_mpi": times[PEER] / seconds,
                         "steps_checked": taken})
    progress(len(models), len(models), "done")
    if rank != 0:
        return
    names = list(dict.fromkeys(r["implementation"] for r in rows))
    faster = [n for n in names if n not in (PEER, FLOOR, NUMPY_FLOOR)]
    settings = ", ".join(f"{k} {v}" for k, v in SETTINGS[args.optimizer].items())
    print(f"# {size} ranks, float32, {args.optimizer} ({settings}); median time per step; "
          f"speedup = {PEER}'s time / the other's")
    print(models_table(models, rows, "parameters", names, faster, "speedup_vs_mpi",
                       ["parameters"] + [f"{n} vs {PEER}" for n in faster]))
    if args.json:
        write_json(args.json, ranks=size, dtype="float32", optimizer=args.optimizer,
                   settings=SETTINGS[args.optimizer], repeats=args.repeats, results=rows)


if __name__ == "__main__":
    main()
