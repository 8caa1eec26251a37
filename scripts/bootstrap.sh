#!/usr/bin/env bash
# Sets up everything ringreduce needs in ./.venv and builds it there; safe to re-run
# (it only reinstalls what changed). On a fresh machine it needs python3 (with venv)
# and a C++ compiler; MPI comes from PyPI's `mpich` wheel.
#
# To use a system MPI instead (MPICH or Open MPI), point MPICC at its mpicc:
#   MPICC=/usr/bin/mpicc bash scripts/bootstrap.sh
# mpi4py is then built from source against that MPI, and so is ringreduce.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

deps_wanted="mpi=${MPICC:-mpich-wheel} $(cat scripts/requirements.txt)"
deps_stamp="$VENV/.ringreduce-deps"
if [ "$(cat "$deps_stamp" 2>/dev/null)" != "$deps_wanted" ]; then
  echo "bootstrap: installing dependencies (${MPICC:-MPICH from PyPI})"
  "${PIP[@]}" install --upgrade pip
  if [ -n "${MPICC:-}" ]; then
    "${PIP[@]}" uninstall -y mpich mpi4py >/dev/null 2>&1 || true
    MPICC="$MPICC" "${PIP[@]}" install --no-binary=mpi4py --no-cache-dir mpi4py
  else
    "${PIP[@]}" install mpich mpi4py
  fi
  "${PIP[@]}" install -r scripts/requirements.txt
  echo "$deps_wanted" > "$deps_stamp"
fi

# Rebuild the extension when its sources or the MPI change. No build isolation:
# the extension must link the MPI in this venv (or MPICC's), which mpi4py loads.
build_wanted="$deps_wanted $(cat setup.py pyproject.toml csrc/* | sha256sum)"
build_stamp="$VENV/.ringreduce-build"
if [ "$(cat "$build_stamp" 2>/dev/null)" != "$build_wanted" ] || \
   ! ls ringreduce/_core*.so >/dev/null 2>&1; then
  echo "bootstrap: building ringreduce (compiling the C++ core, and the CUDA part where nvcc is: 1-3 minutes)"
  "${PIP[@]}" install --no-build-isolation --no-deps -e .
  echo "$build_wanted" > "$build_stamp"
fi
