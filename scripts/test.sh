#!/usr/bin/env bash
# The test suite: set up (first run only), then pytest, which launches mpiexec with
# 1 to 4 ranks itself (and 5 and 8 for four modules). Arguments go to pytest: without
# a path among them it runs tests/ (pyproject.toml's testpaths), with one only what it
# names.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
