"""Step by step, what every rank of the ring sends, receives and holds.

    python -m ringreduce explain --ranks 4 --count 12 [--chunk 2] [--values] [--svg ring.svg]

Everything here is read from ringreduce's own RingSchedule, the C++ class that drives
the core (exposed by the binding), so the explanation is the algorithm that runs, not a
second description of it. What is worked out here is the partial sums: which ranks'
data each rank's copy of each segment contains after each step, and in what order each
segment's terms are added up (which decides its bits). With --values, the steps are
also carried out on numbers, a small integer array per rank, chunk by chunk as the
schedule sends them, and every rank's numbers are shown after each step. Steps are
numbered k from 0 in each phase, as in docs/ring.md and the code ("step k=0 (1 of 3)");
docs/ring.md walks through the output.
"""
from __future__ import annotations

import argparse
import decimal
import math
import numbers
import os
import sys
import textwrap
from dataclasses import dataclass, field

import numpy as np

from . import _core, sim


@dataclass
class Transfer:
    rank: int
    segment: int
    chunks: list  # (first element, number of elements) of each chunk sent
    to: int
    receives: int  # the segment coming in from the left
    reduces: bool  # reduce-scatter adds what arrives; all-gather only copies it
    source: int = -1  # the left neighbour, whose send this rank receives


@dataclass
class Step:
    phase: str  # "reduce-scatter" or "all-gather"
    number: int  # 1-based within the phase
    transfers: list
    holds: list  # holds[rank][segment] = sorted ranks whose data that copy contains
    values: np.ndarray | None = None  # values[rank] = its buffer afterwards (--values)


@dataclass
class Explanation:
    ranks: int
    count: int
    chunk_elems: int
    segments: list  # (first element, number of elements) per segment
    chunks_per_segment: list
    steps: list = field(default_factory=list)
    # orders[s]: how segment s is summed, as its owner (rank s) ends the reduce-scatter
    # with it: "x0+(x3+(x2+x1))" (each rank adds what arrives to its own data, its own
    # first). Every chunk of it, on every path, in that order: its bits are the result's.
    orders: list = field(default_factory=list)
    inputs: np.ndarray | None = None  # inputs[rank]: its buffer before the first step (--values)
    ring: list = field(default_factory=list)  # the ranks in the order they go round


# For reading: the steps and what every rank holds grow as ranks**3 (ranks**4 in
# memory), so larger rings are for `python -m ringreduce sim`.
MAX_RANKS = 32
# A figure has a panel per step, 2(p-1), each with p ranks' p squares: past 8 ranks it
# takes minutes to draw and its labels run together.
MAX_DRAWN_RANKS = 8
MAX_CHUNKS = 4096  # over all segments
MAX_ORDERS_SHOWN = 8  # segments whose order of summing is printed (each has p terms)
# --values writes each element as a number of one digit per rank, and each rank's buffer
# on one line: past 8 digits the eye loses which digit is which rank, and past 100
# characters a line wraps in many terminals.
MAX_VALUES_RANKS = 8
MAX_VALUES_LINE = 100


def value_inputs(ranks: int, count: int) -> np.ndarray:
    """inputs[r][i]: what rank r holds at element i, with --values."""
    # Each rank has a decimal digit of its own, rank 0's the leftmost, and puts there a
    # tag for the element, from 1 to 9 (i % 9 + 1). A sum then has no carries and spells
    # out whose data it holds: on 4 ranks x0+x3 at element 6 is 7000 + 0007 = 7007, a 0
    # being a rank not yet in; the full sum is 7777. The tags tell neighbouring
    # elements apart (all ones would hide an element added in the wrong place).
    places = 10 ** np.arange(ranks - 1, -1, -1, dtype=np.int64)
    tags = np.arange(count, dtype=np.int64) % 9 + 1
    return places[:, None] * tags[None, :]


def _value_columns(ranks: int, count: int) -> list:
    """The width of each segment's column of numbers (its header, S0, at the least)."""
    digits = ranks + 1  # (a space after each number)
    sizes = [_core.segment_of(s, ranks, count)[1] for s in range(ranks)]  # (the core's)
    return [max(len(f"S{s}"), n * digits - 1) for s, n in enumerate(sizes)]


def _values_line(ranks: int, count: int) -> int:
    """How long a rank's line of numbers is: its label, then the segments, two spaces apart."""
    return 10 + sum(_value_columns(ranks, count)) + 2 * (ranks - 1)


def _check_values(ranks: int, count: int) -> None:
    if ranks > MAX_VALUES_RANKS:
        raise ValueError(f"--values shows at most {MAX_VALUES_RANKS} ranks (a digit each in "
                         f"every number), not {ranks}")
    if _values_line(ranks, count) > MAX_VALUES_LINE:
        most = 0
        while _values_line(ranks, most + 1) <= MAX_VALUES_LINE:
            most += 1
        raise ValueError(f"--values prints each rank's buffer on one line, {ranks} digits an "
                         f"element: {count} elements make lines of "
                         f"{_values_line(ranks, count)} characters, more than "
                         f"{MAX_VALUES_LINE}; on {ranks} ranks, use at most {most} elements")


def explain(ranks: int = 4, count: int = 12, chunk_elems: int | None = None,
            values: bool = False, ring=None) -> Explanation:
    """The whole ring all-reduce of `count` elements on `ranks` ranks, step by step; with
    `values`, also carried out on value_inputs(ranks, count). ring: the ranks in the
    order they go round (Communicator.ring; None: rank order)."""
    # (The simulator's rules for a ring: one set of them; numpy's integers taken too.)
    ranks, count, _ = sim._check(ranks, count)
    if ranks > MAX_RANKS:  # (before anything the size of `ranks` is made)
        raise ValueError(f"ranks must be at most {MAX_RANKS} here, got {ranks}: the steps are for "
                         "reading (for bytes and times at any scale: python -m ringreduce sim)")
    # (Numpy's integers too, as Python's: an order from np.argsort is a ring.)
    ring = list(range(ranks)) if ring is None else \
        [int(r) if isinstance(r, numbers.Integral) and not isinstance(r, bool) else r
         for r in ring]
    if sorted(ring) != list(range(ranks)) or not all(type(r) is int for r in ring):
        raise ValueError(f"the ring must list each of the {ranks} ranks once, got "
                         f"{','.join(map(str, ring))}")
    if values:
        _check_values(ranks, count)
    if chunk_elems is None:
        chunk_elems = max(1, -(-count // ranks))  # one chunk per segment
    # (Larger than a segment is one chunk per segment, and says so.)
    chunk_elems = sim._chunk_elems(chunk_elems, "chunk_elems", count, ranks)
    s0 = _core.RingSchedule(0, ranks, count, chunk_elems, ring)
    if sum(s0.num_chunks(s) for s in range(ranks)) > MAX_CHUNKS:
        raise ValueError(f"{count} elements in chunks of {chunk_elems} make more than "
                         f"{MAX_CHUNKS} chunks to show: use fewer elements or larger chunks")
    schedules = [s0] + [_core.RingSchedule(r, ranks, count, chunk_elems, ring)
                        for r in range(1, ranks)]
    result = Explanation(ranks, count, chunk_elems,
                         [s0.segment(s) for s in range(ranks)],
                         [s0.num_chunks(s) for s in range(ranks)], ring=ring)
    buffers = None
    if values:
        result.inputs = value_inputs(ranks, count)
        buffers = result.inputs.copy()
    if count == 0:  # (the core makes no ring steps for nothing: nor does this)
        return result
    holds = [[[r] for _ in range(ranks)] for r in range(ranks)]
    sums = [[f"x{r}"] * ranks for r in range(ranks)]  # each copy's expression
    for phase, send_of, recv_of, reduces in (
            ("reduce-scatter", "reduce_scatter_send_segment", "reduce_scatter_recv_segment", True),
            ("all-gather", "allgather_send_segment", "allgather_recv_segment", False)):
        for k in range(s0.steps_per_phase):
            transfers, before = [], [[list(c) for c in row] for row in holds]
            sums_before = [list(row) for row in sums]
            values_before = None if buffers is None else buffers.copy()
            for sched in schedules:
                r, seg = sched.rank, getattr(sched, send_of)(k)
                incoming = getattr(sched, recv_of)(k)
                transfers.append(Transfer(r, seg, [sched.chunk(seg, c) for c in
                                                   range(sched.num_chunks(seg))],
                                          sched.right, incoming, reduces, sched.left))
                # What arrives is the left neighbour's copy as it was before this step.
                arrived = before[sched.left][incoming]
                holds[r][incoming] = sorted(set(holds[r][incoming]) | set(arrived)) if reduces \
                    else list(arrived)
                if reduces:  # (out = input OP received, as the core and reference.py do)
                    came = sums_before[sched.left][incoming]
                    sums[r][incoming] = (f"{sums[r][incoming]}+"
                                         + (f"({came})" if "+" in came else came))
                if values:
                    _receive(buffers, values_before, schedules[sched.left], r, k, send_of,
                             reduces)
            result.steps.append(Step(phase, k + 1, transfers,
                                     [[list(c) for c in row] for row in holds],
                                     None if buffers is None else buffers.copy()))
            if reduces and k == s0.steps_per_phase - 1:
                result.orders = [sums[s][s] for s in range(ranks)]
    return result


def _receive(buffers, before, sender, r, k, send_of, reduces) -> None:
    """Rank r takes in, chunk by chunk, what its left neighbour `sender` sends at step k:
    the elements the sender's schedule names, as the sender's buffer held them before
    the step, added to r's own (its own first, as in the core) or copied over them."""
    segment = getattr(sender, send_of)(k)
    for c in range(sender.num_chunks(segment)):
        first, n = sender.chunk(segment, c)
        arrived = before[sender.rank, first:first + n]
        mine = buffers[r, first:first + n]
        buffers[r, first:first + n] = mine + arrived if reduces else arrived


def _average(total: int, ranks: int) -> str:
    """total / ranks as a reader holds it against the counts beside it: whole where it is
    (193750, not 1.94e+05), else to two decimals (1501.5: 3 significant digits made it
    1.5e+03, as if the ranks' 1501 and 1502 were more than the formula gives)."""
    whole, rest = divmod(total, ranks)
    if not rest:
        return str(whole)
    # (In decimal arithmetic: a float has no room for two decimals past 2**53.)
    with decimal.localcontext() as context:
        context.prec = 60
        return str((decimal.Decimal(total) / ranks).quantize(decimal.Decimal("0.01"))
                   ).rstrip("0").rstrip(".")


def _spread(counts) -> str:
    """'9' where every rank's count is 9, else '9 to 10'."""
    low, high = min(counts), max(counts)
    return f"{low}" if low == high else f"{low} to {high}"


def _elements(span) -> str:
    first, n = span
    return "nothing" if n == 0 else (f"element {first}" if n == 1
                                     else f"elements {_range(span)}")


def _range(span) -> str:
    first, n = span
    return f"{first}" if n == 1 else f"{first}-{first + n - 1}"


def _sum(contributors, ranks, ring) -> str:
    """Whose data a copy holds: "x1+x2", "all", or past three ranks, which are always
    a run of the ring (each step adds the left neighbour's), "x5+..+x2": x5 and every
    rank after it round the ring up to x2 (on 32 ranks, the rows of x0+x1+... ran to
    thousands of characters)."""
    if len(contributors) == ranks and ranks > 2:
        return "all"
    if len(contributors) > 3:
        held = set(contributors)
        at = {r: i for i, r in enumerate(ring)}
        first = next(r for r in contributors if ring[at[r] - 1] not in held)
        run = [ring[(at[first] + k) % ranks] for k in range(len(contributors))]
        if set(run) == held:
            return f"x{run[0]}+..+x{run[-1]}"
    return "+".join(f"x{r}" for r in contributors)


def _counted(n: int, thing: str) -> str:
    return f"{n} {thing}" if n == 1 else f"{n} {thing}s"


def _value_rows(e: Explanation, rows) -> list:
    """Lines of numbers, a column per segment: a header, then a line per (label, buffer)."""
    widths = _value_columns(e.ranks, e.count)
    lines = [("  " + " " * 8 + "  ".join(f"S{s}".ljust(w) for s, w in enumerate(widths)))
             .rstrip()]
    for label, buffer in rows:
        cells = [" ".join(f"{v:0{e.ranks}d}" for v in buffer[first:first + n]) or "-"
                 for first, n in e.segments]
        lines.append((f"  {label}".ljust(10) + "  ".join(c.ljust(w) for c, w in
                                                        zip(cells, widths))).rstrip())
    return lines


def _values_start(e: Explanation) -> list:
    if e.count == 0:
        return ["(--values: no elements, so no numbers to show.)"]
    if e.ranks == 1:
        how = "its element i is i % 9 + 1:"
    else:
        # A sum the first step's tables show: the first copy of a segment with elements
        # that then holds two ranks' data (every segment is received by one rank then).
        first, second, i = next(
            (*e.steps[0].holds[r][s], e.segments[s][0])
            for r in range(e.ranks) for s in range(e.ranks)
            if e.segments[s][1] and len(e.steps[0].holds[r][s]) == 2)
        a, b = e.inputs[first, i], e.inputs[second, i]
        how = (f"element i is i % 9 + 1 in the rank's own digit, rank 0's the leftmost, so "
               f"that a sum shows whose data it holds (x{first}+x{second} at element {i}: "
               f"{a:0{e.ranks}d} + {b:0{e.ranks}d} = {a + b:0{e.ranks}d}):")
    whose = "the rank's input" if e.ranks == 1 else "each rank's input"
    return textwrap.wrap(f"With --values, {whose}: {how}", width=90) + \
        _value_rows(e, [(f"rank {r}", row) for r, row in enumerate(e.inputs)])


def _final_values(e: Explanation) -> np.ndarray:
    return e.steps[-1].values if e.steps else e.inputs


def _ranks_off_the_sum(e: Explanation) -> list:
    """The ranks whose buffer after the last step is not np.sum of the inputs over the
    ranks, the plain sum without the ring: what the steps must give (--values)."""
    expected = e.inputs.sum(axis=0)
    return [r for r, row in enumerate(_final_values(e)) if not np.array_equal(row, expected)]


def values_agree(e: Explanation) -> bool:
    """Whether every rank ends with np.sum of the inputs (explained with values=True)."""
    return not _ranks_off_the_sum(e)


def _values_end(e: Explanation) -> list:
    if e.count == 0:
        return []
    final, expected, wrong = _final_values(e), e.inputs.sum(axis=0), _ranks_off_the_sum(e)
    if not wrong:
        return [""] + textwrap.wrap(
            "The numbers: every rank's buffer is now the result below; numpy adds up the "
            "inputs without the ring, np.sum(inputs, axis=0), to compare:", width=90) + \
            _value_rows(e, [("result", final[0]), ("np.sum", expected)]) + \
            ["Checked: the same on every rank, and the same as np.sum."]
    return [""] + textwrap.wrap(
        "The numbers: every rank's buffer now, and numpy's sum of the inputs without the "
        "ring, np.sum(inputs, axis=0):", width=90) + \
        _value_rows(e, [(f"rank {r}", row) for r, row in enumerate(final)]
                    + [("np.sum", expected)]) + \
        [f"WRONG: {', '.join(f'rank {r}' for r in wrong)} "
         f"{'differs' if len(wrong) == 1 else 'differ'} from np.sum: the steps above are not "
         "the ring all-reduce (a bug in ringreduce: please report it)."]


def format_text(e: Explanation) -> str:
    if e.ranks == 1:
        ring = ("on 1 rank.",
                "The buffer is one segment, in")
    else:
        ring = (f"on {e.ranks} ranks. Each rank sends to its right neighbour and receives "
                "from its left.",
                f"The buffer is cut into {e.ranks} segments (like np.array_split), each into")
    lines = [f"Ring all-reduce of {_counted(e.count, 'element')} {ring[0]}"]
    if e.ring != sorted(e.ring):
        lines.append(f"The ranks go round in the order {' -> '.join(map(str, e.ring + e.ring[:1]))}"
                     " (as on several machines): right and left are along it.")
    lines.append(f"{ring[1]} chunks of at most {_counted(e.chunk_elems, 'element')}:")
    for s, span in enumerate(e.segments):
        lines.append(f"  S{s}: {_elements(span)}, {_counted(e.chunks_per_segment[s], 'chunk')}")
    values = e.inputs is not None
    if e.ranks == 1:
        lines.append("One rank: nothing to send; the result is the input.")
        return "\n".join(lines + (_values_start(e) + _values_end(e) if values else []))
    if e.count == 0:
        lines.append("No elements: nothing to send, and no steps; the result is empty.")
        return "\n".join(lines + (_values_start(e) if values else []))
    if max(e.chunks_per_segment) > 1:
        lines += textwrap.wrap(
            f"(The all-gather is shown in these chunks too, as through shared memory; over "
            f"MPI messages the core sends its chunks up to {_core.COPY_CHUNK_FACTOR} times "
            "larger, as it only copies. Steps are shown whole, one after another; the core "
            "sends each chunk on as soon as it has it, so that the steps overlap.)", width=90)
        if e.ranks <= sim.MAX_TIMELINE_RANKS and \
                max(e.chunks_per_segment) <= sim.MAX_TIMELINE_CHUNKS and \
                4 * e.chunk_elems <= _core.MAX_CHUNK_BYTES:  # (the largest sim --chunk)
            lines += ["The overlap, drawn for float32 elements:",
                      f"  python -m ringreduce sim --ranks {e.ranks} --bytes {4 * e.count} "
                      f"--chunk {4 * e.chunk_elems} --allgather-factor 1 --timeline pipeline.svg"]
    if values:
        lines += [""] + _values_start(e)
    width = max(6, max(len(_sum(c, e.ranks, e.ring)) for step in e.steps
                       for row in step.holds for c in row) + 2)
    if e.ranks > 4:  # (copies of four ranks' data and more are written as runs)
        run = [e.ring[k % e.ranks] for k in range(-1, 3)]
        lines += [""] + textwrap.wrap(
            f"In the tables, x{run[0]}+..+x{run[-1]} is {'+'.join(f'x{r}' for r in run)}: a "
            "run of the ring, from the first rank named round to the last.", width=90)
    for step in e.steps:
        total = e.ranks - 1
        lines.append("")
        lines.append(f"{step.phase}, step k={step.number - 1} ({step.number} of {total}):")
        for t in step.transfers:
            action = "adds it to its own copy" if t.reduces else "copies it over its own"
            what = ("no elements" if not t.chunks else _elements(t.chunks[0])
                    if len(t.chunks) == 1 else
                    f"elements {', '.join(map(_range, t.chunks))}, in {len(t.chunks)} chunks")
            lines.append(f"  rank {t.rank} sends S{t.segment} to rank {t.to} ({what}); "
                         f"receives S{t.receives} from rank {t.source} and "
                         f"{action}")
        lines.append("  afterwards, whose data each rank's copy of each segment holds:")
        lines.append(("  " + " " * 8 + "".join(f"S{s}".ljust(width)
                                                for s in range(e.ranks))).rstrip())
        for r, row in enumerate(step.holds):
            lines.append((f"  rank {r}".ljust(10) + "".join(
                _sum(c, e.ranks, e.ring).ljust(width) for c in row)).rstrip())
        if values:
            lines.append("  afterwards, the numbers each rank holds:")
            lines += _value_rows(e, [(f"rank {r}", row) for r, row in enumerate(step.values)])
    sent, received = [0] * e.ranks, [0] * e.ranks
    for step in e.steps:
        for t in step.transfers:
            n = sum(size for _, size in t.chunks)
            sent[t.rank] += n
            received[t.to] += n
    lines.append("")
    lines += textwrap.wrap(
        f"Each rank sent {_spread(sent)} element{'s' * (max(sent) != 1)} and received "
        f"{_spread(received)}: "
        f"2(p-1)/p x N = {_average(2 * (e.ranks - 1) * e.count, e.ranks)} on average, "
        f"for N = {e.count} "
        f"element{'s' * (e.count != 1)}, in 2(p-1) = "
        f"{2 * (e.ranks - 1)} steps" + (" (p does not divide N: segments differ by one "
                                         "element)" if e.count % e.ranks else "") +
        ". Every rank now holds every segment summed over all ranks, computed once by the "
        "segment's owner.", width=90)
    lines.append("")
    lines += textwrap.wrap(
        "In what order: each rank adds what arrives to its own data (its own first), so "
        "each segment is summed in one order, chunk by chunk, whatever the chunk size; the "
        "all-gather then copies those bits to every rank, which thus end with the same "
        "result to the last bit:", width=90)
    shown = e.orders if e.ranks <= MAX_ORDERS_SHOWN else e.orders[:1]
    lines += [f"  S{s} = {order}" for s, order in enumerate(shown)]
    if len(shown) < e.ranks:
        lines.append("  (and each segment alike: from the rank after its owner around to "
                     "its owner)")
    if values:
        lines += _values_end(e)
    return "\n".join(lines)


def draw(e: Explanation, path: str) -> None:
    """A figure of the ring and the steps (SVG, PNG or PDF, from the file name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    panels = len(e.steps)
    columns = max(1, e.ranks - 1)  # one row per phase, one column per step
    rows = max(1, -(-panels // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 4.2 * rows), squeeze=False)
    colors = plt.get_cmap("viridis")
    for ax in axes.ravel():
        ax.axis("off")
    for index, step in enumerate(e.steps):
        ax = axes.ravel()[index]
        ax.set_xlim(-2.0, 2.0)
        ax.set_ylim(-1.9, 1.9)
        ax.set_aspect("equal")
        ax.set_title(f"{step.phase}, step k={step.number - 1}", fontsize=10)
        # Round the circle in ring order (rank order unless e.ring says otherwise).
        angle = [math.pi / 2 - 2 * math.pi * e.ring.index(r) / e.ranks for r in range(e.ranks)]
        where = [(math.cos(a), math.sin(a)) for a in angle]
        for t in step.transfers:
            (x0, y0), (x1, y1) = where[t.rank], where[t.to]
            arrow = FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=12,
                                    connectionstyle="arc3,rad=-0.25", shrinkA=22, shrinkB=22,
                                    color="tab:red" if t.reduces else "tab:blue")
            ax.add_patch(arrow)
            # Just outside the arc's middle, on the side it bends to (arc3 bends by rad
            # times the chord turned a quarter): two ranks' arrows, between the same
            # two points, bend apart, and so do their labels.
            bend = 0.25 * 0.75
            ax.text((x0 + x1) / 2 - bend * (y1 - y0), (y0 + y1) / 2 + bend * (x1 - x0),
                    f"S{t.segment}", fontsize=8, ha="center", va="center",
                    color=arrow.get_edgecolor())
        for r, (x, y) in enumerate(where):
            ax.add_patch(plt.Circle((x, y), 0.2, color="lightgray", zorder=2))
            ax.text(x, y, f"{r}", ha="center", va="center", fontsize=10, zorder=3)
            # one small square per segment (with a gap between): how complete this
            # rank's copy of it is; outside the ring, clear of the arrows
            cx, cy = 1.55 * x, 1.55 * y
            width = 0.6 / e.ranks
            for s, contributors in enumerate(step.holds[r]):
                share = (len(contributors) - 1) / (e.ranks - 1)  # (1 rank's data to all)
                left = cx - 0.3 + 0.6 * s / e.ranks
                ax.add_patch(plt.Rectangle((left + 0.1 * width, cy - 0.08), 0.8 * width, 0.16,
                                           facecolor=colors(share), edgecolor="black",
                                           linewidth=0.3, zorder=3))
                if e.ranks <= 8:
                    ax.text(left + width / 2, cy - 0.15, f"S{s}", ha="center", va="center",
                            fontsize=5, zorder=3)
    fig.suptitle(textwrap.fill(
        f"Ring all-reduce, {e.ranks} ranks: red arrows reduce, blue arrows copy. By each "
        "rank, after the step, one square per segment: how many ranks' data its copy holds "
        "(yellow: all of them)", width=60 * columns), fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    # The colour key: ranks whose data a copy of a segment holds, 1 to p (no copy
    # holds none).
    key = fig.add_axes((0.945, 0.15, 0.012, 0.7))
    scale = plt.cm.ScalarMappable(cmap=colors, norm=matplotlib.colors.Normalize(1, e.ranks))
    bar = fig.colorbar(scale, cax=key)
    bar.set_ticks(range(1, e.ranks + 1))
    bar.set_label("ranks' data in the copy", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    # The same picture, the same file: no date, and SVG ids not drawn at random (a
    # regenerated figure is then no change for git).
    with matplotlib.rc_context({"svg.hashsalt": "ringreduce"}):
        fig.savefig(path, metadata={"Date": None} if str(path).endswith(".svg") else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringreduce explain",
                                     description="Show the ring all-reduce step by step.")
    parser.add_argument("--ranks", type=int, default=None,
                        help=f"ranks in the ring (at most {MAX_RANKS}; default: as many as "
                        "--ring lists, else 4)")
    parser.add_argument("--count", type=int, default=12,
                        help="elements in the buffer (default: 12)")
    parser.add_argument("--chunk", type=int, default=None,
                        help="elements per chunk (default: one chunk per segment)")
    parser.add_argument("--values", action="store_true",
                        help="also carry the steps out on small integers and print every rank's "
                        "numbers after each step, checked against numpy's sum at the end (at most "
                        f"{MAX_VALUES_RANKS} ranks, in lines of at most {MAX_VALUES_LINE} "
                        "characters)")
    parser.add_argument("--svg", metavar="FILE", help="also draw the steps (.svg, .png, .pdf; "
                        f"at most {MAX_DRAWN_RANKS} ranks)")
    parser.add_argument("--ring", metavar="R,R,...",
                        help="the order the ranks go round, e.g. 0,2,1,3 (as Communicator.ring "
                        "on ranks placed round-robin over two machines; default: rank order)")
    args = parser.parse_args(argv)
    ring = None
    if args.ring is not None:
        try:
            ring = [int(r) for r in args.ring.split(",")]
        except ValueError:
            parser.error(f"--ring: {args.ring!r} is not a list of ranks such as 0,2,1,3")
    if args.ranks is None:
        args.ranks = len(ring) if ring is not None else 4
    if args.svg is not None:  # (checked before the text is printed; "" too, not skipped)
        name = os.path.basename(args.svg)
        if os.path.splitext(name)[1].lower() not in (".svg", ".png", ".pdf"):
            if name.lower() in (".svg", ".png", ".pdf"):
                parser.error(f"--svg: {args.svg!r} has no file name before {name}")
            parser.error(f"--svg: {args.svg!r} does not end in .svg, .png or .pdf")
        if args.ranks == 1 or args.count == 0:
            parser.error("--svg: one rank, or no elements, makes no steps to draw")
        if args.ranks > MAX_DRAWN_RANKS:
            parser.error(f"--svg draws at most {MAX_DRAWN_RANKS} ranks (a panel per step, "
                         f"2(p-1) of them), not {args.ranks}; the text shows up to {MAX_RANKS}")
        folder = os.path.dirname(os.path.abspath(args.svg))
        if not os.path.isdir(folder):
            parser.error(f"--svg: the folder of {args.svg!r} does not exist")
        if not os.access(folder, os.W_OK):  # (as sim --timeline: not after all the text)
            parser.error(f"--svg: cannot write into the folder of {args.svg!r}")
        sim.need_matplotlib(parser, "--svg")
    if args.chunk is not None and not 1 <= args.chunk < 1 << 62:
        parser.error(f"--chunk must be from 1 to 2**62 - 1 elements, got {args.chunk}")
    try:
        e = explain(args.ranks, args.count, args.chunk, values=args.values, ring=ring)
    except ValueError as error:
        parser.error(str(error))
    print(format_text(e))
    if args.svg is not None:
        if len(e.steps) > 8:  # (some 3 s a panel)
            print(f"\ndrawing {len(e.steps)} panels into {args.svg} ...", file=sys.stderr,
                  flush=True)
        try:
            draw(e, args.svg)
        except OSError as error:
            parser.error(f"--svg: cannot write {args.svg!r}: {error}")
        print(f"\nfigure: {args.svg}")
    return 1 if args.values and not values_agree(e) else 0


if __name__ == "__main__":
    from .__main__ import run_command

    sys.exit(run_command(main))
