#!/usr/bin/env bash
# Installs what the tests need and runs them all (CPU only; GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
.venv/bin/python -m pytest -q "$@"
