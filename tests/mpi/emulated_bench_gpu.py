"""Runs benchmarks/bench_gpu.py with fake_cupy over the core's host emulation of a GPU,
so that tests/test_benchmarks.py can check the script end to end on machines without
one (its times mean nothing there). Same arguments as bench_gpu.py."""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fake_cupy  # noqa: E402

fake_cupy.emulate_gpu()
sys.argv[0] = os.path.join(HERE, "..", "..", "benchmarks", "bench_gpu.py")
runpy.run_path(sys.argv[0], run_name="__main__")
