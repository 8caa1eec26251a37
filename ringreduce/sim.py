"""All-reduce at any scale, without a cluster: bytes, steps and modelled time.

    python -m ringreduce sim --ranks 1024 --bytes 100M [--alpha 5e-6 --beta 1e-10 --gamma 1e-10]

The ring is simulated by running ringreduce's own RingSchedule (the C++ class the core
runs) for every virtual rank, step by step, so the traffic it reports is the traffic the
core sends (tests/mpi/test_sim.py holds the two to the same bytes and steps). Two
classic alternatives are modelled beside it:

- naive: every rank sends its buffer to a root, which reduces and sends the result back
  to each rank, one after the other (a parameter server with one server);
- recursive doubling: log2(p) rounds, each exchanging the whole buffer with a partner
  (ranks beyond the largest power of two fold in first and get the result last).

Time follows the alpha-beta-gamma model: a step costs alpha + (bytes moved) * beta +
(bytes reduced) * gamma, steps in sequence; see docs/cost-model.md.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from . import _core

# The ring is simulated rank by rank and step by step: p * 2(p-1) segments, some 15 s
# for 2048 ranks. The formulas of docs/cost-model.md take any p.
MAX_RANKS = 4096

# Defaults of the order of one machine's shared memory (fitted on the development
# machine, see docs/performance.md); pass your network's values for a cluster.
ALPHA, BETA, GAMMA = 2e-6, 1.2e-10, 1.6e-10


@dataclass
class Result:
    algorithm: str
    ranks: int
    nbytes: int
    steps: int
    bytes_sent: list  # per rank
    bytes_received: list  # per rank
    seconds: float  # modelled

    @property
    def max_bytes_sent(self) -> int:
        return max(self.bytes_sent)


def ring(ranks: int, count: int, elem_size: int = 4, alpha=ALPHA, beta=BETA,
         gamma=GAMMA) -> Result:
    """Runs RingSchedule for every virtual rank: what the core would send and when."""
    schedules = [_core.RingSchedule(r, ranks, count, max(1, count)) for r in range(ranks)]
    sent = [0] * ranks
    received = [0] * ranks
    seconds, steps = 0.0, 0
    for phase, reduces in (("reduce_scatter", True), ("allgather", False)):
        send_of = getattr(_core.RingSchedule, f"{phase}_send_segment")
        recv_of = getattr(_core.RingSchedule, f"{phase}_recv_segment")
        for k in range(schedules[0].steps_per_phase):
            slowest = 0
            for s in schedules:
                out = s.segment(send_of(s, k))[1] * elem_size
                sent[s.rank] += out
                received[s.right] += out
                assert recv_of(schedules[s.right], k) == send_of(s, k)  # the ring matches up
                slowest = max(slowest, out)
            # Every rank works at once; a step lasts as long as its largest segment.
            seconds += alpha + slowest * beta + (slowest * gamma if reduces else 0.0)
            steps += 1
    return Result("ring", ranks, count * elem_size, steps, sent, received, seconds)


def naive(ranks: int, count: int, elem_size: int = 4, alpha=ALPHA, beta=BETA,
          gamma=GAMMA) -> Result:
    """Reduce to rank 0, then send the result to every rank, one message at a time."""
    n = count * elem_size
    sent = [n] * ranks
    received = [n] * ranks
    sent[0], received[0] = (ranks - 1) * n, (ranks - 1) * n
    steps = 2 * (ranks - 1)
    seconds = steps * alpha + 2 * (ranks - 1) * n * beta + (ranks - 1) * n * gamma
    if ranks == 1:
        sent, received = [0], [0]
    return Result("naive", ranks, n, steps, sent, received, seconds)


def recursive_doubling(ranks: int, count: int, elem_size: int = 4, alpha=ALPHA, beta=BETA,
                       gamma=GAMMA) -> Result:
    n = count * elem_size
    power = 1 << (ranks.bit_length() - 1)
    extra = ranks - power  # these fold into a partner first and get the result last
    rounds = int(math.log2(power))
    steps = rounds + (2 if extra else 0)
    sent = [rounds * n] * ranks
    received = [rounds * n] * ranks
    for r in range(extra):  # rank power + r pairs with rank r
        sent[power + r], received[power + r] = n, n
        sent[r] += n
        received[r] += n
    seconds = rounds * (alpha + n * beta + n * gamma)
    if extra:
        seconds += 2 * (alpha + n * beta) + n * gamma
    return Result("recursive doubling", ranks, n, steps, sent, received, seconds)


ALGORITHMS = {"ring": ring, "naive": naive, "recursive-doubling": recursive_doubling}


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringreduce sim",
                                     description="Model all-reduce algorithms at any scale.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 64, 1024],
                        help="ring sizes to model, one row each")
    parser.add_argument("--bytes", default="100M",
                        help="buffer size per rank, e.g. 8, 64K, 100M (K, M, G: powers of 1024)")
    parser.add_argument("--alpha", type=float, default=ALPHA, help="seconds per message")
    parser.add_argument("--beta", type=float, default=BETA, help="seconds per byte moved")
    parser.add_argument("--gamma", type=float, default=GAMMA, help="seconds per byte reduced")
    args = parser.parse_args(argv)
    try:
        nbytes = parse_bytes(args.bytes)
    except (ValueError, OverflowError):
        parser.error(f"--bytes: {args.bytes!r} is not a size (e.g. 8, 64K, 100M, 1.5G)")
    if any(p < 1 for p in args.ranks) or nbytes < 0:
        parser.error("ranks must be >= 1 and bytes >= 0")
    if max(args.ranks) > MAX_RANKS:
        parser.error(f"--ranks: at most {MAX_RANKS} (the ring is simulated rank by rank, step "
                     "by step; for more, the formulas in docs/cost-model.md)")
    if nbytes % 4:
        parser.error(f"--bytes: {nbytes} is not a whole number of float32 elements (4 bytes)")
    for name in ("alpha", "beta", "gamma"):
        if not 0 <= getattr(args, name) < float("inf"):  # (NaN too)
            parser.error(f"--{name} must be a finite number of seconds >= 0")
    count = nbytes // 4
    print(f"all-reduce of {nbytes} bytes (float32) per rank; alpha={args.alpha:g} s, "
          f"beta={args.beta:g} s/B, gamma={args.gamma:g} s/B")
    print("| ranks | algorithm | steps | most bytes sent by one rank | modelled time |")
    print("|---|---|---|---|---|")
    for p in args.ranks:
        for name, fn in ALGORITHMS.items():
            r = fn(p, count, 4, args.alpha, args.beta, args.gamma)
            print(f"| {p} | {r.algorithm} | {r.steps} | {r.max_bytes_sent:,} | "
                  f"{r.seconds * 1e3:.3f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
