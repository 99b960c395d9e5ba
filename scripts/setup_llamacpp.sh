#!/usr/bin/env bash
# Creates ./.venv-llama (separate from ./.venv) with the real llama.cpp, built from source by llama-cpp-python
# (cmake and a C++ compiler; about 5 minutes on 2 cores, CPU only), and the gguf package that writes the tiny
# models it loads: for comparing memfit's llama.cpp buffers with what llama.cpp itself allocates
# (benchmarks/llamacpp_cpu_run.py). Safe to run again: it only rebuilds when this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-llama
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.llamacpp-installed"
wanted="$(sha1sum scripts/setup_llamacpp.sh | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # the CPU backend only, with its native instruction set (the machine that runs the comparison builds it)
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$VENV/bin/python" -m pip install -q --no-cache-dir "llama-cpp-python==0.3.36" "gguf==0.19.0"
  echo "$wanted" > "$stamp"
fi
