#!/usr/bin/env bash
# Installs what the tests need and runs them all (CPU only; GPU tests skip without a GPU): first the linters
# (ruff; import-linter holds the layers of ARCHITECTURE.md; mypy checks src/'s annotations), then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# DeepSpeed's C++ ops that the 2-rank tests load (its fused AdamW and shared-memory collectives), compiled once per
# checkout while the linters run (a minute of two cores the first time), into this checkout's own folder: a build
# that another checkout's killed run left half-done (its lock file) cannot make these tests wait on it
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch-extensions}"
.venv/bin/python -c "from memfit.steps.deepspeed_loop import build_deepspeed_ops; build_deepspeed_ops(offload=False)" &
ops=$!
.venv/bin/ruff check src tests scripts benchmarks
.venv/bin/lint-imports --no-cache
.venv/bin/mypy   # the annotations of src/ ([tool.mypy] in pyproject.toml)
wait "$ops"
# Two workers, one thread each (the machine's two cores); the 2-rank tests share one torchrun launch on one worker.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m pytest -q -n "${MEMFIT_TEST_WORKERS:-2}" --dist loadgroup "$@"
