#!/usr/bin/env bash
# The main job: set up (first run only), then on 2 ranks (RANKS=4 for 4): check
# ringreduce against numpy and time it beside MPI_Allreduce, then train a numpy MLP
# data-parallel on scikit-learn's digits (loss curve saved to digits_training.png).
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS=${RANKS:-2}
if ! [[ "$RANKS" =~ ^[1-9][0-9]*$ ]]; then
    echo "demo.sh: RANKS must be a positive whole number of ranks, got '$RANKS'" >&2
    exit 2
fi
# The training's global batch is cut into one equal shard per rank: 64, or the next
# multiple of RANKS (66 on 3 ranks).
BATCH=$(( (64 + RANKS - 1) / RANKS * RANKS ))
bash scripts/bootstrap.sh
.venv/bin/mpiexec -n "$RANKS" .venv/bin/python -m mpi4py benchmarks/demo.py
echo
exec .venv/bin/mpiexec -n "$RANKS" .venv/bin/python -m mpi4py examples/train_digits.py \
    --global-batch "$BATCH" --plot digits_training.png
