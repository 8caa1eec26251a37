"""The benchmark scripts run, end to end, on 2 ranks at a few small sizes, and their
output holds what docs/performance.md is made from. Speed is not checked here: it is
measured by running the benchmarks on purpose, never asserted in a test."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import job_env, mpiexec

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(tmp_path, script: str, *args: str):
    """benchmarks/script on 2 ranks with args and --json: the finished process (which
    must have succeeded) and what it wrote."""
    result = tmp_path / "result.json"
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", f"benchmarks/{script}", *args,
         "--json", str(result)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    return done, json.loads(result.read_text())


def test_bench_allreduce_and_summarize(tmp_path):
    result = tmp_path / "run.json"
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "benchmarks/bench_allreduce.py",
         "--sizes", "64,20K", "--repeats", "2", "--no-gloo", "--mpi-op", "--json", str(result),
         "--plot", str(tmp_path / "busbw.png")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(result.read_text())["results"]
    seen = {(r["collective"], r["implementation"], r["bytes"]) for r in rows}
    peers = {"allreduce": "MPI_Allreduce", "reduce_scatter": "MPI_Reduce_scatter",
             "allgather": "MPI_Allgather", "broadcast": "MPI_Bcast"}
    for collective, peer in peers.items():
        for nbytes in (64, 20 << 10):
            assert (collective, "ringreduce", nbytes) in seen
            assert (collective, peer, nbytes) in seen
    assert ("allreduce", "numpy reference", 64) in seen
    assert ("allreduce", "ringreduce op=MPI.SUM", 20 << 10) in seen
    assert all(r["time_s"] > 0 and r["speedup_vs_mpi"] > 0 for r in rows)
    assert (tmp_path / "busbw.png").stat().st_size > 0
    # The tables: nccl-tests' three columns for each implementation, in their order; on 2
    # ranks allgather's busbw is half its algbw ((p-1)/p), allreduce's equal to it.
    for collective, factor in (("allgather", 0.5), ("allreduce", 1.0)):
        table = done.stdout.split(f"## {collective}\n", 1)[1].split("\n\n", 1)[0]
        head, _, *lines = [[c.strip() for c in line.strip("|").split("|")]
                           for line in table.strip().splitlines()]
        at = head.index("ringreduce time")
        assert head[at + 1:at + 3] == ["algbw", "busbw"], head
        for cells in lines:
            algbw, busbw = float(cells[at + 1]), float(cells[at + 2])
            assert abs(busbw - factor * algbw) <= 0.011, (collective, cells)
        assert float(lines[-1][at + 1]) > 0, table  # (20 KiB: not all rounded away)

    summary = subprocess.run([sys.executable, "benchmarks/summarize.py", str(result), str(result),
                              "--plot", str(tmp_path / "speedup.png")], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    for collective in peers:
        assert f"### {collective}" in summary.stdout
    assert "| 20 KiB |" in summary.stdout
    assert "2 runs" in summary.stdout
    assert (tmp_path / "speedup.png").stat().st_size > 0
    # Under mpiexec stderr is a pipe: progress comes as lines, not a bar.
    assert "[0/8] allreduce 64 B\n" in done.stderr and "[8/8] done\n" in done.stderr
    assert "\r" not in done.stderr


def test_wire_choice_runs_and_summarises(tmp_path):
    result = tmp_path / "wire.json"
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "benchmarks/wire_choice.py",
         "--seconds", "2", "--json", str(result), "--plot", str(tmp_path / "wire.png")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(result.read_text())
    assert data["rounds"], "no round finished"
    names = ["chosen", "shared memory", "streaming stores", "MPI messages", "MPI library"]
    for test in ("reduce_scatter 1 MiB", "allgather 1 MiB", "allreduce 4 MiB"):
        assert all(data["rounds"][0][f"{test}: {name}"] > 0 for name in names)
        assert set(names) <= set(data["summary"][test])
    assert (tmp_path / "wire.png").stat().st_size > 0


def test_bench_gpu_runs_over_the_emulated_gpu(tmp_path):
    # The GPU benchmark's plumbing (columns, the forced paths, the other collectives,
    # JSON, markdown, plot) without a GPU: cupy is tests/mpi/fake_cupy.py there.
    result, table = tmp_path / "gpu.json", tmp_path / "gpu.md"
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "tests/mpi/emulated_bench_gpu.py",
         "--max-bytes", "4096", "--repeats", "1", "--no-gloo", "--others", "--json",
         str(result), "--markdown", str(table), "--plot", str(tmp_path / "gpu.png")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(result.read_text())
    assert [r["bytes"] for r in data["rows"]] == [1024, 4096]
    for row in data["rows"]:
        for name in ("ring", "ring_device", "ring_big", "ring_host", "host_mpi"):
            assert row[name]["seconds"] > 0
    assert {(r["collective"], r["bytes"]) for r in data["others"]} == {
        (c, n) for c in ("reduce_scatter", "allgather", "broadcast")
        for n in (64 << 10, 1 << 20, 16 << 20)}
    assert all(r[who]["seconds"] > 0 for r in data["others"]
               for who in ("ring", "ring_device", "host_mpi"))
    assert "| reduce_scatter | 1 MiB |" in table.read_text()
    assert (tmp_path / "gpu.png").stat().st_size > 0
    # ... and its plot drawn again from that JSON, without a GPU or cupy
    again = subprocess.run([sys.executable, "benchmarks/bench_gpu.py", "--replot", str(result),
                            "--plot", str(tmp_path / "again.png"), "--note", "replotted"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again.png").stat().st_size > 0


@pytest.mark.parametrize("collective", ["allreduce", "allgather"])
def test_bench_gpu_stops_at_a_wrong_result(collective, tmp_path):
    # A fast wrong answer is no result: every candidate's output is checked against MPI's.
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "tests/mpi/emulated_bench_gpu.py",
         "--max-bytes", "1024", "--repeats", "1", "--no-gloo", "--others",
         "--json", str(tmp_path / "gpu.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**job_env(), "EMULATED_BENCH_CORRUPT": collective})
    assert done.returncode != 0
    assert f"rank 1: ring {collective} of " in done.stderr + done.stdout
    assert "gave a wrong result: element" in done.stderr + done.stdout
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.parametrize("wait_each, timeout_and_loss", [(False, False), (True, True)])
def test_bench_async_runs_and_writes_every_candidate(tmp_path, wait_each, timeout_and_loss):
    result = tmp_path / "async.json"
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "benchmarks/bench_async.py",
         "--sizes", "64,20K", "--buckets", "3", "--compute-us", "10", "--repeats", "2",
         "--no-gloo", "--json", str(result)] + ["--wait-each"] * wait_each
        + ["--wait-timeout", "60", "--loss"] * timeout_and_loss,
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(result.read_text())
    assert data["buckets"] == 3 and data["compute_us"] == 10
    assert data["wait_each"] == wait_each
    assert ("each waited for at once" in done.stdout) == wait_each
    assert data["wait_timeout"] == (60 if timeout_and_loss else None)
    assert data["loss"] == timeout_and_loss
    assert ("then a blocking allreduce of one float" in done.stdout) == timeout_and_loss
    seen = {(r["implementation"], r["bytes"]) for r in data["results"]}
    for name in ("ringreduce async", "ringreduce blocking", "MPI_Iallreduce"):
        for nbytes in (64, 20 << 10):
            assert (name, nbytes) in seen
    assert all(r["time_s"] > 0 for r in data["results"])
    assert "| 20 KiB |" in done.stdout


@pytest.mark.parametrize("collective, peer", [("reduce_scatter", "MPI_Ireduce_scatter"),
                                              ("allgather", "MPI_Iallgather"),
                                              ("broadcast", "MPI_Ibcast")])
def test_bench_async_times_the_other_collectives_against_their_peers(tmp_path, collective,
                                                                     peer):
    result = tmp_path / "async.json"
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "benchmarks/bench_async.py",
         "--collective", collective, "--sizes", "12,20K", "--buckets", "3", "--repeats", "2",
         "--no-gloo", "--json", str(result)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(result.read_text())
    assert data["collective"] == collective and data["peer"] == peer
    seen = {(r["implementation"], r["bytes"]) for r in data["results"]}
    assert seen == {(name, nbytes) for name in ("ringreduce async", "ringreduce blocking", peer)
                    for nbytes in (12, 20 << 10)}
    assert f"3 {collective} calls in flight per step" in done.stdout
    assert f"| async speedup vs {peer} |" in done.stdout


def test_bench_gradients_runs_and_writes_every_candidate(tmp_path):
    done, data = run_benchmark(tmp_path, "bench_gradients.py", "--models", "3x64,2x128K",
                               "--repeats", "2", "--no-gloo")
    seen = {(r["implementation"], r["arrays"], r["bytes_each"]) for r in data["results"]}
    for name in ("ringreduce", "MPI, same plan", "MPI packed", "MPI per array"):
        assert (name, 3, 64) in seen and (name, 2, 128 << 10) in seen
    assert all(r["time_s"] > 0 for r in data["results"]) and data["torch"] is None
    assert "| 2 x 128 KiB | 256 KiB |" in done.stdout


def test_bench_gradients_checks_what_each_candidate_computed():
    # (From a review.) Zeros, averaged, stay zeros: a candidate that did nothing was
    # timed as one that worked. Rank r's start at r + 1 and must end at the average.
    check = ("import sys; sys.path.insert(0, 'benchmarks'); import numpy as np\n"
             "import bench_gradients as b\n"
             "timed, averaged = b.candidates(b.rr.Communicator(), 3, 64, None)\n"
             "for name, call in timed.items():\n"
             "    if name != 'MPI per array':\n"
             "        call()\n"
             "b.check_averaged({n: g for n, g in averaged.items() if n != 'MPI per array'}, 'x')\n"
             "print('fine', flush=True)\n"
             "b.check_averaged(averaged, '3 x 64 B')\n")
    done = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "-c", check],
                          capture_output=True, text=True, timeout=120, env=job_env(), cwd=ROOT)
    assert done.returncode != 0 and done.stdout.count("fine") == 2, done.stderr
    assert "3 x 64 B: wrong results from MPI per array (every element should be 1.5)" \
        in done.stderr, done.stderr


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_bench_optimizer_runs_and_writes_every_candidate(tmp_path, optimizer, ranks):
    # (3 ranks: an average that is no power of two, which the check must still find
    # exact, the same on every rank and for every candidate.)
    result = tmp_path / "result.json"
    done = subprocess.run(
        [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py",
         "benchmarks/bench_optimizer.py", "--models", "3x64,2x128K", "--repeats", "2",
         "--optimizer", optimizer, "--json", str(result)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(result.read_text())
    assert data["optimizer"] == optimizer and data["ranks"] == ranks
    seen = {(r["implementation"], r["parameters"], r["bytes_each"]) for r in data["results"]}
    for name in ("ringreduce", "ringreduce grad_ready", "MPI by hand", "ringreduce update alone",
                 "numpy update alone"):
        assert (name, 3, 64) in seen and (name, 2, 128 << 10) in seen
    assert all(r["time_s"] > 0 and r["speedup_vs_mpi"] > 0 and r["steps_checked"] >= 2 * 2
               for r in data["results"])
    assert "| 2 x 128 KiB | 256 KiB |" in done.stdout
    assert "| ringreduce vs MPI by hand | ringreduce grad_ready vs MPI by hand |" in done.stdout


def test_bench_optimizer_checks_what_each_candidate_computed():
    # Each candidate's parameters after the same steps: a candidate that counted a
    # step it did not take, and one whose ranks' parameters differ (gradients that were
    # not averaged), must fail the check, named; all of them stepped alike must pass.
    check = ("import sys; sys.path.insert(0, 'benchmarks'); import numpy as np\n"
             "import bench_optimizer as b\n"
             "model = b.Model(3, 64)\n"
             "timed, stepped, steps = b.candidates(b.rr.Communicator(), model, 'adam')\n"
             "for step in timed.values():\n"
             "    step(); step()\n"
             "b.check_stepped(model, 'adam', stepped, steps, 'x')\n"
             "print('fine', flush=True)\n"
             "def checked():\n"
             "    try:\n"
             "        b.check_stepped(model, 'adam', stepped, steps, '3 x 64 B')\n"
             "    except SystemExit as error:\n"
             "        print(error, flush=True)\n"
             "steps['MPI by hand'] += 1  # (one step behind the others)\n"
             "b.catch_up(timed, steps)\n"
             "checked()\n"
             "timed['MPI by hand']()\n"
             "steps['MPI by hand'] -= 1  # (caught up)\n"
             "stepped['ringreduce grad_ready'][0][0] += b.rank\n"
             "checked()\n")
    done = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "-c", check],
                          capture_output=True, text=True, timeout=120, env=job_env(), cwd=ROOT)
    assert done.returncode == 0 and done.stdout.count("fine") == 2, done.stdout + done.stderr
    assert done.stdout.count("3 x 64 B: wrong results from MPI by hand (") == 2, done.stdout
    assert "away from ringreduce update alone's)" in done.stdout, done.stdout
    assert done.stdout.count("3 x 64 B: wrong results from ringreduce grad_ready (not the "
                             "same bits on every rank)") == 2, done.stdout


def test_bench_placement_times_both_rings_on_ranks_that_pretend_to_be_on_two_machines(
        tmp_path):
    # On one machine the two rings take the same time; here only that both are made
    # as they should be, timed, and reported, is checked.
    result = tmp_path / "placement.json"
    done = subprocess.run(
        [mpiexec(), "-n", "4", sys.executable, "-m", "mpi4py", "benchmarks/bench_placement.py",
         "--sizes", "4K,256K", "--repeats", "2", "--json", str(result)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=job_env({"RINGREDUCE_TEST_MACHINE": "a,b"}))
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(result.read_text())
    assert data["ring_by_machine"] == [0, 2, 1, 3] and data["ring_in_rank_order"] == [0, 1, 2, 3]
    assert [m.split("/")[0] for m in data["machines"]] == ["a", "b", "a", "b"]
    seen = {(r["implementation"], r["bytes"]) for r in data["results"]}
    assert seen == {(name, n) for name in ("machine by machine", "rank order", "MPI_Allreduce")
                    for n in (4096, 256 << 10)}
    assert all(r["time_s"] > 0 for r in data["results"])
    assert ("4 ranks on 2 machine(s); ring machine by machine: (0, 2, 1, 3) (2 links between "
            "machines); in rank order: 4 links between machines") in done.stdout
    assert "| 256 KiB |" in done.stdout


def test_bench_scalar_runs_and_writes_every_candidate(tmp_path):
    done, data = run_benchmark(tmp_path, "bench_scalar.py", "--repeats", "2")
    rows = data["results"]
    for value in ("float32 loss (sum)", "bool flag (max)"):
        names = {r["implementation"] for r in rows if r["value"] == value}
        assert names == {"ringreduce, numpy scalar", "ringreduce, Python scalar",
                         "ringreduce, 0-d array", "mpi4py allreduce (pickled)",
                         "MPI_Allreduce (1 element)"}, names
    assert all(r["time_s"] > 0 and r["speedup_vs_mpi"] > 0 for r in rows)
    assert "| bool flag (max) | ringreduce, numpy scalar |" in done.stdout


def test_bench_layouts_runs_and_writes_every_case(tmp_path):
    done, data = run_benchmark(tmp_path, "bench_layouts.py", "--sizes", "8,4K", "--repeats", "2")
    rows = data["results"]
    cases = {(r["dtype"], r["layout"]) for r in rows}
    assert cases == {(d, "contiguous") for d in ("float32", "float64", "int32", "int8",
                                                 "complex128")} | {("float32", "strided"),
                                                                   ("float32", "odd size")}
    assert len(rows) == 2 * len(cases)
    assert all(r["ringreduce_s"] > 0 and r["mpi_s"] > 0 and
               r["speedup"] == r["mpi_s"] / r["ringreduce_s"] for r in rows)
    assert "| float32 | strided | 4 KiB |" in done.stdout
    assert "| float32 | odd size | 35772 B |" in done.stdout  # 4 KiB + 7919 float32s


def test_bench_dtypes_runs_and_writes_every_dtype(tmp_path):
    done, data = run_benchmark(tmp_path, "bench_dtypes.py", "--counts", "1K,3", "--repeats", "2")
    rows = data["results"]
    names = {"float32", "float16"} | ({"bfloat16"} if importlib.util.find_spec("ml_dtypes")
                                      else set())
    for count in (1024, 3):
        for op in ("sum", "avg"):
            assert {r["dtype"] for r in rows if (r["count"], r["op"]) == (count, op)} == names
    assert all(r["time_s"] > 0 for r in rows)
    assert all(r["vs_float32"] == 1.0 for r in rows if r["dtype"] == "float32")
    assert "| 1024 | avg | float16 |" in done.stdout


def test_bench_startup_runs_jobs_of_both_kinds_and_writes_every_phase(tmp_path):
    # (It starts its jobs itself: run as a plain script, not under mpiexec.)
    result = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_startup.py", "--ranks", "2", "--jobs", "1",
         "--mpiexec", mpiexec(), "--json", str(result)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(result.read_text())
    assert data["ranks"] == 2 and data["jobs"] == 1
    assert sorted(job["kind"] for job in data["results"]) == ["mpi4py", "ringreduce"]
    phases = ("make_s", "first_call_s", "small_call_s", "learning_1MiB_s", "call_1MiB_s",
              "close_s", "exit_s", "job_s")
    for kind in ("ringreduce", "mpi4py"):
        assert all(data["medians"][kind][phase] > 0 for phase in phases), data["medians"]
    assert data["medians"]["ringreduce"]["import_s"] > 0 == data["medians"]["mpi4py"]["import_s"]
    ours = next(job for job in data["results"] if job["kind"] == "ringreduce")
    if os.environ.get("RINGREDUCE_SHM") != "0":  # (2 ranks of one machine: slots mapped)
        assert ours["shared_memory_kib"] > 0
    assert "| first 8 B allreduce |" in done.stdout and "| whole job |" in done.stdout


@pytest.mark.parametrize("script, argv, message", [
    ("benchmarks/bench_allreduce.py", ["--sizes", "1.5.3K"], "'1.5.3K' is not a size"),
    ("benchmarks/bench_allreduce.py", ["--sizes", "64,"], "'' is not a size"),
    ("benchmarks/bench_allreduce.py", ["--sizes", "6"], "not a whole number of float32"),
    ("benchmarks/bench_allreduce.py", ["--repeats", "0"], "--repeats: must be at least 1"),
    ("benchmarks/bench_allreduce.py", ["--json", "/nonexistent-folder/b.json"], "no folder"),
    ("benchmarks/bench_allreduce.py", ["--plot", "busbw.txt"], "a plot is written as"),
    ("benchmarks/bench_async.py", ["--repeats", "0"], "--repeats: must be at least 1"),
    ("benchmarks/bench_scalar.py", ["--repeats", "0"], "--repeats: must be at least 1"),
    ("benchmarks/bench_startup.py", ["--jobs", "0"], "--jobs: must be at least 1"),
    ("benchmarks/bench_startup.py", ["--json", "/nonexistent-folder/s.json"], "no folder"),
    ("benchmarks/bench_placement.py", ["--sizes", "3"], "not a whole number of float32"),
    ("benchmarks/bench_placement.py", ["--json", "/nonexistent-folder/p.json"], "no folder"),
    ("benchmarks/bench_dtypes.py", ["--counts", "1K,0"], "'0' is not a count of elements"),
    ("benchmarks/bench_layouts.py", ["--sizes", "4K,3"], "'3' is less than 8 B"),
    ("benchmarks/ps_vs_ring.py", ["--mib", "0"], "--mib: must be above 0"),
    ("benchmarks/fit_model.py", ["--repeats", "-1"], "--repeats: must be at least 1"),
    ("benchmarks/fit_model.py", [], "run it on 2 ranks or more"),
    ("benchmarks/wire_choice.py", ["--seconds", "nan"], "--seconds: must be above 0"),
    ("benchmarks/bench_async.py", ["--sizes", "0"], "not a whole number of float32"),
    ("benchmarks/bench_async.py", ["--buckets", "0"], "--buckets must be at least 1"),
    ("benchmarks/bench_async.py", ["--compute-us", "nan"], "--compute-us must be >= 0"),
    ("benchmarks/bench_async.py", ["--wait-timeout", "0"], "--wait-timeout must be a positive"),
    ("benchmarks/bench_gradients.py", ["--models", "8"], "'8' is not COUNTxSIZE"),
    ("benchmarks/bench_gradients.py", ["--models", "0x1M"], "'0x1M' is not COUNTxSIZE"),
    ("benchmarks/bench_gradients.py", ["--models", "2x6"], "not a whole number of 4-byte"),
    ("benchmarks/bench_gradients.py", ["--repeats", "0"], "--repeats: must be at least 1"),
    ("benchmarks/bench_optimizer.py", ["--models", "2x6"], "not a whole number of 4-byte"),
    ("benchmarks/bench_optimizer.py", ["--optimizer", "lamb"], "invalid choice: 'lamb'"),
    ("benchmarks/bench_optimizer.py", ["--repeats", "0"], "--repeats: must be at least 1"),
    ("benchmarks/bench_optimizer.py", ["--json", "/nonexistent-folder/o.json"], "no folder"),
    ("benchmarks/bench_memory.py", ["allreduce-sideways"], "invalid choice: 'allreduce-side"),
    ("benchmarks/bench_memory.py", ["allreduce", "float99"], "'float99' is not a numpy dtype"),
    ("benchmarks/bench_memory.py", ["allreduce", "float32", "0"], "MIB: must be above 0"),
    ("benchmarks/bench_memory.py", ["allreduce", "--json", "/nonexistent-folder/m.json"],
     "no folder"),
    ("benchmarks/bench_gpu.py", ["--max-bytes", "2x"], "'2x' is not a size"),
    ("benchmarks/bench_gpu.py", ["--min-bytes", "6"], "not a whole number of 4-byte"),
    ("benchmarks/bench_gpu.py", ["--min-bytes", "1M", "--max-bytes", "64K"],
     "--min-bytes is larger than --max-bytes"),
    ("benchmarks/bench_gpu.py", ["--json", "/nonexistent-folder/g.json"], "no folder"),
    ("benchmarks/bench_gpu.py", ["--replot", "/nonexistent.json"], "is not a bench_gpu.py"),
    ("benchmarks/bench_gpu.py", ["--replot", "benchmarks/results/model_p2.json"],
     "no measured method in its first row"),
    ("benchmarks/bench_gpu.py", ["--big-chunk", "2G"], "'2G' is more than 1 GiB"),
    ("examples/train_digits.py", ["--epochs", "0"], "--epochs and --hidden must be"),
    ("examples/train_digits.py", ["--global-batch", "100000"], "--global-batch must be"),
    ("examples/train_digits.py", ["--lr", "nan"], "--lr must be a number above 0"),
    ("examples/train_digits.py", ["--json", "/nonexistent-folder/h.json"], "does not exist"),
])
def test_command_lines_refuse_bad_arguments_before_any_work(script, argv, message):
    # A usage error at once (on one rank here; under mpiexec, on every rank alike), not
    # a traceback after the Communicator is made, or a run of 0 steps.
    done = subprocess.run([sys.executable, str(ROOT / script), *argv], capture_output=True,
                          text=True, timeout=120, env=job_env())
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("script, argv", [
    ("benchmarks/bench_allreduce.py", ["--plot", "p.png"]),
    ("benchmarks/bench_gpu.py", ["--plot", "p.png"]),
    ("benchmarks/bench_gpu.py", ["--replot", "benchmarks/results/model_p2.json"]),
])
def test_a_plot_without_matplotlib_is_a_usage_error_naming_the_plot_extra(script, argv):
    # (From a review.) They stopped with a bare ImportError (on every rank).
    blocked = ("import runpy, sys; sys.modules['matplotlib'] = None; "
               f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
               f"sys.argv = [{script!r}, *{argv!r}]; "
               f"runpy.run_path({str(ROOT / script)!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True,
                          timeout=120, env=job_env(), cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "needs matplotlib: pip install matplotlib, or install ringreduce with its plot " \
           "extra" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_digits_example_on_3_ranks_says_once_which_batches_fit():
    # Its default global batch (64) does not divide among 3 ranks. Rank 0 says so, and
    # which batches would, once; the others wait for it to have said it before they
    # exit (under -m mpi4py the first rank to exit with status 2 aborts the job).
    done = subprocess.run(
        [mpiexec(), "-n", "3", sys.executable, "-m", "mpi4py", "examples/train_digits.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=job_env())
    assert done.returncode == 2, done.stdout + done.stderr
    said = "--global-batch 64 does not divide evenly among 3 ranks"
    assert done.stderr.count(said) == 1, done.stderr
    assert "try --global-batch 63 or --global-batch 66" in done.stderr
    assert done.stderr.count("usage:") == 1 and "Traceback" not in done.stderr


def test_gpu_check_fails_a_table_that_hangs_or_fails_but_not_one_out_of_budget(tmp_path):
    # benchmarks/gpu_check.sh cuts each step's timeout to what is left of its budget. A
    # table stopped there is incomplete (as one never started is left out), not a failed
    # check; one stopped at its own cap (a hang), or that failed, fails it. `timeout` is
    # stood in for: it says the limit it was given and returns the status asked.
    script = r'''
set -u
OUTDIR=$1
# A plain variable, no longer bash's clock (unset takes SECONDS' special meaning away):
# the limits then follow from the seconds each run() says were spent, whatever time
# the script itself takes. (With the live clock a step whose two cap()s straddled a
# tick said 54 instead of 55: seen once in CI on a loaded machine.)
unset SECONDS
SECONDS=1000
source benchmarks/gpu_check_budget.sh
timeout() { echo "limit $3"; return "$STATUS"; }
run() {  # the budget's seconds, those already spent, the status: failed or not
  BUDGET=$1 T0=$((SECONDS - $2)) STATUS=$3
  limit=$(cap 200)
  within "$limit" bench
  if table_failed $? "$limit" 200; then echo failed; else echo ok; fi
}
run 300 240 124  # 55 s left: stopped at 55 s, by the budget
run 300 240 137  # (the same, once it needed the KILL)
run 1000 0 124   # stopped at its own 200 s: a hang
run 300 240 1    # failed before the budget ran out
run 300 240 0
'''
    done = subprocess.run(["bash", "-c", script, "gpu_check", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    incomplete = "(stopped at the budget of 300 s: this table is incomplete)"
    assert done.stdout.split("\n") == [
        "limit 55", incomplete, "ok",
        "limit 55", incomplete, "ok",
        "limit 200", "failed",
        "limit 55", "failed",
        "limit 55", "ok", ""], done.stdout
    assert (tmp_path / "tests.txt").read_text() == 2 * (incomplete + "\n")


def memory_rows(case, dtype="float32", mib="4", extra=None, options=()):
    """bench_memory.py's JSON rows on 2 ranks (their lines may interleave)."""
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "benchmarks/bench_memory.py",
         case, dtype, mib, *options], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=job_env(extra))
    assert done.returncode == 0, done.stderr
    decoder, rows, at = json.JSONDecoder(), [], 0
    while (at := done.stdout.find('{"case"', at)) >= 0:
        row, at = decoder.raw_decode(done.stdout, at)
        rows.append(row)
    assert sorted(r["rank"] for r in rows) == [0, 1], done.stdout
    return rows


def test_bench_memory_measures_a_call_on_two_ranks(tmp_path):
    rows = memory_rows("allreduce", options=["--json", str(tmp_path / "memory.json")])
    for r in rows:
        # a new 4 MiB result, counted by numpy's allocations and the peak RSS
        assert r["N"] == r["result"] == 4 << 20
        assert r["first_traced"] >= r["N"] and r["first"] >= r["N"] // 2
        assert isinstance(r["env"], dict)
    # --json: the rows every rank printed, gathered into one file by rank 0
    written = json.loads((tmp_path / "memory.json").read_text())
    assert written["case"] == "allreduce" and written["ranks"] == 2
    assert written["results"] == sorted(rows, key=lambda r: r["rank"])


def test_bench_memory_a_strided_allreduce_costs_its_result_only():
    # docs/api.md's row for allreduce(x[::2]), with RINGREDUCE_SHM=0 as it says: the
    # result, and no copy of x beside it (the rows measured before 9cbbec3 showed 2 N),
    # and the run's RINGREDUCE_ variables recorded with the numbers (16 MiB: the ring's
    # own buffers, some 3.5 MiB, are small beside it).
    for r in memory_rows("allreduce-noncontig", "float16", "16", {"RINGREDUCE_SHM": "0"}):
        assert r["transport"] == "MPI" and r["env"].get("RINGREDUCE_SHM") == "0"
        assert r["N"] <= r["first_traced"] < 1.5 * r["N"], r
        assert r["first"] < 1.5 * r["N"], r
