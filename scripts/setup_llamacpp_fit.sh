#!/usr/bin/env bash
# Builds ./.llamacpp-tools/: llama.cpp's own llama-fit-params, llama-batched-bench and ggml-rpc-server (the release
# llama-cpp-python 0.3.36 vendors, CPU and RPC backends) and a preloaded shim that sets the memory an RPC server's
# device reports:
# for running llama.cpp's --fit against fake GPUs here (benchmarks/llamacpp_fit_run.py --record). About 10 minutes
# on 2 cores; needs cmake, ninja and a C++ compiler. Safe to run again: it only rebuilds when this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TOOLS=.llamacpp-tools
stamp="$TOOLS/.built"
wanted="$(cat scripts/setup_llamacpp_fit.sh benchmarks/native/fake_device_memory.c | sha1sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  exit 0
fi
mkdir -p "$TOOLS"
if [ ! -d "$TOOLS/src" ]; then
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$TOOLS/sdist"
  tar -xzf "$TOOLS"/sdist/llama_cpp_python-0.3.36.tar.gz -C "$TOOLS"
  mv "$TOOLS/llama_cpp_python-0.3.36/vendor/llama.cpp" "$TOOLS/src"
  rm -rf "$TOOLS/llama_cpp_python-0.3.36" "$TOOLS/sdist"
fi
cmake -S "$TOOLS/src" -B "$TOOLS/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_RPC=ON \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF > "$TOOLS/cmake.log"
ninja -C "$TOOLS/build" -j"$(nproc)" llama-fit-params llama-batched-bench ggml-rpc-server > "$TOOLS/build.log"
gcc -O2 -Wall -shared -fPIC -o "$TOOLS/fake_device_memory.so" benchmarks/native/fake_device_memory.c -ldl
echo "$wanted" > "$stamp"
