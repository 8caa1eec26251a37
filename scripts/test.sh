#!/usr/bin/env bash
# The test suite: set up (first run only), then pytest, which launches mpiexec with
# 1, 2, 3 and 4 ranks itself. Arguments go to pytest: without a path among them it
# runs tests/ (pyproject.toml's testpaths), with one only what it names.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
