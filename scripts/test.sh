#!/usr/bin/env bash
# The test suite: set up (first run only), then pytest, which launches mpiexec with
# 1, 2, 3 and 4 ranks itself. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest tests "$@"
