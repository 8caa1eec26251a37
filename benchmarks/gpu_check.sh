#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU and no network (the H200 we are lent):
# installs MPI from wheels in .whl/, builds the extension for this GPU, runs the GPU
# kernel tests and the cupy tests on 2, 4 and 3 ranks sharing the GPU, trains the digits
# example on the GPU, and prints the busbw table of cupy allreduce (1 KiB to 1 GiB)
# beside the GPU's copy rate (and torch's gloo, where torch is). Never more than
# GPU_CHECK_BUDGET seconds (default 300, so that a rerun fits in a 15-minute lease): each
# step's timeout is cut to what is left, and a step is not started once it is spent (a
# test step so left out or stopped fails the check; a benchmark table is left out, or
# left incomplete, without failing it). What it prints also lands in OUTDIR/tests.txt;
# OUTDIR gets 6 files at most (the device tool brings back 8).
#
#   here (with network):  bash scripts/fetch_gpu_wheels.sh      # fills .whl/
#   there:                bash benchmarks/gpu_check.sh [OUTDIR]  # default $OUT or ./gpu_check_out
#
# .whl/ is ignored by git, and the device tool sends only what git does not ignore:
# name it in the call's carry (carry [".whl"]).
#
# Needs there: nvcc, and a python3 with numpy, cupy and setuptools; pybind11 and pytest
# come from .whl/extra/ where that python lacks them; without scikit-learn the digits
# step is left out, without matplotlib the plot.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-$PWD/gpu_check_out}}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
T0=$SECONDS
BUDGET=${GPU_CHECK_BUDGET:-300}
step() { echo; echo "== [$((SECONDS - T0)) s] $*"; }
# cap, within and table_failed: see that file (tests/test_benchmarks.py runs them).
source benchmarks/gpu_check_budget.sh
failures=()

step "MPI from .whl/"
PREFIX=/tmp/ringreduce-mpi
ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run scripts/fetch_gpu_wheels.sh first"; exit 1; }
# (.whl/ holds an mpi4py wheel for each Python it might meet: pip takes the one that fits)
"$PY" -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir \
  --ignore-installed --prefix "$PREFIX" mpich mpi4py || exit 1
SITE=$(echo "$PREFIX"/lib/python3*/site-packages)
export PYTHONPATH="$SITE:$PWD" PATH="$PREFIX/bin:$PATH" MPICC="$PREFIX/bin/mpicc"
# tests/launch.py would otherwise prefer an mpiexec beside the python, another MPI's
export RINGREDUCE_MPIEXEC="$PREFIX/bin/mpiexec"
export MPI4PY_LIBMPI="$PREFIX/lib/libmpi.so.12" OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
# An image that turns on TF32 for cupy's float32 matrix products (10-bit mantissas)
# would fail the PowerSGD test, which holds them to numpy's within 1e-4.
unset CUPY_TF32
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
# setup.py refuses a pybind11 before 2.12 (it misreads numpy 2's dtypes).
recent_pybind11() { "$PY" -c "import pybind11, sys
sys.exit(tuple(int(p) for p in pybind11.__version__.split('.')[:2]) < (2, 12))" >/dev/null 2>&1; }
if ! recent_pybind11 || ! has pytest; then
  echo "pybind11 (2.12 or later) or pytest missing: installing .whl/extra/"
  ls .whl/extra/*.whl >/dev/null 2>&1 &&
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
      --prefix "$PREFIX" .whl/extra/*.whl
fi
missing=""
for module in numpy cupy mpi4py setuptools pybind11 pytest; do
  has "$module" || missing="$missing $module"
done
if [ -n "$missing" ]; then
  echo "missing here:$missing (with $($PY --version 2>&1)); nothing can be checked without them"
  exit 1
fi
plot_args=(--plot "$OUTDIR/gpu_allreduce_p2.png")
has matplotlib || { plot_args=(); echo "(no matplotlib: no plot)"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv \
  | tee -a "$OUTDIR/tests.txt"
{ nvcc --version | tail -2; "$PY" --version
  "$PY" -c "import cupy, mpi4py, numpy; print('cupy', cupy.__version__, '| mpi4py', mpi4py.__version__, '| numpy', numpy.__version__)"
} 2>&1 | tee -a "$OUTDIR/tests.txt"

step "build, CUDA code for this GPU only"
# The H200 image points CC/CXX at /opt/gcc, another GCC than the system's; an extension
# built with it crashed on the first C++ exception (2026-11-30: any MismatchError, on
# host buffers too). Build the C++ and CUDA host code with the system compiler.
echo "CC=${CC:-} CXX=${CXX:-} | g++ on PATH: $(command -v g++)"
if [ -x /usr/bin/g++ ] && [ "${RINGREDUCE_KEEP_CC:-0}" != 1 ]; then
  export CC=/usr/bin/g++ CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared" NVCC_CCBIN=/usr/bin/g++
  /usr/bin/g++ --version | head -1
fi
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
rm -f ringreduce/_core*.so
# (Under a timeout of its own: the budget counts from the start, the build among it.)
if ! RINGREDUCE_CUDA=1 RINGREDUCE_CUDA_ARCHS="$arch" within 200 "$PY" setup.py build_ext \
     --inplace -j 8 >"$OUTDIR/build.log" 2>&1; then
  tail -30 "$OUTDIR/build.log"
  exit 1
fi
# Versions, MPI (CUDA-aware or not, and why), GPUs, cupy: what a report needs.
within 30 "$PY" -m ringreduce info 2>&1 | tee -a "$OUTDIR/tests.txt" || true
"$PY" -c "import ringreduce as rr; print('cuda_available:', rr.cuda_available())" \
  | tee -a "$OUTDIR/tests.txt"
# Without a usable GPU every GPU test would skip, and skipped tests pass: stop here.
"$PY" -c "import ringreduce as rr, sys; sys.exit(not rr.cuda_available())" || {
  echo "FAILED: the extension sees no usable GPU (see cuda_status above); nothing ran on the GPU"
  exit 1
}
ldd ringreduce/_core*.so | grep -E "stdc|gcc_s" | tee -a "$OUTDIR/tests.txt"

step "errors raised from C++ on 2 ranks (host buffers): the build throws and catches"
within 60 mpiexec -n 2 "$PY" -m mpi4py -m pytest -q -x -p no:cacheprovider \
  --rootdir . tests/mpi/test_errors.py 2>&1 | tee -a "$OUTDIR/tests.txt" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || failures+=("tests/mpi/test_errors.py")

step "GPU kernels against the CPU kernels (one process)"
# Whole logs go to tests.txt; the screen gets their ends.
within 120 "$PY" -m pytest -q -p no:cacheprovider --durations=5 tests/test_cuda.py 2>&1 \
  | tee -a "$OUTDIR/tests.txt" | tail -4
[ "${PIPESTATUS[0]}" -eq 0 ] || failures+=("tests/test_cuda.py")

step "cupy through the ring on 2, 4 and 3 ranks (staged; also direct where MPI is CUDA-aware)"
# A hang costs its timeout, not the session's whole device time. 3 ranks last: where the
# budget runs out, the run it cuts is the one that adds least (4 already takes p > 2).
ranks_ok=1
for n in 2 4 3; do
  limit=$(cap 150)  # (test_on_ranks kills the job at it)
  if [ "$limit" -eq 0 ]; then
    echo "(not started on $n ranks: the budget of $BUDGET s is spent)" | tee -a "$OUTDIR/tests.txt"
    ranks_ok=0
    continue
  fi
  (cd tests && RINGREDUCE_GPU_TEST_TIMEOUT=$limit "$PY" -m pytest -q -s -p no:cacheprovider \
     "test_on_ranks.py::test_gpu_module_on_ranks[$n]") 2>&1 | tee -a "$OUTDIR/tests.txt" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || ranks_ok=0
done
if [ "$ranks_ok" -eq 0 ]; then
  failures+=("GPU tests on ranks")
  # Whatever failed, the staged path is the one that needs nothing from MPI: time that.
  export RINGREDUCE_CUDA_AWARE=0
fi

step "the digits example on the GPU, 2 ranks"
if has sklearn; then
  within 90 mpiexec -n 2 "$PY" examples/train_digits.py --gpu --epochs 30 2>&1 \
    | tee -a "$OUTDIR/tests.txt" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || failures+=("digits example on the GPU")
else
  echo "(left out: no scikit-learn here, for the digits)"
fi

# The tables go to tests.txt as printed (no files of their own: see the top).
if [ "$(cap 1000)" -gt 30 ]; then
  step "busbw, 2 ranks on one GPU, 1 KiB to 1 GiB; then reduce_scatter, allgather, broadcast"
  limit=$(cap 200)
  within "$limit" mpiexec -n 2 "$PY" benchmarks/bench_gpu.py --others \
    --json "$OUTDIR/gpu_2ranks.json" "${plot_args[@]}" 2>&1 | tee -a "$OUTDIR/tests.txt"
  table_failed "${PIPESTATUS[0]}" "$limit" 200 && failures+=("bench at 2 ranks")
else
  step "skipping the 2-rank table: under 30 s of the budget left"
fi

if [ "$(cap 1000)" -gt 100 ]; then
  step "busbw, 4 ranks on one GPU, 1 KiB to 256 MiB"
  limit=$(cap 150)
  within "$limit" mpiexec -n 4 "$PY" benchmarks/bench_gpu.py --max-bytes $((256 << 20)) \
    --repeats 3 --json "$OUTDIR/gpu_4ranks.json" 2>&1 | tee -a "$OUTDIR/tests.txt"
  table_failed "${PIPESTATUS[0]}" "$limit" 150 && failures+=("bench at 4 ranks")
else
  step "skipping the 4-rank table: under 100 s of the budget left"
fi

# Ranks that share a GPU take turns on it unless NVIDIA's Multi-Process Service runs.
if command -v nvidia-cuda-mps-control >/dev/null && [ "$(cap 1000)" -gt 80 ]; then
  step "busbw, 2 ranks on one GPU under MPS, 1 KiB to 64 MiB (no plot)"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    # Never left running on the lent GPU, even if this script is stopped meanwhile.
    trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
    within 90 mpiexec -n 2 "$PY" benchmarks/bench_gpu.py --max-bytes $((64 << 20)) \
      --repeats 3 --no-gloo --json "$OUTDIR/gpu_2ranks_mps.json" 2>&1 | tee -a "$OUTDIR/tests.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || echo "(MPS run failed)"
    echo quit | nvidia-cuda-mps-control
  else
    echo "(MPS did not start)"
  fi
fi

# What passing did not cover here, said plainly: skipped tests pass.
step "not covered by this run"
"$PY" - <<'PY' 2>&1 | tee -a "$OUTDIR/tests.txt"
from ringreduce import _core
if not _core.mpi_cuda_aware():
    print("- the CUDA-aware path (device pointers handed to MPI): this MPI is not CUDA-aware "
          f"({_core.mpi_cuda_aware_reason()}); its tests skipped")
if _core.cuda_device_count() < 2:
    print("- ranks on different GPUs, and one rank using two: this machine has one GPU")
print("- ranks on different machines (GPU buffers between nodes)")
PY

step "done"
files=$(find "$OUTDIR" -type f | wc -l)
[ "$files" -le 8 ] || echo "(OUTDIR holds $files files: the device tool brings back only 8)"
if [ ${#failures[@]} -gt 0 ]; then
  echo "FAILED: ${failures[*]}"
  exit 1
fi
echo "all GPU checks passed"
