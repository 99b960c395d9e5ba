#!/usr/bin/env bash
# The main job on a built-in default: the fastest way to fully fine-tune Llama-3.1-8B at 4k tokens,
# 64 sequences per optimizer step, on one RTX 4090 with 64 GiB of host RAM and an NVMe drive - which
# techniques, which micro-batch, and why.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/memfit plan llama-3.1-8b --task train --seq-len 4096 --global-batch 64 --instance rtx-4090-workstation "$@"
