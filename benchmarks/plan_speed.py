"""How long does `memfit plan` take? Targets: planning a 70B model on 8 GPUs in under 10 s here (issue 5), and a
7B custom module (no transformer config: every configuration sized by traces) in under a minute (issue 17).

Each case runs the command line in a fresh process (imports included, as a user waits for it) and reports
the wall time, the planner's own time, how many configurations it sized and estimates it made, and its
answer. Run:  python benchmarks/plan_speed.py   -> benchmarks/results/plan_speed.txt
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import docs_sync  # benchmarks/docs_sync.py: the docs show these results
from rich.console import Console
from rich.table import Table

from memfit.core.units import format_bytes

CASES = [
    "llama-3.1-70b --task train --gpu h100-sxm-80gb --gpus 8 --host-ram 1TiB",
    "llama-3.1-70b --task train --seq-len 4096 --global-batch 64 --gpu h100-sxm-80gb --gpus 8 --host-ram 1TiB",
    "llama-3.1-8b --task train --seq-len 4096 --global-batch 64 --gpu rtx-4090",
    "mistral-7b --task inference --batch-size 16 --seq-len 8192 --new-tokens 512 --gpu l4",
    "gpt2-xl --task train --gpu t4 --allow lossy --max-ppl-increase 2%",
    "llama-3.1-70b --task train --seq-len 2048 --gpu rtx-4090 --host-ram 0",
    "qwen2.5-72b --task train --seq-len 8192 --global-batch 32 --gpu a100-80gb --gpus 8 --allow lossy",
    "memfit.examples.custom_decoder:build_7b --inputs memfit.examples.custom_decoder:make_inputs --gpu a100-80gb "
    "--seq-len 2048 --global-batch 8",
]
TARGET_S = 10.0
CUSTOM_TARGET_S = 60.0


def main() -> None:
    console = Console(width=200)
    table = Table(title="memfit plan: wall time of the command (fresh process, imports included)", title_justify="left")
    for column in ("command", "wall s", "planner s", "sized", "estimates", "answer"):
        table.add_column(column, justify="left" if column in ("command", "answer") else "right")
    worst = custom = 0.0
    for case in CASES:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "memfit.cli.main", "plan", *case.split(), "--json"],
                              capture_output=True, text=True, check=True)
        wall = time.perf_counter() - started
        data = json.loads(done.stdout)
        if case.startswith("llama-3.1-70b") and "--gpus 8" in case:
            worst = max(worst, wall)
        if case.startswith("memfit.examples"):
            custom = wall
        best = data["plans"][0] if data["plans"] else None
        answer = (f"{' + '.join(best['techniques'])} {best['micro_batch']}×{best['grad_accum']}, "
                  f"{format_bytes(best['peak_bytes'])}" if best else f"infeasible: {data['reason'][:90]}")
        table.add_row(f"memfit plan {case}", f"{wall:.1f}", f"{data['search']['elapsed_s']:.1f}",
                      str(data["search"]["candidates_sized"]), str(data["search"]["estimates"]), answer)
    console.print(table)
    verdict = (f"70B on 8 GPUs: {worst:.1f} s at worst (target < {TARGET_S:.0f} s): "
               f"{'met' if worst < TARGET_S else 'MISSED'}; a 7B custom module: {custom:.0f} s (target < "
               f"{CUSTOM_TARGET_S:.0f} s): {'met' if custom < CUSTOM_TARGET_S else 'MISSED'}")
    console.print(verdict)
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/plan_speed.txt", "w") as fh:
        out = Console(file=fh, width=200)
        out.print(f"python benchmarks/plan_speed.py\n{platform.platform()}, {os.cpu_count()} CPUs\n")
        out.print(table)
        out.print(verdict)
    docs_sync.sync()


if __name__ == "__main__":
    main()
