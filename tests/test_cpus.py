"""Replicas stay bit-identical on ranks whose CPUs differ, as on a cluster of two CPU
generations, where OpenBLAS and glibc's pow() pick FMA code on one and not on the other.

PowerSGD's replicas, when the ranks' BLAS rounds differently (OpenBLAS picks FMA kernels
on one and not on the other). Every rank computes P's orthonormal columns and P Q^T itself, from the averaged
P and Q, and applies the result to its own replica: with BLAS's and LAPACK's rounding
the replicas drifted apart from the first step, without a word. Here rank 1 runs
OpenBLAS's Sandybridge kernels (no FMA), rank 0 this CPU's own."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from launch import run_script

JOB = """
import os
from mpi4py import MPI  # (imports no numpy: OpenBLAS reads its setting when loaded)
world = MPI.COMM_WORLD
if world.rank == 1:
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"
import zlib
import numpy as np
from ringreduce.compression import PowerSGD
from ringreduce.optim import SGD, Adam, DistributedOptimizer

def same_everywhere(*arrays):
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
    return len(set(world.allgather(crc))) == 1

rng = np.random.default_rng(7)
a, b = rng.standard_normal((300, 4)), rng.standard_normal((200, 4))
if same_everywhere(a @ b.T, np.linalg.qr(a)[0]):
    if world.rank == 0:
        print("blas-alike")
    raise SystemExit(0)

for make, compression in ((lambda ps: SGD(ps, lr=0.1, momentum=0.9), PowerSGD(rank=4, seed=1)),
                          (lambda ps: Adam(ps, lr=1e-3), PowerSGD(rank=1, seed=2))):
    shapes = [((400, 300), np.float32), ((64, 3, 5, 5), np.float64), ((96, 80), np.float16),
              ((300,), np.float32)]
    params = [np.random.default_rng(i).standard_normal(s).astype(t)
              for i, (s, t) in enumerate(shapes)]
    opt = DistributedOptimizer(make(params), compression=compression)
    for step in range(4):
        grads = [np.random.default_rng([step, world.rank, i]).standard_normal(p.shape)
                 .astype(p.dtype) for i, p in enumerate(params)]
        opt.step(grads)
        if not same_everywhere(*params):
            if world.rank == 0:
                print(f"differ {type(opt.optimizer).__name__} step {step}")
            raise SystemExit(0)
if world.rank == 0:
    print("identical")
"""


def _numpy_has_openblas_with_kernels_per_cpu():
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    except Exception:  # (numpy 1 says it otherwise; no such test there)
        return False
    return "openblas" in str(blas.get("name", "")).lower() and \
        "DYNAMIC_ARCH" in str(blas.get("openblas configuration", ""))


def _cpu_has_fma():
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and " fma " in line + " " for line in info)
    except OSError:
        return False


@pytest.mark.skipif(not _numpy_has_openblas_with_kernels_per_cpu(),
                    reason="numpy is not linked to an OpenBLAS that picks its kernels per CPU "
                           "(DYNAMIC_ARCH): OPENBLAS_CORETYPE would change nothing")
@pytest.mark.skipif(not _cpu_has_fma(),
                    reason="this CPU has no FMA: OpenBLAS's kernels for it and Sandybridge's "
                           "round alike, and the test would prove nothing")
def test_powersgd_replicas_stay_identical_when_blas_rounds_differently(tmp_path):
    done = run_script(tmp_path, "blas.py", JOB, timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.split() == ["blas-alike"]:
        pytest.skip("OPENBLAS_CORETYPE=Sandybridge gave the same bits as this CPU's kernels")
    assert done.stdout.split() == ["identical"], done.stdout + done.stderr


POWERS = """
import json, sys
from ringreduce.optim import _power
print(json.dumps([[(b ** t).hex(), _power(b, t).hex()] for b in (0.9999, 0.999)
                  for t in range(1, 20001)]))
"""


def test_adams_bias_correction_is_the_same_on_a_cpu_without_fma(tmp_path):
    # 1 - beta2 ** t with Python's ** (glibc's pow(), FMA code or not by CPU) differed in
    # the last bit at some t, and Adam's replicas on ranks of two CPU generations drifted
    # apart from there. glibc's tunable turns its FMA code off, as on an older CPU.
    def powers(env):
        done = subprocess.run([sys.executable, "-c", POWERS], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    here = powers({})
    older = powers({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-FMA,-AVX2_Usable"})
    if [plain for plain, _ in here] == [plain for plain, _ in older]:
        pytest.skip("pow() gives the same bits without FMA here (no FMA, or not glibc)")
    assert [ours for _, ours in here] == [ours for _, ours in older]


def test_adams_power_keeps_a_numpy_float32s_type_and_is_rounded_from_the_exact_one():
    from decimal import Context, Decimal

    from ringreduce.optim import _power

    for t in (1, 2, 494, 10_000):
        ours = _power(np.float32(0.9999), t)
        exact = float(Context(prec=40).power(Decimal(float(np.float32(0.9999))), t))
        assert type(ours) is np.float32 and ours == np.float32(exact)
        assert type(_power(0.9999, t)) is float
    assert _power(np.float64(0.5), 3) == 0.125 and _power(0, 2) == 0
