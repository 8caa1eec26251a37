#!/usr/bin/env bash
# The main job: set up (first run only), then on 2 ranks: check ringreduce against
# numpy and time it beside MPI_Allreduce, then train a numpy MLP data-parallel on
# scikit-learn's digits (loss curve saved to digits_training.png).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
RANKS=${RANKS:-2}
.venv/bin/mpiexec -n "$RANKS" .venv/bin/python -m mpi4py benchmarks/demo.py
echo
exec .venv/bin/mpiexec -n "$RANKS" .venv/bin/python -m mpi4py examples/train_digits.py \
    --plot digits_training.png
