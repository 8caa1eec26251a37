#!/usr/bin/env bash
# The main job: set up (first run only), then a 2-rank run that verifies ringreduce
# against numpy and times it beside MPI_Allreduce.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/mpiexec -n "${RANKS:-2}" .venv/bin/python -m mpi4py benchmarks/demo.py
