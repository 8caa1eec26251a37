"""The explainer and the simulator, in one process (their MPI check is in tests/mpi)."""
import subprocess
import sys

import pytest

from ringreduce import sim
from ringreduce.explain import explain, format_text


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
    assert "reduce-scatter, step 1 of 3" in text and "all-gather, step 3 of 3" in text
    assert "rank 0 sends S3 to rank 1" in text
    assert "x0+x3" in text  # rank 0's copy of S2 after step 1


def test_command_line_writes_the_figure(tmp_path):
    figure = tmp_path / "ring.svg"
    done = subprocess.run([sys.executable, "-m", "ringreduce", "explain", "--ranks", "3",
                           "--count", "7", "--chunk", "2", "--svg", str(figure)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "all-gather, step 2 of 2" in done.stdout
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


def test_sim_command_line():
    done = subprocess.run([sys.executable, "-m", "ringreduce", "sim", "--ranks", "8", "1000",
                           "--bytes", "1M"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| 1000 | ring | 1998 |" in done.stdout


@pytest.mark.parametrize("argv, message", [
    (["sim", "--bytes", "10Q"], "--bytes: '10Q' is not a size"),
    (["sim", "--bytes", "infK"], "--bytes: 'infK' is not a size"),
    (["sim", "--alpha", "-1"], "--alpha must be a finite number"),
    (["sim", "--beta", "nan"], "--beta must be a finite number"),
    (["explain", "--ranks", "500"], "at most 32 here"),
    (["explain", "--count", "100000000", "--chunk", "1"], "more than 4096 chunks"),
    (["sim", "--bytes", "6"], "not a whole number of float32 elements"),
    (["sim", "--ranks", "4", "5000"], "--ranks: at most 4096"),
    (["explain", "--count", str(1 << 63)], "count must be an int from 0 to 2**62 - 1"),
    (["explain", "--chunk", str(1 << 63)], "chunk_elems must be from 1 to 2**62 - 1"),
    (["explain", "--svg", "/nonexistent-folder/ring.svg"], "does not exist"),
    (["explain", "--svg", "ring.xyz"], "does not end in .svg, .png or .pdf"),
    (["bogus"], "usage: python -m ringreduce"),
])
def test_command_lines_refuse_what_they_cannot_do(argv, message):
    # A usage error, at once: not a traceback, a negative time, or minutes of work
    # and gigabytes of memory.
    done = subprocess.run([sys.executable, "-m", "ringreduce", *argv], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_explain_shows_up_to_its_chunk_cap_exactly():
    assert len(explain(3, 4096, 1).steps) == 4  # 4096 chunks: shown
    with pytest.raises(ValueError, match="more than 4096 chunks"):
        explain(3, 4097, 1)
