#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with the wheels benchmarks/gpu_check.sh installs on a GPU
# machine that has no package registry: MPICH and mpi4py, for that machine's Python,
# and in .whl/extra/ pybind11 and pytest (pure Python), which it installs only if missing.
# Run it here, where PyPI is reachable. PYVER picks the Python (default 3.12, the H200
# image's).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PY=${PYTHON:-python3}
mkdir -p .whl/extra
rm -f .whl/*.whl .whl/extra/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d .whl mpich==5.0.2 mpi4py==4.1.2
"$PY" -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform any -d .whl/extra pybind11 pytest
ls -l .whl .whl/extra
