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
# Under a system Open MPI (MPICC=... above), its mpiexec starts no more ranks than cores
# (RANKS=4 on 2) and none as root (a container's user), as the tests' launches do not
# either (tests/conftest.py): these let it, and MPICH ignores them.
export OMPI_MCA_rmaps_base_oversubscribe=${OMPI_MCA_rmaps_base_oversubscribe:-1}
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}
    export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
fi
.venv/bin/mpiexec -n "$RANKS" .venv/bin/python -m mpi4py benchmarks/demo.py
echo
exec .venv/bin/mpiexec -n "$RANKS" .venv/bin/python -m mpi4py examples/train_digits.py \
    --global-batch "$BATCH" --plot digits_training.png
