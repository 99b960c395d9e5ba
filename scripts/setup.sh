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
wanted="$(sha1sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$wanted" > "$stamp"
fi
