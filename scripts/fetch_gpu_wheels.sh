#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with the wheels benchmarks/gpu_check.sh installs on a GPU
# machine that has no package registry: MPICH, and mpi4py for each Python that machine
# might have (3.10 to 3.13: the H200 image had 3.12 on 2026-11-30; pip there picks the
# wheel whose tags fit), and in .whl/extra/ pybind11 and pytest (pure Python), which it
# installs only if missing. Run it here, where PyPI is reachable. PYVERS overrides the
# list of Python versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVERS=${PYVERS:-3.10 3.11 3.12 3.13}
PY=${PYTHON:-python3}
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl/extra
rm -f .whl/*.whl .whl/extra/*.whl
for version in $PYVERS; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp "${platforms[@]}" -d .whl mpich==5.0.2 mpi4py==4.1.2
  "$PY" -m pip download -q --only-binary=:all: --python-version "$version" --implementation cp \
    --platform any -d .whl/extra pybind11 pytest exceptiongroup tomli
  # (pytest needs the last two before Python 3.11; pip judges a dependency's version
  # marker by the python it runs on, not by --python-version, so they are named here)
done
ls -l .whl .whl/extra
