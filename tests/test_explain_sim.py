"""The explainer and the simulator, in one process (their MPI check is in tests/mpi)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ringreduce as rr
from ringreduce import _core, reference, sim
from ringreduce.explain import MAX_VALUES_LINE, _sum, explain, format_text, values_agree


@pytest.mark.parametrize("ranks,count", [(1, 5), (2, 1), (3, 7), (4, 12), (5, 3)])
def test_every_rank_ends_with_every_full_sum(ranks, count):
    e = explain(ranks, count)
    assert len(e.steps) == 2 * (ranks - 1)
    everyone = list(range(ranks))
    if ranks > 1:
        after_reduce_scatter = e.steps[ranks - 2].holds
        for r in range(ranks):  # rank r owns segment r after reduce-scatter
            assert after_reduce_scatter[r][r] == everyone
        assert all(c == everyone for row in e.steps[-1].holds for c in row)
    assert [n for _, n in e.segments] == [len(a) for a in __import__("numpy").array_split(
        range(count), ranks)]


def test_each_step_sends_what_the_left_neighbour_receives():
    e = explain(4, 12, chunk_elems=2)
    for step in e.steps:
        for t in step.transfers:
            right = step.transfers[t.to]
            assert right.receives == t.segment
            assert sum(n for _, n in t.chunks) == e.segments[t.segment][1]
            assert all(n <= 2 for _, n in t.chunks)


def test_text_names_the_steps_and_partial_sums():
    text = format_text(explain(4, 12))
    assert "reduce-scatter, step k=0 (1 of 3)" in text
    assert "all-gather, step k=2 (3 of 3)" in text
    assert "rank 0 sends S3 to rank 1" in text
    assert "x0+x3" in text  # rank 0's copy of S2 after step k=0


@pytest.mark.parametrize("ranks", [2, 3, 4, 9])
def test_each_segment_is_summed_from_the_rank_after_its_owner_around_to_it(ranks):
    # (tests/mpi/test_allreduce.py holds the core's results to these orders, bit for bit.)
    e = explain(ranks, 5 * ranks, chunk_elems=2)
    expected = []
    for s in range(ranks):
        order = f"x{(s + 1) % ranks}"
        for k in range(2, ranks + 1):
            order = f"x{(s + k) % ranks}+" + (f"({order})" if k > 2 else order)
        expected.append(order)
    assert e.orders == expected
    text = format_text(e)
    assert "S0 = x0+(x3+(x2+x1))" in text if ranks == 4 else f"S0 = {expected[0]}" in text
    assert (f"S1 = {expected[1]}" in text) == (ranks <= 8)
    assert not explain(1, 5).orders and not explain(3, 0).orders


def test_command_line_writes_the_figure(tmp_path):
    figure = tmp_path / "ring.svg"
    done = subprocess.run([sys.executable, "-m", "ringreduce", "explain", "--ranks", "3",
                           "--count", "7", "--chunk", "2", "--svg", str(figure)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "all-gather, step k=1 (2 of 2)" in done.stdout
    assert figure.read_text().lstrip().startswith(("<?xml", "<svg"))
    bad = subprocess.run([sys.executable, "-m", "ringreduce", "explain", "--ranks", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "ranks" in bad.stderr


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7, 64])
def test_ring_sends_2_p_minus_1_over_p_of_the_buffer(ranks):
    count = 64 * 1000
    r = sim.ring(ranks, count, 4)
    assert r.steps == 2 * (ranks - 1)
    expected = 2 * (ranks - 1) * count * 4 / ranks
    assert max(r.bytes_sent) <= expected + 2 * (ranks - 1) * 4  # uneven segments: +1 element
    assert sum(r.bytes_sent) == sum(r.bytes_received)


def test_ring_beats_naive_and_doubling_for_large_buffers_at_scale():
    results = {name: fn(1024, 25 * 2**20) for name, fn in sim.ALGORITHMS.items()}
    assert results["ring"].max_bytes_sent < results["recursive-doubling"].max_bytes_sent
    assert results["ring"].max_bytes_sent * 500 < results["naive"].max_bytes_sent
    assert results["ring"].seconds < results["recursive-doubling"].seconds < results["naive"].seconds
    small = {name: fn(1024, 2) for name, fn in sim.ALGORITHMS.items()}
    assert small["recursive-doubling"].seconds < small["ring"].seconds  # latency wins


def _halving_doubling_by_hand(ranks, count):
    """Rabenseifner's all-reduce carried out on numbers, written apart from sim's: each
    of `ranks` virtual ranks holds its own array; what one sends another is a slice of
    it, counted as it goes. Returns the ranks' results, bytes sent and received (float32
    elements of 4 bytes), and the steps, for sim.rabenseifner to be held to."""
    data = [np.arange(count, dtype=np.float64) * 10 + r for r in range(ranks)]
    sent, received, steps = [0] * ranks, [0] * ranks, 0
    power = 1 << (ranks.bit_length() - 1)

    def move(src, dst, lo, hi, add):
        sent[src] += 4 * (hi - lo)
        received[dst] += 4 * (hi - lo)
        if add:
            data[dst][lo:hi] += data[src][lo:hi]
        else:
            data[dst][lo:hi] = data[src][lo:hi]

    for r in range(power, ranks):  # fold in
        move(r, r - power, 0, count, add=True)
    steps += ranks > power
    spans = [(0, count)] * power
    history = []
    distance = power // 2
    while distance:
        history.append((distance, list(spans)))
        before = [d.copy() for d in data]  # (the swap is simultaneous)
        for r in range(power):
            lo, hi = spans[r]
            mid = lo + (hi - lo) // 2
            keep = (lo, mid) if r & distance == 0 else (mid, hi)
            give = (mid, hi) if r & distance == 0 else (lo, mid)
            partner = r ^ distance
            sent[r] += 4 * (give[1] - give[0])
            received[partner] += 4 * (give[1] - give[0])
            data[partner][give[0]:give[1]] += before[r][give[0]:give[1]]
            spans[r] = keep
        distance //= 2
        steps += 1
    for distance, earlier in reversed(history):
        before = [d.copy() for d in data]
        for r in range(power):
            lo, hi = spans[r]
            partner = r ^ distance
            sent[r] += 4 * (hi - lo)
            received[partner] += 4 * (hi - lo)
            data[partner][lo:hi] = before[r][lo:hi]
        spans = earlier
        steps += 1
    for r in range(power, ranks):  # the result back
        move(r - power, r, 0, count, add=False)
    steps += ranks > power
    return data, sent, received, steps


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16])
@pytest.mark.parametrize("count", [1, 7, 64, 1000])
def test_rabenseifner_counts_the_bytes_of_the_algorithm_carried_out(ranks, count):
    data, sent, received, steps = _halving_doubling_by_hand(ranks, count)
    total = sum(np.arange(count, dtype=np.float64) * 10 + r for r in range(ranks))
    for result in data:  # (the algorithm, as counted, is an all-reduce)
        np.testing.assert_array_equal(result, total)
    model = sim.rabenseifner(ranks, count)
    assert (model.bytes_sent, model.bytes_received, model.steps) == (sent, received, steps)


def test_rabenseifner_has_the_rings_bandwidth_but_not_for_every_p():
    # On a power of two, the ring's bytes (p dividing the count) in 2 log2(p) steps,
    # and the table's formula; on 3 ranks the fold costs two whole buffers, and the
    # ring is faster for a large one, as docs/cost-model.md says.
    n = 1 << 20
    for ranks in (2, 8, 64, 1024):
        r = sim.rabenseifner(ranks, n // 4)
        assert r.max_bytes_sent == 2 * (ranks - 1) * n // ranks == min(r.bytes_sent)
        assert r.steps == 2 * (ranks.bit_length() - 1)
        formula = (2 * (ranks.bit_length() - 1) * sim.ALPHA + 2 * (ranks - 1) / ranks * n
                   * sim.BETA + (ranks - 1) / ranks * n * sim.GAMMA)
        assert r.seconds == pytest.approx(formula, rel=1e-12)
    big = 100 << 20
    assert sim.ring(3, big // 4).seconds * 2 < sim.rabenseifner(3, big // 4).seconds
    assert sim.rabenseifner(3, big // 4).max_bytes_sent == 2 * big
    # Many ranks, a middling buffer: far fewer latencies than the ring's 2(p-1).
    assert sim.rabenseifner(1024, n // 4).seconds * 5 < sim.ring(1024, n // 4).seconds


def test_sim_command_line():
    done = subprocess.run([sys.executable, "-m", "ringreduce", "sim", "--ranks", "8", "200",
                           "--bytes", "1M"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| 200 | ring | 398 |" in done.stdout
    assert done.stderr == ""  # (no progress for work over within a second)


def test_sim_shows_how_far_a_large_ring_is_on_stderr():
    done = subprocess.run([sys.executable, "-m", "ringreduce", "sim", "--ranks", "1024",
                           "--bytes", "1M"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| 1024 | ring | 2046 |" in done.stdout and "simulating" not in done.stdout
    lines = done.stderr.splitlines()
    assert lines[0] == "simulating the ring of 1024 ranks: 1/2046 steps", done.stderr
    assert lines[-1] == "simulating the ring of 1024 ranks: 2046/2046 steps", done.stderr


def test_sim_runs_on_with_stderr_closed():
    # The progress has nowhere to go; the table is what matters.
    done = subprocess.run(f"{shlex.quote(sys.executable)} -m ringreduce sim --ranks 1024 "
                          "--bytes 1M 2>&-", shell=True, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout
    assert "| 1024 | ring | 2046 |" in done.stdout


def test_step_progress_waits_then_shows_and_survives_a_gone_stderr(monkeypatch):
    import io

    shown = io.StringIO()
    monkeypatch.setattr(sys, "stderr", shown)
    quick = sim._StepProgress("quick work", after=60)
    for step in range(1, 11):
        quick(step, 10)
    assert shown.getvalue() == ""  # over before the minute it waits
    slow = sim._StepProgress("slow work", after=0)
    for step in range(1, 11):
        slow(step, 10)
    assert shown.getvalue() == "slow work: 1/10 steps\nslow work: 10/10 steps\n"

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", ClosedPipe())
    gone = sim._StepProgress("work", after=0)
    gone(1, 2)
    gone(2, 2)
    monkeypatch.setattr(sys, "stderr", None)
    sim._StepProgress("work", after=0)(1, 2)


def test_pipeline_reports_each_step_of_both_phases():
    steps = []
    sim.pipeline(3, 1000, 10, progress=lambda done, total: steps.append((done, total)))
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]


@pytest.mark.parametrize("argv, message", [
    (["sim", "--bytes", "10Q"], "--bytes: '10Q' is not a size"),
    (["sim", "--bytes", "infK"], "--bytes: 'infK' is not a size"),
    (["sim", "--alpha", "-1"], "--alpha must be a finite number"),
    (["sim", "--beta", "nan"], "--beta must be a finite number"),
    (["explain", "--ranks", "500"], "at most 32 here"),
    # (A list of that many ranks was made first: a traceback, or all the memory.)
    (["explain", "--ranks", "99999999999999999999"], "at most 32 here"),
    (["explain", "--ranks", "1000000000"], "at most 32 here"),
    (["sim", "--ranks", "4", "0"], "--ranks must each be 1 or more, got 0"),
    (["sim", "--bytes", "-4"], "--bytes must be 0 or more, got -4"),
    (["sim", "--allgather-factor", "2"], "--allgather-factor sets the all-gather's chunks: "
                                         "give --chunk too"),
    (["explain", "--count", "100000000", "--chunk", "1"], "more than 4096 chunks"),
    (["sim", "--bytes", "6"], "not a whole number of float32 elements"),
    (["sim", "--ranks", "4", "5000"], "--ranks: at most 4096"),
    (["explain", "--count", str(1 << 63)], "count must be an int from 0 to 2**62 - 1"),
    (["explain", "--chunk", str(1 << 63)], "--chunk must be from 1 to 2**62 - 1"),
    (["explain", "--svg", "/nonexistent-folder/ring.svg"], "does not exist"),
    (["explain", "--svg", "ring.xyz"], "does not end in .svg, .png or .pdf"),
    (["sim", "--chunk", "6"], "--chunk: '6' is not a whole number of float32 elements"),
    (["sim", "--chunk", "0"], "--chunk: '0' is less than one float32 element"),
    (["sim", "--chunk", "1X"], "--chunk: '1X' is not a size"),
    (["sim", "--ranks", "64", "--bytes", "1G", "--chunk", "4K"], "more than 1,000,000 pieces"),
    (["sim", "--ranks", "700", "--bytes", "4M", "--chunk", "4M"], "more than 1,000,000 pieces"),
    (["sim", "--ranks", "3", "--bytes", "12M", "--chunk", "99999999999999999996"],
     "more than 2**62 - 1 float32 elements"),
    (["sim", "--chunk", "1M", "--allgather-factor", "0"], "--allgather-factor must be"),
    (["sim", "--timeline", "t.svg"], "--timeline needs --chunk"),
    (["sim", "--ranks", "4", "--bytes", "0", "--chunk", "4", "--timeline", "t.svg"],
     "--timeline: 0 bytes hold no float32 element, so there is no step to draw"),
    (["sim", "--ranks", "3", "4", "--chunk", "1K", "--timeline", "t.svg"], "one --ranks value"),
    (["sim", "--ranks", "9", "--chunk", "1K", "--timeline", "t.svg"], "2 to 8 ranks"),
    (["sim", "--ranks", "3", "--chunk", "1M", "--timeline", "t.xyz"], "does not end in .svg"),
    (["sim", "--ranks", "2", "--chunk", "64K", "--timeline", "t.svg"], "at most 64 chunks per"),
    (["bogus"], "usage: python -m ringreduce"),
    (["sim", "--bytes", "0.1K"], "--bytes: '0.1K' is 102.4 bytes, not a whole number"),
    (["sim", "--bytes", "1.0001K"], "not a whole number"),
    (["sim", "--chunk", "1.5"], "--chunk: '1.5' is 1.5 bytes, not a whole number"),
    (["sim", "--ranks", "9", "--chunk", "1K", "--timeline", "t.svg"], "not 9"),
    (["explain", "--ranks", "9", "--svg", "r.svg"], "--svg draws at most 8 ranks"),
    (["explain", "--svg", ".svg"], "'.svg' has no file name before .svg"),
    (["explain", "--ranks", "1", "--svg", "r.svg"], "makes no steps to draw"),
    (["explain", "--count", "0", "--svg", "r.svg"], "makes no steps to draw"),
    (["explain", "--values", "--ranks", "9", "--count", "9"], "--values shows at most 8 ranks"),
    (["explain", "--values", "--count", "18"],
     "18 elements make lines of 102 characters, more than 100; on 4 ranks, use at most 17"),
    (["explain", "--values", "--count", str(1 << 61), "--chunk", str(1 << 60)],
     "on 4 ranks, use at most 17 elements"),
    (["sim", "--ranks", "4", "8", "--machines", "5"],
     "--machines must be from 1 to the fewest --ranks (4), got 5"),
    (["sim", "--machines", "0"], "--machines must be from 1"),
    (["sim", "--machines", "2", "--chunk", "1M"], "not with --chunk or --timeline"),
    (["sim", "--machines", "2", "--net-beta", "nan"], "--net-beta must be a finite number"),
    (["sim", "--machines", "2", "--placement", "random"], "invalid choice: 'random'"),
    (["sim", "--placement", "block"], "--placement models ranks on several machines"),
    (["explain", "--ring", "0,2,2,3"], "the ring must list each of the 4 ranks once, got 0,2,2,3"),
    (["explain", "--ring", "0;1"], "--ring: '0;1' is not a list of ranks such as 0,2,1,3"),
    (["sim", "--net-beta", "1e-9", "--placement", "block"],
     "--placement and --net-beta model ranks on several machines: give --machines too"),
    # An empty name (an unset shell variable) asks for a figure too: it drew none, said
    # nothing and exited 0.
    (["explain", "--svg", ""], "--svg: '' does not end in .svg"),
    (["sim", "--ranks", "3", "--chunk", "1M", "--timeline", ""],
     "--timeline: '' does not end in .svg"),
    (["sim", "--timeline", ""], "--timeline needs --chunk"),
    (["sim", "--machines", "2", "--timeline", ""], "not with --chunk or --timeline"),
])
def test_command_lines_refuse_what_they_cannot_do(argv, message):
    # A usage error, at once: not a traceback, a negative time, or minutes of work
    # and gigabytes of memory.
    done = subprocess.run([sys.executable, "-m", "ringreduce", *argv], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("argv", [["explain", "--ranks", "3", "--count", "6", "--svg", "r.svg"],
                                  ["sim", "--ranks", "3", "--bytes", "12M", "--chunk", "1M",
                                   "--timeline", "t.png"]])
def test_a_figure_without_matplotlib_is_a_usage_error_naming_the_plot_extra(tmp_path, argv):
    # matplotlib is no dependency: where it is missing (here: its import fails), the
    # command says so before any work, and names the extra that brings it
    # (tests/test_packaging.py checks that the extra is in the package's metadata).
    blocked = ("import sys; sys.modules['matplotlib'] = None; from ringreduce.__main__ "
               f"import main; sys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", blocked], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    option = argv[-2]
    assert (f"{option} needs matplotlib: pip install matplotlib, or install ringreduce with "
            "its plot extra (pip install '.[plot]' from its sources)") in done.stderr
    assert done.stdout == "" and not list(tmp_path.iterdir())


def test_explain_shows_up_to_its_chunk_cap_exactly():
    assert len(explain(3, 4096, 1).steps) == 4  # 4096 chunks: shown
    with pytest.raises(ValueError, match="more than 4096 chunks"):
        explain(3, 4097, 1)


@pytest.mark.parametrize("args", [(0, 12), (True, 12), (3.0, 12), (3, -1), (3, 2.5), (3, 1 << 62),
                                  (3, 12, 0), (3, 12, 2.5), (3, 12, True), (3, 12, "3")])
def test_explain_refuses_what_sim_refuses_in_the_same_words(args):
    # One set of rules for a ring's ranks, count and chunk (sim's): a float chunk
    # reached the core's RingSchedule and came back as pybind11's TypeError.
    with pytest.raises(ValueError, match=" must be ") as refused:
        explain(*args)
    if len(args) == 2:
        with pytest.raises(ValueError) as by_sim:
            sim.ring(*args)
        assert str(by_sim.value) == str(refused.value)


def test_the_schedule_gives_its_chunks_in_the_order_explain_shows():
    e = explain(3, 10, chunk_elems=2)
    s = _core.RingSchedule(1, 3, 10, 2)
    sent = s.phase_chunks("reduce_scatter", True)
    rs_steps = [step for step in e.steps if step.phase == "reduce-scatter"]
    assert [s.chunk(seg, c) for _, seg, c in sent] == [
        tuple(ch) for step in rs_steps for ch in step.transfers[1].chunks]
    assert [(k, seg) for k, seg, _ in s.phase_chunks("allgather", False)] == [
        (k, (1 - 1 - k) % 3) for k in range(2) for _ in range(s.num_chunks((1 - 1 - k) % 3))]
    with pytest.raises(ValueError, match="phase must be"):
        s.phase_chunks("all-gather", True)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 7])
def test_a_ring_in_any_order_leaves_each_segment_reduced_on_its_own_rank(ranks):
    # Ranks going round in another order (Communicator.ring, on several machines): each
    # rank's neighbours are its ring neighbours, what one sends at a step is what its
    # right neighbour receives, and after reduce-scatter rank s holds segment s summed
    # over every rank; after all-gather every rank holds every finished segment.
    rng = np.random.default_rng(ranks)
    for ring in [list(range(ranks)), list(rng.permutation(ranks))] + (
            [[0, 2, 1, 3]] if ranks == 4 else []):
        ring = [int(r) for r in ring]
        schedules = [_core.RingSchedule(r, ranks, 10 * ranks + 3, 4, ring)
                     for r in range(ranks)]
        for r, s in enumerate(schedules):
            q = ring.index(r)
            assert (s.position, s.left, s.right) == (
                q, ring[(q - 1) % ranks], ring[(q + 1) % ranks])
            assert s.segment(r) == _core.RingSchedule(r, ranks, 10 * ranks + 3, 4).segment(r)
        holds = [[{r} for _ in range(ranks)] for r in range(ranks)]  # holds[rank][segment]
        for phase in ("reduce_scatter", "allgather"):
            for k in range(ranks - 1):
                sends = [(s.right, getattr(s, f"{phase}_send_segment")(k), r)
                         for r, s in enumerate(schedules)]
                for to, segment, sender in sends:
                    assert getattr(schedules[to], f"{phase}_recv_segment")(k) == segment
                before = [[set(c) for c in row] for row in holds]
                for to, segment, sender in sends:
                    holds[to][segment] = (before[to][segment] | before[sender][segment]
                                          if phase == "reduce_scatter"
                                          else set(before[sender][segment]))
            if phase == "reduce_scatter":
                assert all(holds[r][r] == set(range(ranks)) for r in range(ranks)), ring
        assert all(c == set(range(ranks)) for row in holds for c in row), ring
    for bad in ([0] * ranks if ranks > 1 else [1], list(range(ranks + 1)),
                [ranks] + list(range(1, ranks))):
        with pytest.raises(ValueError, match="the ring must hold each of the"):
            _core.RingSchedule(0, ranks, 10, 4, bad)


def test_explain_follows_a_ring_in_another_order():
    # 0 -> 2 -> 1 -> 3 -> 0, as Communicator.ring on 4 ranks placed round-robin on two
    # machines: each segment starts at the rank after its owner on the ring and picks up
    # the ranks along it, its owner's data last; the numbers still add up to np.sum.
    e = explain(4, 8, values=True, ring=[0, 2, 1, 3])
    assert e.orders == ["x0+(x3+(x1+x2))", "x1+(x2+(x0+x3))", "x2+(x0+(x3+x1))",
                        "x3+(x1+(x2+x0))"]
    assert values_agree(e)
    for step in e.steps:
        senders = {t.to: t for t in step.transfers}
        for t in step.transfers:  # what a rank receives is what its left neighbour sends
            assert senders[t.rank].rank == t.source and senders[t.rank].segment == t.receives
            assert (t.to, t.source) == ({0: 2, 2: 1, 1: 3, 3: 0}[t.rank],
                                        {2: 0, 1: 2, 3: 1, 0: 3}[t.rank])
    text = format_text(e)
    assert "The ranks go round in the order 0 -> 2 -> 1 -> 3 -> 0" in text
    assert "rank 0 sends S3 to rank 2 (elements 6-7); receives S1 from rank 3" in text
    assert explain(4, 8, ring=[0, 1, 2, 3]).orders == explain(4, 8).orders
    assert "go round in the order" not in format_text(explain(4, 8, ring=[0, 1, 2, 3]))
    for bad in ([0, 1, 1, 3], [0, 1, 2], [0, 1, 2, 4], [0, 1.0, 2, 3]):
        with pytest.raises(ValueError, match="the ring must list each of the 4 ranks once"):
            explain(4, 8, ring=bad)


@pytest.mark.parametrize("ring", [None, [0, 3, 1, 5, 2, 4]])
def test_explain_writes_copies_of_many_ranks_as_runs_of_the_ring(ring):
    # (From a review: on 32 ranks, rows of x0+x1+... ran to 3,719 characters.) Past
    # three ranks a copy's data is a run of the ring, written by its ends; every cell
    # read back is the set the step holds.
    e = explain(6, 12, ring=ring)
    order = ring or list(range(6))
    text = format_text(e)
    ends = (order[-1], order[2])
    assert f"In the tables, x{ends[0]}+..+x{ends[1]} is " in text
    for step in e.steps:
        for row in step.holds:
            for held in row:
                cell = _sum(held, 6, order)
                if "+..+" in cell:
                    first, last = (int(x[1:]) for x in cell.split("+..+"))
                    at = order.index(first)
                    run = [order[(at + k) % 6] for k in range((order.index(last) - at) % 6 + 1)]
                    assert sorted(run) == held and len(held) > 3
                else:
                    assert cell == "all" or cell == "+".join(f"x{r}" for r in held)
    widest = max(map(len, format_text(explain(32, 64)).splitlines()))
    assert widest < 450, widest


def test_a_ring_across_machines_is_modelled_link_by_link():
    # 16 ranks of 1 MiB (equal segments of 64 KiB), placed round-robin on 2 machines.
    p, count, a, b, g, net = 16, 1 << 18, 1e-6, 1e-10, 2e-10, 3e-10
    machines = sim.placed(p, 2, "round-robin")
    assert machines == [r % 2 for r in range(p)] and sim.placed(p, 2, "block") == [0] * 8 + [1] * 8
    order = sim.machine_ring_order(machines)
    assert order == list(range(0, p, 2)) + list(range(1, p, 2))
    seg = count // p * 4
    # Rank order: every link crosses, 8 of them out of (and into) each machine at once.
    rank_order = sim.ring(p, count, 4, a, b, g, machines=machines, net_beta=net)
    crossing = a + seg * net * 8
    assert rank_order.seconds == pytest.approx((p - 1) * (crossing + seg * g) + (p - 1) * crossing)
    # Machine by machine: two links cross, one out of each machine; the rest are local.
    by_machine = sim.ring(p, count, 4, a, b, g, ring_order=order, machines=machines,
                          net_beta=net)
    step = max(a + seg * net, a + seg * b)
    assert by_machine.seconds == pytest.approx((p - 1) * (step + seg * g) + (p - 1) * step)
    assert by_machine.bytes_sent == rank_order.bytes_sent
    # One machine: the model without machines, to the last bit.
    assert sim.ring(p, count + 5, 4, a, b, g, machines=[0] * p, net_beta=net).seconds == \
        sim.ring(p, count + 5, 4, a, b, g).seconds
    with pytest.raises(ValueError, match="need one per rank"):
        sim.ring(p, count, machines=[0, 1])
    with pytest.raises(ValueError, match="placement must be"):
        sim.placed(p, 2, "cyclic")
    # (0 machines: a ZeroDivisionError round-robin, every rank on one machine in blocks.)
    for bad in (0, p + 1, 1.5, True):
        for placement in ("round-robin", "block"):
            with pytest.raises(ValueError, match=rf"machines must be an int from 1 to ranks "
                                                 rf"\({p}\), got {bad!r}"):
                sim.placed(p, bad, placement)
    assert sim.placed(np.int64(4), np.int64(2), "block") == [0, 0, 1, 1]


@pytest.mark.parametrize("model", ["ring", "naive", "recursive_doubling", "rabenseifner",
                                   "pipeline"])
def test_the_models_refuse_costs_the_command_line_refuses(model):
    # sim --alpha -1 is refused; sim.ring(..., alpha=-1) gave negative times.
    run = getattr(sim, model)
    args = (4, 1000, 100) if model == "pipeline" else (4, 1000)
    for name in ("alpha", "beta", "gamma") + (("net_beta",) if model == "ring" else ()):
        for bad in (-1e-6, float("nan"), float("inf"), "1e-6", True):
            with pytest.raises(ValueError, match=rf"^{name} must be a finite number of "
                                                 rf"seconds >= 0, got {re.escape(repr(bad))}"):
                run(*args, **{name: bad})
    assert run(*args, alpha=0, beta=np.float32(1e-10), gamma=0).seconds > 0


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_a_ring_across_machines_with_empty_segments_is_modelled(ranks):
    # Fewer elements than ranks: some links carry nothing at a step (the core sends no
    # message for an empty segment), which costs alpha like any step, on or off a machine.
    a = 1e-6
    for machines in (sim.placed(ranks, 2, "round-robin"), sim.placed(ranks, 2, "block")):
        for order in (None, sim.machine_ring_order(machines)):
            for count in range(ranks):
                r = sim.ring(ranks, count, 4, a, 1e-10, 2e-10, ring_order=order,
                             machines=machines, net_beta=3e-10)
                assert r.seconds == 0 if count == 0 else r.seconds >= 2 * (ranks - 1) * a
    done = subprocess.run([sys.executable, "-m", "ringreduce", "sim", "--ranks", "4",
                           "--bytes", "12", "--machines", "2"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "| 4 | rank order | 4 |" in done.stdout, done.stderr


def test_sim_compares_the_two_rings_on_machines():
    done = subprocess.run([sys.executable, "-m", "ringreduce", "sim", "--ranks", "16",
                           "--bytes", "1M", "--machines", "4"], capture_output=True, text=True,
                          timeout=60, check=True)
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| 16 |")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [
        ("rank order", "16"), ("machine by machine (the core's)", "4")]
    times = [float(r[3].split()[0]) for r in rows]
    assert times[1] < times[0]


def test_the_table_of_rings_on_machines_in_the_cost_model_is_what_sim_prints():
    page = (Path(__file__).resolve().parent.parent / "docs" / "cost-model.md").read_text()
    command = "python -m ringreduce sim --ranks 16 64 --bytes 100M --machines 2"
    assert command in page
    done = subprocess.run([sys.executable] + command.split()[1:], capture_output=True,
                          text=True, timeout=120, check=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 16 |")
            or line.startswith("| 64 |")]
    assert len(rows) == 4 and all(row in page for row in rows), rows


def _three_figures(value: float) -> str:
    """46.0, 42.9, 294: as docs/cost-model.md rounds the times it quotes."""
    return f"{value:#.3g}".rstrip(".")


def test_the_times_the_cost_model_quotes_for_1024_ranks_are_what_its_sim_command_prints():
    page = " ".join((Path(__file__).resolve().parent.parent / "docs" / "cost-model.md")
                    .read_text().split())
    command = ".venv/bin/python -m ringreduce sim --ranks 4 64 1024 --bytes 100M"
    assert command in page
    done = subprocess.run([sys.executable] + command.split()[1:], capture_output=True,
                          text=True, timeout=120, check=True)
    ms = {}
    for line in done.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == "1024":
            ms[cells[1]] = float(cells[-1].removesuffix(" ms"))
    assert set(ms) == {"ring", "naive", "recursive doubling", "Rabenseifner"}, done.stdout
    said = (f"for 100 MiB on 1024 ranks: ring {_three_figures(ms['ring'])} ms, naive "
            f"{_three_figures(ms['naive'] / 1e3)} s, recursive doubling "
            f"{_three_figures(ms['recursive doubling'])} ms, Rabenseifner "
            f"{_three_figures(ms['Rabenseifner'])} ms")
    assert said in page, said


def test_the_cost_model_table_is_the_model_with_the_stored_fit():
    # docs/cost-model.md's table of ring, naive, recursive doubling and Rabenseifner's, which
    # benchmarks/plot_cost_model.py prints, row by row against ringreduce.sim with the
    # alpha, beta and gamma of benchmarks/results/model_p2.json (and the fit as the text
    # gives it).
    import json

    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "cost-model.md").read_text()
    fit = json.loads((root / "benchmarks" / "results" / "model_p2.json").read_text())
    alpha, beta, gamma = fit["alpha_s"], fit["beta_s_per_byte"], fit["gamma_s_per_byte"]
    assert (f"α = {alpha * 1e6:.1f} µs, β = {beta * 1e9:.3f} ns/byte ({1e-9 / beta:.2f} GB/s), "
            f"γ = {gamma * 1e9:.3f} ns/byte ({1e-9 / gamma:.2f} GB/s)") in " ".join(page.split())
    rows = re.findall(r"^\| (\d+) (KiB|MiB) \| (\d+) \| ([\d.]+ ms) \| ([\d.]+ ms) \| ([\d.]+ ms) "
                      r"\| ([\d.]+ ms) \|$", page, re.M)
    assert len(rows) == 9, rows

    def ring(ranks, count):
        # Simulating 1024 ranks takes seconds a size; where p divides the count, the
        # simulated ring takes the table's formula to the rounding, as checked here once.
        if ranks < 1024:
            return sim.ring(ranks, count, 4, alpha, beta, gamma).seconds
        nbytes = count * 4
        return (2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes * beta
                + (ranks - 1) / ranks * nbytes * gamma)

    assert ring(1024, 1024) == pytest.approx(sim.ring(1024, 1024, 4, alpha, beta, gamma).seconds,
                                             rel=1e-12)
    for number, unit, ranks, *shown in rows:
        count = (int(number) << (10 if unit == "KiB" else 20)) // 4
        modelled = [ring(int(ranks), count)] + [
            fn(int(ranks), count, 4, alpha, beta, gamma).seconds
            for fn in (sim.naive, sim.recursive_doubling, sim.rabenseifner)]
        assert shown == [f"{t * 1e3:.3f} ms" for t in modelled], (number, unit, ranks)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_pipeline_with_one_chunk_per_segment_is_the_step_by_step_ring(ranks):
    count = ranks * 1000
    one = sim.pipeline(ranks, count, 1000)
    assert one.seconds == pytest.approx(sim.ring(ranks, count).seconds, rel=1e-12)
    assert len([b for b in one.busy if b.resource == "link"]) == ranks * 2 * (ranks - 1)


@pytest.mark.parametrize("ranks,chunks", [(2, 4), (3, 1), (3, 5), (4, 8)])
def test_pipeline_without_reducing_keeps_every_link_busy(ranks, chunks):
    # With nothing to reduce, each link sends its 2(p-1) segments back to back.
    segment, alpha, beta = 1200 * chunks, 3e-6, 2e-10
    t = sim.pipeline(ranks, ranks * segment, 1200, 4, alpha, beta, 0.0)
    expected = 2 * (ranks - 1) * (chunks * alpha + segment * 4 * beta)
    assert t.seconds == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("ranks,count,chunk,gather", [
    (2, 4096, 100, None), (3, 3 << 20, 1 << 18, None), (3, 3 << 20, 1 << 16, 1 << 22),
    (3, 10, 2, 3), (4, 7, 1, None), (5, 100_003, 999, 5000), (3, 2, 1, None)])
def test_pipeline_follows_every_chunk_from_rank_to_rank(ranks, count, chunk, gather):
    t = sim.pipeline(ranks, count, chunk, allgather_chunk_elems=gather)
    phases = (("reduce-scatter", "reduce_scatter", chunk),
              ("all-gather", "allgather", chunk if gather is None else gather))
    for r in range(ranks):
        for resource in ("link", "cpu"):
            mine = [b for b in t.busy if b.rank == r and b.resource == resource]
            # one after another, in the order the core takes them
            assert all(a.end <= b.start + 1e-15 for a, b in zip(mine, mine[1:]))
            order = [(name, *ref) for name, phase, elems in phases
                     for ref in _core.RingSchedule(r, ranks, count, elems).phase_chunks(
                         phase, resource == "link")
                     if resource == "link" or name == "reduce-scatter"]
            assert [(b.phase, b.step, b.segment, b.chunk) for b in mine] == order
        # all-gather starts once this rank's reduce-scatter is over, as in the core
        gathered = [b.start for b in t.busy if b.rank == r and b.phase == "all-gather"]
        scattered = [b.end for b in t.busy if b.rank == r and b.phase == "reduce-scatter"]
        assert not gathered or min(gathered) >= max(scattered)
    sends = {(b.rank, b.phase, b.step, b.segment, b.chunk): b for b in t.busy
             if b.resource == "link"}
    reduces = {(b.rank, b.phase, b.step, b.segment, b.chunk): b for b in t.busy
               if b.resource == "cpu"}
    for (r, phase, k, seg, c), b in reduces.items():  # added after it arrived
        assert b.start >= sends[((r - 1) % ranks, phase, k, seg, c)].end
    for (r, phase, k, seg, c), b in sends.items():  # sent on after it arrived (and was added)
        if phase == "reduce-scatter" and k > 0:
            assert b.start >= reduces[(r, phase, k - 1, seg, c)].end
        elif phase == "all-gather" and k > 0:
            assert b.start >= sends[((r - 1) % ranks, phase, k - 1, seg, c)].end
    # Never longer than sending each step's chunks one after another once the step
    # before has ended everywhere; never shorter than the busiest link's work.
    largest = -(-count // ranks) * 4
    chunks = [sim.chunks_per_segment(ranks, count, e) for _, _, e in phases]
    serial = (ranks - 1) * (chunks[0] * sim.ALPHA + largest * (sim.BETA + sim.GAMMA)) + \
        (ranks - 1) * (chunks[1] * sim.ALPHA + largest * sim.BETA)
    assert t.seconds <= serial * (1 + 1e-12)
    link_work = max(sum(b.end - b.start for b in sends.values() if b.rank == r)
                    for r in range(ranks))
    assert t.seconds >= link_work * (1 - 1e-12)


def test_pipelining_pays_until_chunks_cost_more_in_messages_than_they_overlap():
    count = 3 << 20  # 12 MiB on 3 ranks, the docs' figure
    factor = _core.COPY_CHUNK_FACTOR

    def modelled(chunk):
        return sim.pipeline(3, count, chunk, allgather_chunk_elems=chunk * factor).seconds

    one, quarter, tiny = modelled(1 << 20), modelled(1 << 18), modelled(1 << 10)
    assert quarter < 0.75 * one  # adding chunk c while chunk c+1 travels
    assert tiny > quarter  # 2 us a message, 1024 chunks a segment


@pytest.mark.parametrize("bad", [0, -1, 1 << 62, 2.5, True])
def test_pipeline_refuses_chunks_it_cannot_cut(bad):
    with pytest.raises(ValueError, match="chunk_elems must be an int from 1 to 2\\*\\*62 - 1"):
        sim.pipeline(3, 100, bad)
    with pytest.raises(ValueError, match="allgather_chunk_elems must be"):
        sim.pipeline(3, 100, 10, allgather_chunk_elems=bad)


def test_pipeline_of_nothing_or_of_one_rank_takes_no_time():
    assert sim.pipeline(3, 0, 1).seconds == 0.0 and sim.pipeline(3, 0, 1).busy == []
    assert sim.pipeline(1, 1000, 10).seconds == 0.0


def test_explain_in_chunks_names_the_sim_command_that_draws_their_overlap(tmp_path):
    # Explain shows chunked steps whole, one after another; the command it names draws
    # the same ring pipelined, and runs as printed.
    text = format_text(explain(3, 12, chunk_elems=2))
    command = [line.strip() for line in text.splitlines()
               if line.strip().startswith("python -m ringreduce sim")]
    assert command == ["python -m ringreduce sim --ranks 3 --bytes 48 --chunk 8 "
                       "--allgather-factor 1 --timeline pipeline.svg"]
    done = subprocess.run([sys.executable] + shlex.split(command[0])[1:], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pipeline.svg").stat().st_size > 0
    # None where sim cannot draw it, nor where no segment has more than one chunk.
    for ranks, count, chunk in [(9, 27, 1), (3, 12, None), (2, 200, 1)]:
        assert "ringreduce sim" not in format_text(explain(ranks, count, chunk))


def test_sim_command_line_models_and_draws_the_pipeline(tmp_path):
    figure = tmp_path / "pipeline.svg"
    done = subprocess.run([sys.executable, "-m", "ringreduce", "sim", "--ranks", "3", "--bytes",
                           "12M", "--chunk", "1M", "256K", "--allgather-factor", "4",
                           "--timeline", str(figure)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    one = sim.pipeline(3, 3 << 20, 1 << 20).seconds
    assert f"| 3 | ring | 4 | 16,777,216 | {one * 1e3:.3f} ms |" in done.stdout
    chunked = sim.pipeline(3, 3 << 20, 1 << 18, allgather_chunk_elems=1 << 20).seconds
    assert f"| 3 | ring in chunks of 1 MiB | 4 | 16,777,216 | {chunked * 1e3:.3f} ms |" in done.stdout
    assert "| 3 | ring in chunks of 256 KiB |" in done.stdout
    assert "all-gather in chunks 4 times larger" in done.stdout
    assert figure.read_text().lstrip().startswith(("<?xml", "<svg"))
    # With nothing to take time, nothing to divide by.
    free = subprocess.run([sys.executable, "-m", "ringreduce", "sim", "--ranks", "2", "--bytes",
                           "1M", "--chunk", "256K", "--alpha", "0", "--beta", "0", "--gamma",
                           "0", "--timeline", str(tmp_path / "free.png")],
                          capture_output=True, text=True, timeout=120)
    assert free.returncode == 0, free.stderr


def test_the_pipeline_table_in_the_docs_is_what_the_simulator_says():
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "ring.md").read_text()
    header = next(line for line in page.splitlines() if line.startswith("| chunk |"))
    times = next(line for line in page.splitlines() if line.startswith("| modelled all-reduce time |"))
    sizes = [cell.split(" (")[0] for cell in header.strip("|").split("|")[1:]]
    factor = _core.COPY_CHUNK_FACTOR  # the command's default
    shown_times = times.strip("|").split("|")[1:]
    assert len(shown_times) == len(sizes)
    for size, shown in zip(sizes, shown_times):
        chunk = sim.parse_bytes(size.replace(" ", "")) // 4
        t = sim.pipeline(3, 3 << 20, chunk, allgather_chunk_elems=chunk * factor)
        assert shown.strip() == f"{t.seconds * 1e3:.2f} ms", size

    def reduce_scatter_ms(chunk):  # when the last rank's reduce-scatter is over
        t = sim.pipeline(3, 3 << 20, chunk, allgather_chunk_elems=chunk * factor)
        return max(b.end for b in t.busy if b.phase == "reduce-scatter") * 1e3

    said = f"takes {reduce_scatter_ms(1 << 18):.2f} ms instead of {reduce_scatter_ms(1 << 20):.2f} ms"
    assert said in " ".join(page.split()), said


def test_explain_prints_no_trailing_spaces_and_says_where_all_gather_chunks_differ():
    text = format_text(explain(3, 7, 2))
    assert all(line == line.rstrip() for line in text.splitlines())
    assert "chunks of at most 2 elements" in text and "S1: elements 3-4, 1 chunk\n" in text
    said = " ".join(text.split())
    assert f"up to {_core.COPY_CHUNK_FACTOR} times larger" in said
    assert "times larger" not in format_text(explain(3, 7))  # (one chunk per segment)
    assert "at most 1 element:" in format_text(explain(2, 2))


def test_nothing_to_reduce_makes_no_steps_in_explain_and_sim():
    # As the core: no ring steps for no elements, and no time.
    e = explain(4, 0)
    assert e.steps == []
    assert "no steps" in format_text(e)
    for algorithm in sim.ALGORITHMS.values():
        r = algorithm(3, 0)
        assert (r.steps, r.seconds, r.max_bytes_sent) == (0, 0.0, 0)
    assert sim.pipeline(3, 0, 4).seconds == 0.0


def test_ranks_bytes_differ_by_up_to_two_elements_when_segments_are_uneven():
    # Rank r sends every segment but its own (reduce-scatter) and its right
    # neighbour's (all-gather), as docs/ring.md says.
    for ranks, count in ((4, 6), (5, 7), (3, 10)):
        bounds = [(a, a + n) for a, n in (_core.RingSchedule(0, ranks, count, count)
                                          .segment(s) for s in range(ranks))]
        size = [b - a for a, b in bounds]
        expected = [4 * (2 * count - size[r] - size[(r + 1) % ranks]) for r in range(ranks)]
        assert sim.ring(ranks, count).bytes_sent == expected
    assert max(sim.ring(4, 6).bytes_sent) - min(sim.ring(4, 6).bytes_sent) == 2 * 4


@pytest.mark.parametrize("call", [lambda: sim.ring(0, 10), lambda: sim.naive(3, -5),
                                  lambda: sim.recursive_doubling(0, 10),
                                  lambda: sim.rabenseifner(2, 10, elem_size=-1),
                                  lambda: sim.ring(2, 10, elem_size=0)])
def test_the_models_refuse_what_no_ring_is(call):
    with pytest.raises(ValueError, match="must be"):
        call()


def test_sizes_are_whole_bytes():
    assert sim.parse_bytes("1e3") == 1000
    assert sim.parse_bytes("1.5M") == 3 << 19
    assert sim.parse_bytes("64KiB") == sim.parse_bytes("64kb") == 65536
    for bad in ("0.1K", "1.0001K", "nan", "inf", "", "K"):
        with pytest.raises(ValueError):
            sim.parse_bytes(bad)


def test_sim_takes_repeated_ranks_options_together():
    done = subprocess.run([sys.executable, "-m", "ringreduce", "sim", "--ranks", "3",
                           "--ranks", "5", "--bytes", "1K"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "| 3 | ring |" in done.stdout and "| 5 | ring |" in done.stdout
    assert "| 64 |" not in done.stdout  # (the default list is not added to)


def test_ctrl_c_ends_a_command_without_a_traceback(capsys):
    from ringreduce.__main__ import run_command

    def interrupted(argv):
        raise KeyboardInterrupt

    assert run_command(interrupted, []) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_the_reference_refuses_what_the_core_refuses():
    # (One rank: COMM_WORLD of this process.)
    with pytest.raises(rr.UnsupportedOpError, match="integer average"):
        reference.allreduce(np.ones(3, np.int32), "avg")
    with pytest.raises(TypeError, match="dtype <U1"):
        reference.allreduce(np.array(["a", "b"]))
    with pytest.raises(rr.UnsupportedOpError, match="a bool has no average"):
        reference.allreduce(np.ones(3, bool), "avg")
    with pytest.raises(ValueError, match="op 'mean' is not one of"):
        reference.reduce_scatter(np.ones(3), "mean")
    from mpi4py import MPI
    np.testing.assert_array_equal(reference.allreduce(np.arange(3.0), MPI.MAX), np.arange(3.0))


def _explained_values(ranks, count, chunk=None):
    """Run `explain --values` and read back what it printed: the inputs; for each step,
    its whose-data table (a set of ranks per rank and segment) and every rank's numbers;
    and the closing result and np.sum lines. Each line of numbers must be laid out as
    the segments are: a group of zero-padded numbers, one digit per rank, per segment."""
    argv = ["--ranks", str(ranks), "--count", str(count)] + \
        ([] if chunk is None else ["--chunk", str(chunk)])
    done = subprocess.run([sys.executable, "-m", "ringreduce", "explain", "--values", *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    sizes = [len(a) for a in np.array_split(np.empty(count), ranks)]
    lines = done.stdout.splitlines()

    def numbers(line, label):
        assert line.startswith(f"  {label}".ljust(10)), (label, line)
        groups = re.split(r" {2,}", line[10:].strip())
        assert [0 if g == "-" else len(g.split()) for g in groups] == sizes, line
        tokens = [t for g in groups if g != "-" for t in g.split()]
        assert all(len(t) == ranks for t in tokens), line
        return np.array([int(t) for t in tokens], dtype=np.int64)

    def whose(cell):
        return set(range(ranks)) if cell == "all" else {int(x) for x in
                                                       cell.replace("x", "").split("+")}

    start = next(i for i, line in enumerate(lines) if line.startswith("With --values"))
    header = next(i for i in range(start, len(lines)) if lines[i].startswith("          S0"))
    inputs = np.array([numbers(lines[header + 1 + r], f"rank {r}") for r in range(ranks)])
    steps = []
    for i, line in enumerate(lines):
        if line == "  afterwards, whose data each rank's copy of each segment holds:":
            steps.append({"holds": [[whose(c) for c in lines[i + 2 + r][10:].split()]
                                    for r in range(ranks)]})
        elif line == "  afterwards, the numbers each rank holds:":
            steps[-1]["values"] = np.array([numbers(lines[i + 2 + r], f"rank {r}")
                                            for r in range(ranks)])
    result = next(i for i, line in enumerate(lines) if line.startswith("  result  "))
    return (inputs, steps, numbers(lines[result], "result"),
            numbers(lines[result + 1], "np.sum"), lines[result + 2])


def _ring_by_the_book(inputs):
    """Every rank's buffer after each step, the steps taken as reference.py takes them
    (whole segments, its send and receive formulas), with no RingSchedule and no chunks."""
    ranks, count = inputs.shape
    bounds = reference.segment_bounds(count, ranks)
    work, after = inputs.copy(), []
    for reduces, received in ((True, lambda r, k: (r - 2 - k) % ranks),
                              (False, lambda r, k: (r - 1 - k) % ranks)):
        for k in range(ranks - 1):
            before = work.copy()
            for r in range(ranks):
                part = slice(*bounds[received(r, k)])
                came = before[(r - 1) % ranks, part]
                work[r, part] = work[r, part] + came if reduces else came
            after.append(work.copy())
    return after


@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("ranks,count", [(1, 5), (2, 5), (3, 7), (4, 12), (4, 3)])
def test_explain_values_are_the_ring_done_by_hand_and_end_as_the_plain_sum(ranks, count, chunk):
    inputs, steps, result, plain_sum, verdict = _explained_values(ranks, count, chunk)
    # Rank r holds element i's tag, i % 9 + 1, in its own digit (rank 0's the leftmost).
    expected_inputs = np.array([[(i % 9 + 1) * 10 ** (ranks - 1 - r) for i in range(count)]
                                for r in range(ranks)])
    np.testing.assert_array_equal(inputs, expected_inputs)
    by_the_book = _ring_by_the_book(expected_inputs)
    assert len(steps) == len(by_the_book) == 2 * (ranks - 1)
    for k, (step, book) in enumerate(zip(steps, by_the_book)):
        np.testing.assert_array_equal(step["values"], book, err_msg=f"step {k + 1}")
        # and each copy of each segment is the sum of what the whose-data table names
        for r in range(ranks):
            for s, (first, stop) in enumerate(reference.segment_bounds(count, ranks)):
                named = sum(expected_inputs[c, first:stop] for c in step["holds"][r][s])
                np.testing.assert_array_equal(step["values"][r, first:stop], named)
    np.testing.assert_array_equal(plain_sum, expected_inputs.sum(axis=0))
    np.testing.assert_array_equal(result, expected_inputs.sum(axis=0))
    if steps:
        assert (steps[-1]["values"] == result).all()  # every rank's buffer
    assert verdict == "Checked: the same on every rank, and the same as np.sum."


def test_explain_values_in_the_docs_x0_plus_x3_is_7007():
    # The worked example the output and docs/ring.md give: rank 0's S2 after step k=0.
    e = explain(4, 12, values=True)
    assert e.steps[0].holds[0][2] == [0, 3]
    assert list(e.steps[0].values[0, 6:9]) == [7007, 8008, 9009]
    assert "x0+x3 at element 6: 7000 + 0007 = 7007" in " ".join(format_text(e).split())
    # (From a review.) Element 6 whatever the size: on 3 ranks of 7 elements it named a
    # sum, 707, that no table holds. The example is now a sum the first step's tables
    # show, for any size and ring (segment p-2's first element, a later review found,
    # was not: it is empty below p-1 elements, and elsewhere on another ring).
    e = explain(3, 7, values=True)
    assert "x0+x2 at element 3: 400 + 004 = 404" in " ".join(format_text(e).split())
    for ranks in range(2, 7):
        for ring in (None, [0, *range(ranks - 1, 0, -1)], [*range(1, ranks), 0]):
            for count in range(1, 13):
                e = explain(ranks, count, values=True, ring=ring)
                said = re.search(r"at element (\d+): \d+ \+ \d+ = (\d+)\)",
                                 " ".join(format_text(e).split()))
                element, total = int(said[1]), int(said[2])
                assert total in e.steps[0].values[:, element], (ranks, ring, count, said[0])


def test_explain_values_says_so_when_the_steps_do_not_give_the_sum():
    # The check is live: a buffer off by one, or a ring whose receives only copy,
    # is reported, and the command fails.
    e = explain(3, 6, values=True)
    e.steps[-1].values[1, 2] += 1
    text = format_text(e)
    assert "WRONG: rank 1 differs from np.sum" in text and "Checked" not in text
    assert not values_agree(e)
    copying = ("import sys; from ringreduce import explain as x; receive = x._receive; "
               "x._receive = lambda *a: receive(*a[:-1], False); "
               "from ringreduce.__main__ import main; "
               "sys.exit(main(['explain', '--values', '--ranks', '3', '--count', '6']))")
    done = subprocess.run([sys.executable, "-c", copying], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "WRONG: rank 0, rank 1, rank 2 differ from np.sum" in done.stdout


@pytest.mark.parametrize("ranks", range(1, 9))
def test_explain_values_takes_every_count_whose_lines_fit_and_refuses_one_more(ranks):
    most = 0
    while True:
        try:
            explain(ranks, most + 1, values=True)
        except ValueError as refused:
            assert f"use at most {most} elements" in str(refused)
            break
        most += 1
    assert most >= ranks  # at least a number in every segment
    rows = [line for line in format_text(explain(ranks, most, values=True)).splitlines()
            if re.fullmatch(r"  (rank \d|result|np\.sum) +[\d -]+", line)]
    assert len(rows) == ranks * (1 + 2 * (ranks - 1)) + 2  # inputs, each step, the end
    widest = max(len(line) for line in rows)
    # within the limit, and one more number (its digits and a space) would not be
    assert widest <= MAX_VALUES_LINE < widest + ranks + 1


def test_explain_says_what_each_rank_sent_and_infers_ranks_from_the_ring():
    # The closing line gave only 2(p-1)/p x N on average (9.33333 elements on 3 ranks
    # of 7), where the ranks send 9, 10 and 9: the counts from the steps themselves.
    def run(*argv):
        done = subprocess.run([sys.executable, "-m", "ringreduce", "explain", *argv],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return " ".join(done.stdout.split())

    uneven = run("--ranks", "3", "--count", "7")
    assert ("Each rank sent 9 to 10 elements and received 9 to 10: 2(p-1)/p x N = 9.33 on "
            "average, for N = 7 elements, in 2(p-1) = 4 steps (p does not divide N") in uneven
    e = explain(3, 7)
    sent = [sum(n for step in e.steps for t in step.transfers if t.rank == r for _, n in t.chunks)
            for r in range(3)]
    assert sorted(sent) == [9, 9, 10] and sent == sim.ring(3, 7, 1).bytes_sent
    assert "Each rank sent 18 elements and received 18:" in run("--ranks", "4", "--count", "12")
    # --ring alone sets the ranks (it was refused against the default of 4).
    assert "on 3 ranks" in run("--ring", "0,2,1")
    # A chunk larger than a segment is one chunk per segment, and says so.
    assert "chunks of at most 3 elements" in run("--ranks", "3", "--count", "9", "--chunk", "100")
    assert "copies it over its own" in uneven


@pytest.mark.parametrize("ranks, count, average", [
    (4, 1001, "1501.5"),  # the ranks send 1501 and 1502; 3 digits made it 1.5e+03
    (32, 100000, "193750"),  # whole: as the counts beside it, not 1.94e+05
    (3, 7, "9.33"), (5, 3, "4.8"), (4, 12, "18"),
    (3, (1 << 62) - 1, "6148914691236517204"),  # past a float's 53 bits, exactly
    (3, (1 << 62) - 2, "6148914691236517202.67"),
])
def test_explain_gives_the_average_it_holds_against_the_counts_sent_in_full(ranks, count,
                                                                             average):
    text = " ".join(format_text(explain(ranks, count)).split())
    assert f"2(p-1)/p x N = {average} on average, for N = {count} element" in text


def test_a_ring_given_as_a_numpy_array_is_the_same_ring():
    # sim.ring raised numpy's "truth value of an array is ambiguous", and explain said
    # that the ring did not list each rank once, of an order such as np.argsort gives.
    order = np.array([0, 2, 1, 3])
    assert sim.ring(4, 9, ring_order=order).bytes_received == \
        sim.ring(4, 9, ring_order=[0, 2, 1, 3]).bytes_received != sim.ring(4, 9).bytes_received
    e = explain(4, 9, ring=order)
    assert e.ring == [0, 2, 1, 3] and all(type(r) is int for r in e.ring)
    assert format_text(e) == format_text(explain(4, 9, ring=[0, 2, 1, 3]))
    with pytest.raises(ValueError, match="must list each of the 2 ranks once"):
        explain(2, 4, ring=[True, False])  # (not ranks, though they compare equal to 1, 0)


def test_sizes_worked_out_with_numpy_are_taken_as_ints():
    # np.int64(4) was refused ("ranks must be a positive int, got np.int64(4)"), as
    # sizes a learner works out with numpy are: every model, and explain, take any
    # integer (operator.index), and give what Python's ints give.
    ranks, count, size = np.int64(4), np.int64(12), np.dtype(np.float32).itemsize
    for model in sim.ALGORITHMS.values():
        assert model(ranks, count, np.int32(size)) == model(4, 12, 4)
        assert all(type(n) is int for n in model(ranks, count).bytes_sent)
    assert sim.pipeline(ranks, count, np.uint8(2), np.int16(4), allgather_chunk_elems=np.int64(3)) \
        == sim.pipeline(4, 12, 2, 4, allgather_chunk_elems=3)
    assert format_text(explain(ranks, count, np.int64(2), values=True)) == \
        format_text(explain(4, 12, 2, values=True))
    # Still not a bool, a float (whole or not) or a string, numpy's or Python's.
    for bad in (np.True_, np.float64(4.0), 4.0, "4", True):
        with pytest.raises(ValueError, match="ranks must be a positive int"):
            sim.ring(bad, 12)
        with pytest.raises(ValueError, match="chunk_elems must be an int"):
            sim.pipeline(4, 12, bad)


def test_the_models_refuse_at_once_what_would_take_minutes_and_do_what_is_cheap():
    # sim.ring(10**9, ...) set out to make a billion schedules, and the other models
    # lists of a billion counts (the command line stops at 4096 ranks; the Python API
    # stopped nowhere).
    def not_a_step(done, total):
        raise AssertionError("simulated a step instead of refusing")

    with pytest.raises(ValueError, match=r"sim\.ring: ranks must be at most 4,096 here, got "
                                         r"4,097: the ring is simulated rank by rank"):
        sim.ring(sim.MAX_RANKS + 1, 1, progress=not_a_step)
    with pytest.raises(ValueError, match="at most 4,096 here, got 1,000,000,000"):
        sim.ring(10 ** 9, 10 ** 6)
    most = sim.MAX_MODEL_RANKS
    for name, model in sim.ALGORITHMS.items():
        with pytest.raises(ValueError, match=f"at most {most:,} here, got {most + 1:,}: .*"
                                             "the formulas in docs/cost-model.md"):
            model(most + 1, 0)
    # Cheap work is done: nothing on many ranks, and the models that need no
    # step-by-step ring, at their limit (Rabenseifner's round by round for all ranks at
    # once: element by element, it took some 20 s for a million ranks).
    assert sim.ring(most, 0).max_bytes_sent == 0 and sim.ring(1, 10 ** 9).steps == 0
    assert sim.pipeline(10 ** 9, 0, 1).busy == []  # (was refused: "1,000,000 pieces of work")
    for model in (sim.naive, sim.recursive_doubling, sim.rabenseifner):
        r = model(most - 1, 1000)
        assert len(r.bytes_sent) == most - 1 and r.seconds > 0
    # 2**19 - 1 ranks fold into as many others, which send them the result at the end.
    r, within = sim.rabenseifner(most - 1, 1000), sim.rabenseifner(most // 2, 1000)
    assert r.bytes_sent[0] == within.bytes_sent[0] + 4000 and r.bytes_sent[-1] == 4000
    assert r.bytes_sent[most // 2 - 1] == within.bytes_sent[most // 2 - 1]  # (no partner)


def test_pipeline_cuts_no_chunk_larger_than_the_cores_largest_message():
    # The core cuts chunks of at most 1 GiB (RingCommunicator::chunk_elems), the
    # all-gather's 64 times larger ones too (copy_chunk_elems); the model took 4 GiB
    # segments whole, in one chunk, and so did the all-gather of `sim --chunk 64M`.
    most = _core.MAX_CHUNK_BYTES
    assert most == 1 << 30
    t = sim.pipeline(2, 1 << 31, 1 << 30, allgather_chunk_elems=1 << 36)  # 4 GiB segments
    assert (t.chunk_elems, t.allgather_chunk_elems) == (most // 4, most // 4)
    # Each rank sends and adds 4 chunks in reduce-scatter and sends 4 in all-gather.
    assert len(t.busy) == 2 * (4 + 4 + 4) == sim.timeline_entries(2, 1 << 31, 1 << 30, 1 << 36)
    assert [b.end - b.start for b in t.busy if b.resource == "cpu"] == \
        pytest.approx([most * sim.GAMMA] * 8)
    bytes_wide = sim.pipeline(2, 1 << 31, 1 << 30, elem_size=1)
    assert (bytes_wide.chunk_elems, bytes_wide.allgather_chunk_elems) == (most, most)
    assert sim.pipeline(2, 1 << 31, 1 << 26, allgather_chunk_elems=1 << 32) == \
        sim.pipeline(2, 1 << 31, 1 << 26, allgather_chunk_elems=most // 4)
    # The command line: no --chunk the core would refuse, and the all-gather's chunks
    # capped, as its heading says.
    done = subprocess.run([sys.executable, "-m", "ringreduce", "sim", "--ranks", "2",
                           "--bytes", "8G", "--chunk", "2G"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--chunk: '2G' is more than the core's largest chunk, " \
        "1 GiB" in done.stderr
    done = subprocess.run([sys.executable, "-m", "ringreduce", "sim", "--ranks", "2",
                           "--bytes", "8G", "--chunk", "64M"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "all-gather in chunks 64 times larger, at most 1 GiB" in done.stdout
    capped = sim.pipeline(2, 1 << 31, 1 << 24, allgather_chunk_elems=most // 4)
    assert f"| 2 | ring in chunks of 64 MiB | 2 | 8,589,934,592 | " \
           f"{capped.seconds * 1e3:.3f} ms |" in done.stdout
    assert sum(b.phase == "all-gather" for b in capped.busy) == 2 * 4  # (not 2 * 1)
    # Explain names no sim command the simulator would refuse.
    assert "ringreduce sim" in format_text(explain(2, 1 << 29, 1 << 27))
    assert "ringreduce sim" not in format_text(explain(2, 1 << 31, 1 << 29))


def test_explain_refuses_a_figure_it_cannot_write_before_printing_the_steps(monkeypatch, capsys,
                                                                             tmp_path):
    # It printed every step, then "--svg: cannot write" and exit status 2, where sim
    # --timeline refuses such a folder first.
    from ringreduce import explain as explain_module

    real = os.access
    monkeypatch.setattr(explain_module.os, "access", lambda path, mode, **kw: False
                        if mode == os.W_OK and str(path) == str(tmp_path) else real(path, mode))
    with pytest.raises(SystemExit) as stopped:
        explain_module.main(["--ranks", "3", "--count", "6", "--svg", str(tmp_path / "r.svg")])
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "--svg: cannot write into the folder of" in err
