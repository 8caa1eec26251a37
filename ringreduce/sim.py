"""All-reduce at any scale, without a cluster: bytes, steps and modelled time.

    python -m ringreduce sim --ranks 1024 --bytes 100M [--alpha 5e-6 --beta 1e-10 --gamma 1e-10]
    python -m ringreduce sim --ranks 3 --bytes 12M --chunk 1M [--timeline pipeline.svg]
    python -m ringreduce sim --ranks 16 --bytes 100M --machines 2 [--placement block]

The ring is simulated by running ringreduce's own RingSchedule (the C++ class the core
runs) for every virtual rank, step by step, so the traffic it reports is the traffic the
core sends (tests/mpi/test_sim.py holds the two to the same bytes and steps). Three
classic alternatives are modelled beside it:

- naive: every rank sends its buffer to a root, which reduces and sends the result back
  to each rank, one after the other (a parameter server with one server);
- recursive doubling: log2(p) rounds, each exchanging the whole buffer with a partner
  (ranks beyond the largest power of two fold in first and get the result last);
- Rabenseifner's: a reduce-scatter by recursive halving (log2(p) rounds, each sending
  half of what is left to a partner and adding the other half of the partner's), then
  an all-gather by recursive doubling (the same rounds backwards, each sending all it
  holds), the large-message all-reduce of MPICH (Thakur, Rabenseifner and Gropp, 2005);
  ranks beyond the largest power of two fold in as above.

Time follows the alpha-beta-gamma model: a step costs alpha + (bytes moved) * beta +
(bytes reduced) * gamma, steps in sequence; see docs/cost-model.md. With --machines, the
ring's links between machines share each machine's network link instead (net_beta per
byte, times the links crossing there at once): the ring in rank order against the one
the core goes round, each machine's ranks side by side.
"""
from __future__ import annotations

import argparse
import math
import operator
import os
import sys
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

import numpy as np

from . import _core

# The ring is simulated rank by rank and step by step: p * 2(p-1) segments, some 10 s
# for 2048 ranks. The formulas of docs/cost-model.md take any p.
MAX_RANKS = 4096
# The other models are worked out for all ranks at once, but still give a count per rank
# (Result.bytes_sent): Rabenseifner's takes a few seconds at this many ranks.
MAX_MODEL_RANKS = 1 << 20

# Defaults: MPI messages between two processes of one machine (alpha and beta fitted
# with mpi4py's Sendrecv, gamma with the core's float32 sum, on the development
# machine: see docs/cost-model.md); pass your network's values for a cluster.
ALPHA, BETA, GAMMA = 2e-6, 1.2e-10, 1.6e-10
# With --machines: seconds per byte over one machine's network link, 100 Gb/s.
NET_BETA = 8e-11


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


def _whole(value):
    """value as a Python int where it is an integer (numpy's too: sizes worked out with
    numpy are np.int64), else None; never a bool, a float or a string."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check(ranks, count, elem_size=4) -> tuple:
    """(ranks, count, elem_size) as Python ints, or ValueError naming the one that is not
    what a ring takes."""
    whole = _whole(ranks)
    if whole is None or whole < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    ranks, whole = whole, _whole(count)
    if whole is None or not 0 <= whole < 1 << 62:
        raise ValueError(f"count must be an int from 0 to 2**62 - 1, got {count!r}")
    count, whole = whole, _whole(elem_size)
    if whole is None or whole < 1:
        raise ValueError(f"elem_size must be a positive int (bytes), got {elem_size!r}")
    return ranks, count, whole


def _check_costs(**costs) -> None:
    """ValueError naming the first cost (alpha, beta, ...) that is not a finite number of
    seconds >= 0 (as the command line's: a negative one made negative times)."""
    for name, value in costs.items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)) \
                or not 0 <= value < math.inf:  # (NaN too)
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


def _at_most(ranks: int, most: int, model: str, why: str) -> None:
    if ranks > most:
        raise ValueError(f"sim.{model}: ranks must be at most {most:,} here, got {ranks:,}: "
                         f"{why}; for more ranks, the formulas in docs/cost-model.md")


def _per_rank(ranks: int, model: str) -> None:
    _at_most(ranks, MAX_MODEL_RANKS, model, "it gives every rank's bytes, a list as long as "
             "the ranks")


def _nothing(algorithm: str, ranks: int) -> Result:
    """No elements: no algorithm moves anything (the core makes no ring steps)."""
    return Result(algorithm, ranks, 0, 0, [0] * ranks, [0] * ranks, 0.0)


def machine_ring_order(machines) -> list:
    """The order the core puts ranks in round the ring, given the machine of each:
    each machine's ranks side by side, machines in the order of their lowest rank."""
    lowest = {}  # machine -> its lowest rank
    for r, machine in enumerate(machines):
        lowest.setdefault(machine, r)
    return sorted(range(len(machines)), key=lambda r: lowest[machines[r]])


def crossings(ring, machines) -> int:
    """How many links of the ring (the ranks in the order they go round) join two
    machines (machines[r]: rank r's)."""
    return sum(machines[ring[q]] != machines[ring[(q + 1) % len(ring)]]
               for q in range(len(ring)))


def placed(ranks: int, machines: int, placement: str) -> list:
    """The machine of each rank, as mpiexec places them: "block" (machine by machine,
    as many ranks on each) or "round-robin" (rank r on machine r mod machines)."""
    ranks, whole = _check(ranks, 0)[0], _whole(machines)
    if whole is None or not 1 <= whole <= ranks:  # (as --machines: one rank each at most)
        raise ValueError(f"machines must be an int from 1 to ranks ({ranks}), got "
                         f"{machines!r}")
    machines = whole
    if placement == "round-robin":
        return [r % machines for r in range(ranks)]
    if placement == "block":
        return [r * machines // ranks for r in range(ranks)]
    raise ValueError(f"placement must be 'block' or 'round-robin', got {placement!r}")


def ring(ranks: int, count: int, elem_size: int = 4, alpha=ALPHA, beta=BETA,
         gamma=GAMMA, progress=None, ring_order=None, machines=None, net_beta=NET_BETA) -> Result:
    """Runs RingSchedule for every virtual rank: what the core would send and when.
    progress, if given, is called as progress(steps done, steps in all) after each step.
    ring_order: the ranks in the order they go round (Communicator.ring; None: rank
    order). machines: the machine of each rank (None: one machine). A link of the ring
    between two machines then takes net_beta per byte (the machine's network link, not
    beta) times the number of the ring's links that share that network link at once,
    on either machine: the cost of a ring that crosses between machines more often than
    it must."""
    ranks, count, elem_size = _check(ranks, count, elem_size)
    _check_costs(alpha=alpha, beta=beta, gamma=gamma, net_beta=net_beta)
    if count and ranks > 1:  # (nothing, or one rank: no steps to simulate)
        _at_most(ranks, MAX_RANKS, "ring", "the ring is simulated rank by rank, step by step, "
                 "p * 2(p-1) segments (some 10 s for 2048 ranks, 40 s for 4096)")
    _per_rank(ranks, "ring")
    if machines is not None and len(machines) != ranks:
        raise ValueError(f"machines: need one per rank ({ranks}), got {len(machines)}")
    if count == 0:
        return _nothing("ring", ranks)
    order = [] if ring_order is None else list(ring_order)  # (a numpy array has no truth)
    schedules = [_core.RingSchedule(r, ranks, count, max(1, count), order) for r in range(ranks)]
    if machines is not None:  # (as numbers from 0, whatever names they had)
        machine_of = np.unique(np.array(machines, dtype=object).astype(str),
                               return_inverse=True)[1].reshape(-1)
    sent = [0] * ranks
    received = [0] * ranks
    seconds, steps = 0.0, 0
    for phase, reduces in (("reduce_scatter", True), ("allgather", False)):
        send_of = getattr(_core.RingSchedule, f"{phase}_send_segment")
        recv_of = getattr(_core.RingSchedule, f"{phase}_recv_segment")
        for k in range(schedules[0].steps_per_phase):
            slowest = 0
            links = []
            for s in schedules:
                out = s.segment(send_of(s, k))[1] * elem_size
                sent[s.rank] += out
                received[s.right] += out
                assert recv_of(schedules[s.right], k) == send_of(s, k)  # the ring matches up
                slowest = max(slowest, out)
                links.append((s.rank, s.right, out))
            if machines is None:
                # Every rank works at once; a step lasts as long as its largest segment.
                seconds += alpha + slowest * beta + (slowest * gamma if reduces else 0.0)
            else:
                seconds += _step_across_machines(links, machine_of, alpha, beta, gamma if
                                                 reduces else 0.0, net_beta)
            steps += 1
            if progress is not None:
                progress(steps, 2 * schedules[0].steps_per_phase)
    return Result("ring", ranks, count * elem_size, steps, sent, received, seconds)


def _step_across_machines(links, machine_of, alpha, beta, gamma, net_beta) -> float:
    """One step's time: its slowest link, where links between machines share each
    machine's network link (out and in) with the others crossing there at once.
    machine_of: each rank's machine as a number from 0 (numpy)."""
    sender, receiver, out = (np.array(column) for column in zip(*links))
    leaves, enters = machine_of[sender], machine_of[receiver]
    crossing = (leaves != enters) & (out > 0)
    machines = int(machine_of.max()) + 1
    leaving = np.bincount(leaves[crossing], minlength=machines)
    arriving = np.bincount(enters[crossing], minlength=machines)
    sharing = np.maximum(leaving[leaves], arriving[enters])
    wire = np.where(leaves != enters, out * net_beta * sharing, out * beta)
    return float(np.max(alpha + wire + out * gamma))


def naive(ranks: int, count: int, elem_size: int = 4, alpha=ALPHA, beta=BETA,
          gamma=GAMMA) -> Result:
    """Reduce to rank 0, then send the result to every rank, one message at a time."""
    ranks, count, elem_size = _check(ranks, count, elem_size)
    _check_costs(alpha=alpha, beta=beta, gamma=gamma)
    _per_rank(ranks, "naive")
    if count == 0:
        return _nothing("naive", ranks)
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
    ranks, count, elem_size = _check(ranks, count, elem_size)
    _check_costs(alpha=alpha, beta=beta, gamma=gamma)
    _per_rank(ranks, "recursive_doubling")
    if count == 0:
        return _nothing("recursive doubling", ranks)
    n = count * elem_size
    power = 1 << (ranks.bit_length() - 1)
    extra = ranks - power  # these fold into a partner first and get the result last
    rounds = int(math.log2(power))
    steps = rounds + (2 if extra else 0)
    # Rank power + r pairs with rank r (lists made whole: a loop took seconds at 10**7).
    sent = [(rounds + 1) * n] * extra + [rounds * n] * (power - extra) + [n] * extra
    received = list(sent)
    seconds = rounds * (alpha + n * beta + n * gamma)
    if extra:
        seconds += 2 * (alpha + n * beta) + n * gamma
    return Result("recursive doubling", ranks, n, steps, sent, received, seconds)


def rabenseifner(ranks: int, count: int, elem_size: int = 4, alpha=ALPHA, beta=BETA,
                 gamma=GAMMA) -> Result:
    """Reduce-scatter by recursive halving, then all-gather by recursive doubling, on the
    largest power of two of ranks; the others fold in first and get the result last.
    Followed element by element: where halves are uneven, a step lasts as long as its
    largest half."""
    ranks, count, elem_size = _check(ranks, count, elem_size)
    _check_costs(alpha=alpha, beta=beta, gamma=gamma)
    _per_rank(ranks, "rabenseifner")
    if count == 0:
        return _nothing("Rabenseifner", ranks)
    n = count * elem_size
    power = 1 << (ranks.bit_length() - 1)
    extra = ranks - power  # rank power + r folds into rank r, as in recursive_doubling
    rounds = power.bit_length() - 1
    seconds = 0.0
    if extra:  # the whole buffer to the partner, which adds it
        seconds += alpha + n * beta + n * gamma
    # Every rank of the power of two at once, as numpy arrays (a round's partners are
    # r XOR distance): a million ranks in a second or two. Elements, not bytes, in int64: a
    # rank sends at most its buffer in each of the two halves (2 * count < 2**63).
    rank = np.arange(power)
    size = np.full(power, count, dtype=np.int64)  # the elements each is still reducing
    sent = np.zeros(power, dtype=np.int64)
    received = np.zeros(power, dtype=np.int64)
    # Halving: at round k the partner is r XOR (power >> k+1); the lower of the two keeps
    # the lower half of the block both hold, and each sends the other its other half.
    for k in range(rounds):
        distance = power >> (k + 1)
        low = size // 2
        upper = (rank & distance) != 0
        give = np.where(upper, low, size - low)
        size = np.where(upper, size - low, low)
        sent += give
        received += give[rank ^ distance]
        seconds += alpha + int(give.max()) * elem_size * (beta + gamma)
    # Doubling: the same rounds backwards; each sends its partner all it now holds, and
    # then holds the block the two shared before that round of the halving.
    for k in reversed(range(rounds)):
        distance = power >> (k + 1)
        sent += size
        received += size[rank ^ distance]
        seconds += alpha + int(size.max()) * elem_size * beta
        size = size + size[rank ^ distance]
    # In bytes, as Python's ints; a rank that folded in sent its buffer and got the
    # result back, and its partner the other way round.
    def in_bytes(elements):
        return [e * elem_size + n * (r < extra)
                for r, e in enumerate(elements.tolist())] + [n] * extra

    sent, received = in_bytes(sent), in_bytes(received)
    if extra:  # the result back to the ranks that folded in
        seconds += alpha + n * beta
    return Result("Rabenseifner", ranks, n, 2 * rounds + (2 if extra else 0), sent,
                  received, seconds)


ALGORITHMS = {"ring": ring, "naive": naive, "recursive-doubling": recursive_doubling,
              "rabenseifner": rabenseifner}


@dataclass
class Busy:
    """One piece of work in the pipeline's timeline."""
    rank: int
    resource: str  # "link": sending to the right neighbour; "cpu": adding what arrived
    phase: str  # "reduce-scatter" or "all-gather"
    step: int  # from 0, within the phase
    segment: int
    chunk: int
    start: float  # seconds
    end: float


@dataclass
class Timeline:
    ranks: int
    count: int
    elem_size: int
    chunk_elems: int  # reduce-scatter's chunks (at most a segment)
    allgather_chunk_elems: int  # all-gather's
    seconds: float  # modelled time of the whole all-reduce
    busy: list  # of Busy, in the order each rank's link and cpu do them


# The timeline is worked out chunk by chunk for every rank (see timeline_entries());
# a million entries take a few seconds and some 100 MB.
MAX_TIMELINE_ENTRIES = 1_000_000
# What --timeline draws at most: past these its rows and bars run together.
MAX_TIMELINE_RANKS = 8
MAX_TIMELINE_CHUNKS = 64  # per segment
MAX_CHUNK_ELEMS = (1 << 62) - 1


def chunks_per_segment(ranks: int, count: int, chunk_elems: int) -> int:
    """Chunks in the largest segment (at least 1)."""
    largest_segment = -(-count // ranks)
    return max(1, -(-largest_segment // max(1, chunk_elems)))


def timeline_entries(ranks: int, count: int, chunk_elems: int,
                     allgather_chunk_elems: int | None = None, elem_size: int = 4) -> int:
    """How many pieces of work pipeline() would work out (to refuse a huge one first):
    every rank sends and adds each reduce-scatter chunk, and sends each all-gather one."""
    gather = chunk_elems if allgather_chunk_elems is None else allgather_chunk_elems
    most = _largest_chunk_elems(elem_size)  # (as pipeline() cuts them)
    chunk_elems, gather = min(chunk_elems, most), min(gather, most)
    return ranks * max(0, ranks - 1) * (2 * chunks_per_segment(ranks, count, chunk_elems) +
                                        chunks_per_segment(ranks, count, gather))


def _largest_chunk_elems(elem_size: int) -> int:
    """The most elements the core puts in one chunk: a message is at most
    _core.MAX_CHUNK_BYTES (RingCommunicator::chunk_elems, and copy_chunk_elems for the
    all-gather's 64 times larger ones)."""
    return max(1, _core.MAX_CHUNK_BYTES // elem_size)


def _check_chunk_elems(value, name: str = "chunk_elems") -> int:
    whole = _whole(value)
    if whole is None or not 1 <= whole <= MAX_CHUNK_ELEMS:
        raise ValueError(f"{name} must be an int from 1 to 2**62 - 1, got {value!r}")
    return whole


def _chunk_elems(value, name: str, count: int, ranks: int) -> int:
    value = _check_chunk_elems(value, name)
    return min(value, max(1, -(-count // ranks)))  # (larger is one chunk per segment)


def pipeline(ranks: int, count: int, chunk_elems: int, elem_size: int = 4, alpha=ALPHA,
             beta=BETA, gamma=GAMMA, allgather_chunk_elems: int | None = None,
             progress=None) -> Timeline:
    """When every chunk moves and is added, in the pipelined ring the core runs.

    Each rank has a link to its right neighbour, which sends one chunk at a time
    (alpha + bytes * beta), and a CPU, which adds each chunk that arrives during
    reduce-scatter into its own copy (bytes * gamma; all-gather only copies, and a chunk
    lands where it belongs). Both take the chunks in the order RingSchedule.phase_chunks
    gives, the order the core uses. A chunk can go on to the next rank once it has
    arrived and, in reduce-scatter, been added: so while a rank adds chunk c, chunk c+1
    is already on the wire. As in the core, a rank starts its all-gather once its own
    reduce-scatter is over (its last chunk sent and added).

    allgather_chunk_elems: the all-gather's chunks (default: chunk_elems, as through
    shared memory; over MPI messages the core takes _core.COPY_CHUNK_FACTOR times larger
    ones, since copying has no work to overlap and each chunk costs alpha).
    As in the core, no chunk is larger than a segment, nor than _core.MAX_CHUNK_BYTES
    (1 GiB, the largest message): Timeline.chunk_elems and allgather_chunk_elems say
    what was used.
    With one chunk per segment nothing overlaps: the time is that of ring() (count > 0).
    Left out: the receive window (a few chunks ahead), and what sharing a machine's
    memory costs a rank that sends and adds at once.
    progress, if given, is called as progress(steps done, steps in all) after each step.
    """
    ranks, count, elem_size = _check(ranks, count, elem_size)
    _check_costs(alpha=alpha, beta=beta, gamma=gamma)
    chunk_elems = _chunk_elems(chunk_elems, "chunk_elems", count, ranks)
    gather_elems = _chunk_elems(chunk_elems if allgather_chunk_elems is None
                                else allgather_chunk_elems, "allgather_chunk_elems", count, ranks)
    # The core cuts no chunk larger than a message may be.
    most = _largest_chunk_elems(elem_size)
    chunk_elems, gather_elems = min(chunk_elems, most), min(gather_elems, most)
    if count == 0:  # (nothing moves: no steps, at any number of ranks)
        return Timeline(ranks, count, elem_size, chunk_elems, gather_elems, 0.0, [])
    if timeline_entries(ranks, count, chunk_elems, gather_elems, elem_size) > \
            MAX_TIMELINE_ENTRIES:
        raise ValueError(f"{ranks} ranks with {count} elements in chunks of {chunk_elems} make "
                         f"more than {MAX_TIMELINE_ENTRIES:,} pieces of work to follow: use "
                         "larger chunks or fewer ranks")
    busy = []
    link_free = [0.0] * ranks
    cpu_free = [0.0] * ranks
    for phase, name, elems in (("reduce_scatter", "reduce-scatter", chunk_elems),
                               ("allgather", "all-gather", gather_elems)):
        schedules = [_core.RingSchedule(r, ranks, count, elems) for r in range(ranks)]
        sends = [s.phase_chunks(phase, True) for s in schedules]
        receives = [s.phase_chunks(phase, False) for s in schedules]
        # ready[r][(segment, chunk)]: when rank r can send this chunk on. A phase's
        # first step sends the rank's own data: in reduce-scatter its input, at once; in
        # all-gather the segment it owns, once its reduce-scatter is over.
        ready = []
        for s in schedules:
            first = getattr(s, f"{phase}_send_segment")(0)
            at = 0.0 if phase == "reduce_scatter" else max(link_free[s.rank], cpu_free[s.rank])
            ready.append({(first, c): at for c in range(s.num_chunks(first))})
        sent = [0] * ranks  # how far each rank is in its list of sends, and of receives
        taken = [0] * ranks
        for k in range(ranks - 1):
            arrived = [{} for _ in range(ranks)]
            for s in schedules:  # the lists are in step order: this step's are next
                r, mine = s.rank, sends[s.rank]
                while sent[r] < len(mine) and mine[sent[r]][0] == k:
                    _, seg, c = mine[sent[r]]
                    sent[r] += 1
                    start = max(link_free[r], ready[r][(seg, c)])
                    link_free[r] = start + alpha + s.chunk(seg, c)[1] * elem_size * beta
                    arrived[s.right][(seg, c)] = link_free[r]
                    busy.append(Busy(r, "link", name, k, seg, c, start, link_free[r]))
            for s in schedules:
                r, mine = s.rank, receives[s.rank]
                while taken[r] < len(mine) and mine[taken[r]][0] == k:
                    _, seg, c = mine[taken[r]]
                    taken[r] += 1
                    at = arrived[r][(seg, c)]
                    if phase == "reduce_scatter":
                        start = max(cpu_free[r], at)
                        cpu_free[r] = start + s.chunk(seg, c)[1] * elem_size * gamma
                        busy.append(Busy(r, "cpu", name, k, seg, c, start, cpu_free[r]))
                        at = cpu_free[r]
                    ready[r][(seg, c)] = at
            if progress is not None:
                progress(k + 1 + (ranks - 1) * (phase == "allgather"), 2 * (ranks - 1))
    seconds = max((b.end for b in busy), default=0.0)
    return Timeline(ranks, count, elem_size, chunk_elems, gather_elems, seconds, busy)


def need_matplotlib(parser: argparse.ArgumentParser, option: str) -> None:
    """A usage error, before any work, where the figure `option` asks for cannot be drawn:
    matplotlib is not a dependency, but comes with ringreduce's `plot` extra."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error(f"{option} needs matplotlib: pip install matplotlib, or install "
                     "ringreduce with its plot extra (pip install '.[plot]' from its sources)")


def draw_timeline(timelines: list, path: str) -> None:
    """The timelines one above another, on one time axis (SVG, PNG or PDF)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = timelines[0].ranks
    fig, axes = plt.subplots(len(timelines), 1, sharex=True, squeeze=False,
                             figsize=(10, 0.55 * 2 * ranks * len(timelines) + 1.6))
    colors = plt.get_cmap("tab10")
    longest = max(t.seconds for t in timelines)
    unit, scale = ("ms", 1e3) if longest >= 1e-3 else ("us", 1e6)
    for ax, t in zip(axes[:, 0], timelines):
        rows = [(r, what) for r in range(ranks) for what in ("link", "cpu")]
        for b in t.busy:
            y = rows.index((b.rank, b.resource))
            gather = b.phase == "all-gather"
            ax.broken_barh([((b.start) * scale, (b.end - b.start) * scale)], (y - 0.4, 0.8),
                           facecolor=colors(b.segment % 10), edgecolor="black", linewidth=0.4,
                           alpha=0.45 if gather else 0.95, hatch="//" if gather else None)
            if b.end - b.start > 0.035 * longest:  # label the bars wide enough
                ax.text((b.start + b.end) / 2 * scale, y, f"S{b.segment}.{b.chunk}",
                        ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"rank {r} " + ("sends" if what == "link" else "adds")
                            for r, what in rows], fontsize=8)
        ax.invert_yaxis()
        title = f"reduce-scatter in {_chunking(t, t.chunk_elems)}"
        if t.allgather_chunk_elems != t.chunk_elems:
            title += f", all-gather in {_chunking(t, t.allgather_chunk_elems)}"
        scattered = max((b.end for b in t.busy if b.phase != "all-gather"), default=0.0)
        ax.set_title(f"{title}: all-reduce {t.seconds * scale:.2f} {unit} (reduce-scatter "
                     f"{scattered * scale:.2f} {unit})", fontsize=9, loc="left")
        ax.axvline(t.seconds * scale, color="gray", linestyle=":", linewidth=1)
    axes[-1, 0].set_xlabel(f"modelled time ({unit})")
    key = [Patch(facecolor=colors(s % 10), label=f"S{s}") for s in range(min(ranks, 10))]
    key += [Patch(facecolor="white", edgecolor="black", label="reduce-scatter"),
            Patch(facecolor="white", edgecolor="black", hatch="//", label="all-gather")]
    fig.legend(handles=key, loc="lower center", fontsize=7, ncol=len(key))
    t = timelines[0]
    fig.suptitle(f"Ring all-reduce of {_size(t.count * t.elem_size)} on {ranks} ranks, "
                 "chunk by chunk (alpha-beta-gamma model; label: segment.chunk)",
                 fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path)
    plt.close(fig)


def _chunking(t: Timeline, elems: int) -> str:
    return (f"{_size(elems * t.elem_size)} chunks "
            f"({chunks_per_segment(t.ranks, t.count, elems)} per segment)")


def _size(nbytes: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % (factor // 8) == 0:
            return f"{nbytes / factor:g} {unit}"
    return f"{nbytes} B"


def parse_bytes(text: str) -> int:
    """'64K' -> 65536: K, M, G are powers of 1024 (KB, KiB too); '1.5M' and '1e3' are
    sizes, '0.1K' (102.4 bytes) is not: ValueError."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    number = text.strip().upper().removesuffix("B").removesuffix("I")
    factor = 1
    if number and number[-1] in units:
        number, factor = number[:-1], units[number[-1]]
    try:
        value = Fraction(Decimal(number.strip())) * factor
    except (InvalidOperation, ValueError, OverflowError):  # (not a number; inf or NaN)
        raise ValueError(f"{text!r} is not a size (e.g. 8, 64K, 100M, 1.5G)") from None
    if value.denominator != 1:
        raise ValueError(f"{text!r} is {float(value):g} bytes, not a whole number of them")
    return int(value)


# From here on ring() runs for seconds (p * 2(p-1) schedule lookups: some 10 s for 2048
# ranks, four times that for 4096), so main() shows how far it is.
SLOW_RING_RANKS = 1024


class _StepProgress:
    """A bar on stderr when it is a terminal, else a line every 5 s; gone when done.
    Nothing until `after` seconds have gone by: most work is over sooner."""

    def __init__(self, what: str, after: float = 1.0):
        self.what, self.filled = what, -1
        self.tty = sys.stderr is not None and sys.stderr.isatty()
        self.quiet = sys.stderr is None  # (pythonw, or stderr closed)
        self.show_from = time.monotonic() + after
        self.last, self.shown = -math.inf, False

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        if not self.shown and (done == total or time.monotonic() < self.show_from):
            return
        self.shown = True
        try:
            self._show(done, total)
        except (OSError, ValueError):  # stderr gone (a closed pipe): the work goes on
            self.quiet = True

    def _show(self, done: int, total: int) -> None:
        if self.tty:
            width = 30
            filled = width * done // total
            if filled == self.filled and done != total:
                return
            self.filled = filled
            end = "\r" + " " * (len(self.what) + width + 20) + "\r" if done == total else ""
            sys.stderr.write(f"\r{self.what} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{done}/{total} steps{end}")
        elif done == total or time.monotonic() - self.last >= 5:
            self.last = time.monotonic()
            sys.stderr.write(f"{self.what}: {done}/{total} steps\n")
        else:
            return
        sys.stderr.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringreduce sim",
                                     description="Model all-reduce algorithms at any scale.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", action="extend",
                        default=argparse.SUPPRESS,
                        help=f"numbers of ranks to model, a row per algorithm each (at most "
                             f"{MAX_RANKS}; default: 4 64 1024)")
    parser.add_argument("--bytes", default="100M", metavar="SIZE",
                        help="buffer size per rank, a multiple of 4 bytes (float32), e.g. "
                             "8, 64K, 100M (K, M, G: powers of 1024)")
    parser.add_argument("--alpha", type=float, default=ALPHA, help="seconds per message")
    parser.add_argument("--beta", type=float, default=BETA, help="seconds per byte moved")
    parser.add_argument("--gamma", type=float, default=GAMMA, help="seconds per byte reduced")
    parser.add_argument("--chunk", nargs="+", action="extend", default=argparse.SUPPRESS,
                        metavar="SIZE",
                        help="also model the ring pipelined in chunks of each SIZE (at most "
                             "1G, as the core's chunk_bytes), chunk by chunk (the plain ring row "
                             "has one chunk per segment)")
    parser.add_argument("--allgather-factor", type=int, default=_core.COPY_CHUNK_FACTOR,
                        metavar="N",
                        help="with --chunk: all-gather's chunks are N times reduce-scatter's, "
                             "up to 1 GiB (as the core's over MPI messages; 1: as through "
                             "shared memory)")
    parser.add_argument("--timeline", metavar="FILE", default=argparse.SUPPRESS,
                        help="draw the pipeline: a panel with one chunk per segment, then one "
                             "per --chunk SIZE (needs --chunk and one --ranks value from 2 to "
                             "8; .svg, .png or .pdf)")
    parser.add_argument("--machines", type=int, default=1, metavar="H",
                        help="ranks spread over H machines, each with one network link: "
                             "compares the ring in rank order with the ring the core goes "
                             "round, machine by machine")
    parser.add_argument("--placement", choices=("round-robin", "block"), default="round-robin",
                        help="with --machines: how mpiexec placed the ranks (round-robin: "
                             "rank r on machine r mod H, as -f hosts without counts)")
    parser.add_argument("--net-beta", type=float, default=NET_BETA,
                        help="with --machines: seconds per byte over a machine's network "
                             "link (default: %(default)s, which is 100 Gb/s)")
    args = parser.parse_args(argv)
    args.ranks = getattr(args, "ranks", None) or [4, 64, 1024]  # (--ranks 3 --ranks 5: both)
    # (Not given: SUPPRESS keeps "(default: [])" and "(default: None)" out of --help.)
    args.chunk, args.timeline = getattr(args, "chunk", []), getattr(args, "timeline", None)
    try:
        nbytes = parse_bytes(args.bytes)
    except ValueError as error:
        parser.error(f"--bytes: {error}")
    if any(p < 1 for p in args.ranks):
        parser.error(f"--ranks must each be 1 or more, got {min(args.ranks)}")
    if nbytes < 0:
        parser.error(f"--bytes must be 0 or more, got {args.bytes}")
    if max(args.ranks) > MAX_RANKS:
        parser.error(f"--ranks: at most {MAX_RANKS} (the ring is simulated rank by rank, step "
                     "by step; for more, the formulas in docs/cost-model.md)")
    if nbytes % 4:
        parser.error(f"--bytes: {nbytes} is not a whole number of float32 elements (4 bytes)")
    if nbytes // 4 > MAX_CHUNK_ELEMS:
        parser.error(f"--bytes: {args.bytes!r} is more than 2**62 - 1 float32 elements")
    for name in ("alpha", "beta", "gamma", "net_beta"):
        if not 0 <= getattr(args, name) < float("inf"):  # (NaN too)
            parser.error(f"--{name.replace('_', '-')} must be a finite number of seconds >= 0")
    if args.machines < 1 or args.machines > min(args.ranks):
        parser.error(f"--machines must be from 1 to the fewest --ranks ({min(args.ranks)}), "
                     f"got {args.machines}")
    given = [f"--{name.replace('_', '-')}" for name, default in
             (("placement", "round-robin"), ("net_beta", NET_BETA))
             if getattr(args, name) != default]
    if given and args.machines == 1:
        parser.error(f"{' and '.join(given)} {'models' if len(given) == 1 else 'model'} ranks "
                     "on several machines: give --machines too (2 or more)")
    if args.machines > 1 and (args.chunk or args.timeline is not None):
        parser.error("--machines models the ring step by step: not with --chunk or --timeline")
    chunks = []
    for text in args.chunk:
        try:
            chunks.append(parse_bytes(text))
        except ValueError as error:
            parser.error(f"--chunk: {error}")
        if chunks[-1] < 4:
            parser.error(f"--chunk: {text!r} is less than one float32 element (4 bytes)")
        if chunks[-1] % 4:
            parser.error(f"--chunk: {text!r} is not a whole number of float32 elements (4 bytes)")
        if chunks[-1] // 4 > MAX_CHUNK_ELEMS:
            parser.error(f"--chunk: {text!r} is more than 2**62 - 1 float32 elements")
        if chunks[-1] > _core.MAX_CHUNK_BYTES:  # (as Communicator(chunk_bytes=...))
            parser.error(f"--chunk: {text!r} is more than the core's largest chunk, "
                         f"{_size(_core.MAX_CHUNK_BYTES)} (a message's bytes must fit MPI's "
                         "int: chunk_bytes is from 1 B to 1 GiB)")
    if not 1 <= args.allgather_factor <= 1 << 20:
        parser.error("--allgather-factor must be from 1 to 2**20")
    if args.allgather_factor != _core.COPY_CHUNK_FACTOR and not chunks:
        parser.error("--allgather-factor sets the all-gather's chunks: give --chunk too")
    count = nbytes // 4

    def gather_elems(chunk_bytes):  # (capped as the core caps them, and pipeline() does)
        return min(chunk_bytes * args.allgather_factor, _core.MAX_CHUNK_BYTES) // 4

    if args.timeline is not None:  # ("" too: a figure asked for, and refused, not skipped)
        if not chunks:
            parser.error("--timeline needs --chunk")
        if count == 0:
            parser.error("--timeline: 0 bytes hold no float32 element, so there is no step "
                         "to draw (give --bytes of at least 4)")
        if len(args.ranks) != 1:
            parser.error("--timeline draws one ring: give one --ranks value")
        if not 2 <= args.ranks[0] <= MAX_TIMELINE_RANKS:
            parser.error(f"--timeline draws a ring of 2 to {MAX_TIMELINE_RANKS} ranks, not "
                         f"{args.ranks[0]}")
        most = max(chunks_per_segment(args.ranks[0], count, c // 4) for c in chunks)
        if most > MAX_TIMELINE_CHUNKS:
            parser.error(f"--timeline draws at most {MAX_TIMELINE_CHUNKS} chunks per segment, "
                         f"not {most}: use larger chunks or fewer bytes")
        if os.path.splitext(args.timeline)[1].lower() not in (".svg", ".png", ".pdf"):
            parser.error(f"--timeline: {args.timeline!r} does not end in .svg, .png or .pdf")
        folder = os.path.dirname(os.path.abspath(args.timeline))
        if not os.path.isdir(folder):
            parser.error(f"--timeline: the folder of {args.timeline!r} does not exist")
        if not os.access(folder, os.W_OK):
            parser.error(f"--timeline: cannot write into the folder of {args.timeline!r}")
        need_matplotlib(parser, "--timeline")
    # Every row of --chunk is worked out chunk by chunk: all of them together are capped.
    entries = sum(timeline_entries(p, count, c // 4, gather_elems(c))
                  for p in args.ranks for c in chunks)
    if entries > MAX_TIMELINE_ENTRIES:
        parser.error(f"--chunk: {len(args.ranks)} ring size(s) and {_size(nbytes)} in such "
                     f"chunks make more than {MAX_TIMELINE_ENTRIES:,} pieces of work to follow "
                     "chunk by chunk; use larger chunks, fewer ranks or fewer bytes")
    pipelined = {(p, c): pipeline(p, count, c // 4, 4, args.alpha, args.beta, args.gamma,
                                  gather_elems(c), progress=_StepProgress(
                                      f"modelling {p} ranks in chunks of {_size(c)}"))
                 for p in args.ranks for c in chunks}
    print(f"all-reduce of {nbytes} bytes (float32) per rank; alpha={args.alpha:g} s, "
          f"beta={args.beta:g} s/B, gamma={args.gamma:g} s/B")
    if chunks:
        capped = any(c * args.allgather_factor > _core.MAX_CHUNK_BYTES for c in chunks)
        print("(ring in chunks: all-gather in the same chunks)" if args.allgather_factor == 1
              else f"(ring in chunks: all-gather in chunks {args.allgather_factor} times larger"
              + (f", at most {_size(_core.MAX_CHUNK_BYTES)}, the core's largest message)"
                 if capped else ")"))
    if args.machines > 1:
        return _print_machines(args, count)
    print("| ranks | algorithm | steps | most bytes sent by one rank | modelled time |")
    print("|---|---|---|---|---|")
    for p in args.ranks:
        for name, fn in ALGORITHMS.items():
            if name == "ring":  # (from SLOW_RING_RANKS, shown at once: it takes seconds)
                r = ring(p, count, 4, args.alpha, args.beta, args.gamma,
                         progress=_StepProgress(f"simulating the ring of {p} ranks",
                                                after=0 if p >= SLOW_RING_RANKS else 1))
            else:
                r = fn(p, count, 4, args.alpha, args.beta, args.gamma)
            print(f"| {p} | {r.algorithm} | {r.steps} | {r.max_bytes_sent:,} | "
                  f"{r.seconds * 1e3:.3f} ms |")
            if name == "ring":
                for c in chunks:
                    t = pipelined[(p, c)]
                    print(f"| {p} | ring in chunks of {_size(c)} | {r.steps} | "
                          f"{r.max_bytes_sent:,} | {t.seconds * 1e3:.3f} ms |")
    if args.timeline is not None:
        p = args.ranks[0]
        drawn = [pipeline(p, count, max(1, -(-count // p)), 4, args.alpha, args.beta,
                          args.gamma)]
        drawn += [pipelined[(p, c)] for c in chunks]
        try:
            draw_timeline(drawn, args.timeline)
        except OSError as error:
            parser.error(f"--timeline: cannot write {args.timeline!r}: {error}")
        print(f"\nfigure: {args.timeline}")
    return 0


def _print_machines(args, count: int) -> int:
    """The ring in rank order against the ring machine by machine, on --machines."""
    print(f"over {args.machines} machines, placed {args.placement}; between machines "
          f"net_beta={args.net_beta:g} s/B, shared by the ring's links that cross at once")
    print("| ranks | ring | links between machines | modelled time |")
    print("|---|---|---|---|")
    for p in args.ranks:
        machines = placed(p, args.machines, args.placement)
        for name, order in (("rank order", list(range(p))),
                            ("machine by machine (the core's)", machine_ring_order(machines))):
            r = ring(p, count, 4, args.alpha, args.beta, args.gamma,
                     progress=_StepProgress(f"simulating the ring of {p} ranks",
                                            after=0 if p >= SLOW_RING_RANKS else 1),
                     ring_order=order, machines=machines, net_beta=args.net_beta)
            print(f"| {p} | {name} | {crossings(order, machines)} | {r.seconds * 1e3:.3f} ms |")
    return 0


if __name__ == "__main__":
    from .__main__ import run_command

    sys.exit(run_command(main))
