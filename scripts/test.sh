#!/usr/bin/env bash
# Installs what the tests need and runs them all (CPU only; GPU tests skip without a GPU): first the linters
# (ruff; import-linter holds the layers of ARCHITECTURE.md), then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check src tests scripts benchmarks
.venv/bin/lint-imports --no-cache
# Two workers, one thread each (the machine's two cores); the 2-rank tests share one torchrun launch on one worker.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m pytest -q -n "${MEMFIT_TEST_WORKERS:-2}" --dist loadgroup "$@"
