"""GPU checks of what memfit models but cannot measure on a CPU (run where a CUDA GPU is present).

For each workload: the real step on CUDA (max_memory_allocated and max_memory_reserved after the
steady-state step) beside memfit's traced and analytic estimates for that GPU, plus the device
memory that lies outside PyTorch's allocator (CUDA context, library workspaces). The ratios it prints
are what the `assumed` figures in estimators/gpu_overhead.py and gpus.json should be replaced with.
Run:  python benchmarks/gpu_validate.py  (about 7 minutes on one H200)
Writes benchmarks/results/gpu_validate.{txt,json}.
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import docs_sync  # noqa: E402   # benchmarks/docs_sync.py: the docs show these results
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memfit.core.units import format_bytes  # noqa: E402
from memfit.measurement import measure  # noqa: E402
from memfit.specs.workload import Workload  # noqa: E402

WORKLOADS = [
    dict(model="tiny-llama", batch_size=8, seq_len=512, precision="bf16-mixed"),
    dict(model="gpt2", batch_size=8, seq_len=1024, precision="bf16-mixed"),          # dropout, fused attention
    dict(model="gpt2", batch_size=8, seq_len=1024, precision="fp32"),
    dict(model="bert-base-uncased", batch_size=32, seq_len=512, precision="fp16-mixed"),
    dict(model="t5-base", batch_size=8, seq_len=512, precision="bf16-mixed"),
    dict(model="vit-base-patch16-224", batch_size=64, seq_len=224, precision="bf16-mixed"),
    dict(model="qwen2.5-7b", batch_size=1, seq_len=2048, precision="bf16", optimizer="sgd"),
    dict(model="llama-3.1-8b", task="inference", batch_size=8, seq_len=2048, new_tokens=64, precision="bf16"),
    # techniques: what CUDA changes about them (foreach temporaries, fused kernels, the 8-bit optimizer's
    # fused kernel, the CUDA autocast lists inside checkpoint re-runs)
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("checkpointing",)),
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed",
         techniques=("checkpointing:mode=selective",)),
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("chunked-ce",)),
    dict(model="gpt2", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("adamw8bit", "checkpointing")),
    dict(model="gpt2", batch_size=8, seq_len=1024, precision="bf16", techniques=("adamw4bit",)),
    dict(model="qwen2.5-7b", batch_size=1, seq_len=2048, precision="bf16",
         techniques=("checkpointing", "chunked-ce", "adamw8bit")),
    # offload: pinned host buffers, real device <-> host copies (the host column is memfit's own count)
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed",
         techniques=("checkpointing:mode=offload",)),
    dict(model="gpt2", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("cpu-offload",)),
    dict(model="qwen2.5-7b", task="inference", batch_size=1, seq_len=2048, new_tokens=16, precision="bf16",
         techniques=("stream-layers",)),
    # the allocator setting is process-wide and stays on: this row comes last (reserved / allocated is its check)
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("expandable-segments",)),
]


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_validate: no CUDA device here; nothing to check.")
        return 0
    free_before, total = torch.cuda.mem_get_info()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.matmul(torch.ones(64, 64, device="cuda"), torch.ones(64, 64, device="cuda"))
    free_after, _ = torch.cuda.mem_get_info()
    context = free_before - free_after - torch.cuda.memory_reserved()
    rows = []
    for kw in WORKLOADS:
        started = time.perf_counter()
        try:
            m = measure(Workload(**kw), device="cuda:0")
        except Exception as exc:  # report and go on: one failure must not hide the rest
            rows.append({"workload": kw, "error": f"{type(exc).__name__}: {exc}"})
            continue
        finally:
            torch.cuda.empty_cache()
        est = m.extra["estimates"]
        rows.append({"workload": kw, "allocated": m.extra["max_memory_allocated"],
                     "reserved": m.extra["max_memory_reserved"], "traced": est["traced"]["peak_bytes"],
                     "analytic": est.get("analytic", {}).get("peak_bytes"), "host": m.host_bytes,
                     "seconds": time.perf_counter() - started})
    table = Table(title=f"{torch.cuda.get_device_name()}: measured vs memfit (GPU target)", title_justify="left")
    for column in ("workload", "max allocated", "traced", "analytic", "reserved / allocated", "host RAM"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for row in rows:
        kw = row["workload"]
        name = " ".join([kw["model"], kw.get("task", "train"), f"b{kw['batch_size']}×{kw['seq_len']}", kw["precision"],
                         *kw.get("techniques", ())])
        if "error" in row:
            table.add_row(name, row["error"], "", "", "", "")
            continue
        def cell(v, allocated=row["allocated"]):
            return "n/a" if v is None else f"{format_bytes(v)} ({allocated / v:.3f})"
        table.add_row(name, format_bytes(row["allocated"]), cell(row["traced"]), cell(row["analytic"]),
                      f"{row['reserved'] / row['allocated']:.3f}", format_bytes(row["host"]) if row["host"] else "")
    console = Console(width=180)
    console.print(table)
    console.print(f"memory outside PyTorch's allocator after init + first matmul: {format_bytes(context)} "
                  f"(device total {format_bytes(total)})")
    out = os.path.join(os.path.dirname(__file__), "results", "gpu_validate")
    with open(out + ".json", "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "context_bytes": context, "total_bytes": total,
                   "rows": rows}, fh, indent=1)
    with open(out + ".txt", "w") as fh:
        Console(file=fh, width=180).print(table)
    docs_sync.sync()
    return 0


if __name__ == "__main__":
    sys.exit(main())
