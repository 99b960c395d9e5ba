#!/usr/bin/env bash
# The main job on a built-in default: will a full bf16-mixed fine-tune of Llama-3.1-8B at 4k tokens
# fit on one RTX 4090, and where does the memory go?
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/memfit estimate llama-3.1-8b --task train --batch-size 1 --seq-len 4096 --precision bf16-mixed \
  -t checkpointing -t chunked-ce -t adamw8bit --gpu rtx-4090 --modules "$@"
