"""How close are memfit's estimates, and the estimators people use today, to a real run?

Every row is measured for real on this machine (CPU: the CPU allocator's peak, via PyTorch's
profiler) and estimated by memfit (traced, analytic) and by two existing tools:
  accelerate  `accelerate estimate-memory`'s "Training using Adam" (the largest of its components),
              or the model size for inference;
  DeepSpeed   estimate_zero2_model_states_mem_needs (one GPU, no offload; model states only).
Errors are estimate / measured - 1. Run:  python benchmarks/estimator_accuracy.py [--quick]
Writes benchmarks/results/estimator_accuracy.{txt,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
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
from memfit.techniques.resolve import resolve  # noqa: E402

CONVNET = ("memfit.examples.convnet:build", "memfit.examples.convnet:make_inputs")
LSTM = ("memfit.examples.lstm:build", "memfit.examples.lstm:make_inputs")
ROWS = [
    dict(model="tiny-llama", batch_size=4, seq_len=256),
    dict(model="tiny-llama", batch_size=4, seq_len=256, precision="bf16-mixed"),
    dict(model="tiny-llama", task="inference", batch_size=4, seq_len=256, new_tokens=16),
    dict(model="tiny-mixtral", batch_size=4, seq_len=128),
    dict(model="tiny-gemma2", batch_size=2, seq_len=128, precision="bf16-mixed"),
    dict(model="tiny-phi3", batch_size=2, seq_len=256),
    dict(model="tiny-qwen2", batch_size=2, seq_len=256, precision="bf16"),
    dict(model="tiny-t5", batch_size=4, seq_len=128),
    dict(model="tiny-bert", batch_size=8, seq_len=128, precision="bf16-mixed"),
    dict(model="tiny-vit", batch_size=8, seq_len=64),
    dict(model="gpt2", batch_size=2, seq_len=256),
    dict(model="gpt2", batch_size=4, seq_len=512, precision="bf16-mixed"),
    dict(model="gpt2", task="inference", batch_size=8, seq_len=512, new_tokens=32),
    dict(model="gpt2-medium", batch_size=1, seq_len=256),
    dict(model="bert-base-uncased", batch_size=8, seq_len=128),
    dict(model="vit-base-patch16-224", batch_size=4, seq_len=224, precision="bf16-mixed"),
    dict(model="t5-base", batch_size=2, seq_len=128),
    dict(model=CONVNET[0], inputs=CONVNET[1], batch_size=8, seq_len=64),
    dict(model=LSTM[0], inputs=LSTM[1], batch_size=8, seq_len=128),
]
QUICK = [0, 3, 7, 9, 10, 17]


def accelerate_estimate(workload: Workload) -> int | None:
    try:
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
    except ImportError:
        return None
    model = workload.source.build(device="meta", dtype=torch.float32)
    total_size, _ = calculate_maximum_sizes(model)
    if workload.task == "inference":
        return total_size if workload.precision == "fp32" else total_size // 2
    mixed = "float32" if workload.precision == "fp32" else "bfloat16"
    return max(estimate_training_usage(total_size, mixed).values())


def deepspeed_estimate(workload: Workload, num_parameters: int) -> int | None:
    if workload.task != "train":
        return None
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except Exception:   # not installed (pip install 'memfit[compare]' with DS_BUILD_OPS=0)
        return None
    return estimate_zero2_model_states_mem_needs(num_parameters, 1, 1, cpu_offload=False)[1]


def describe(kw: dict) -> str:
    parts = [kw.get("task", "train"), f"b{kw['batch_size']}×{kw['seq_len']}", kw.get("precision", "fp32")]
    if kw.get("new_tokens"):
        parts.append(f"+{kw['new_tokens']}")
    return " ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small rows only")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "estimator_accuracy"))
    args = parser.parse_args()
    rows = [ROWS[i] for i in QUICK] if args.quick else ROWS
    results = []
    console = Console(width=200)
    for index, kw in enumerate(rows, 1):
        workload = resolve(Workload(**kw))
        started = time.perf_counter()
        methods = ("traced", "analytic") if workload.source.is_hf else ("traced",)
        m = measure(workload, estimates=methods)
        row = {"model": workload.model.split(":")[0].split(".")[-1], "workload": describe(kw),
               "measured": m.peak_bytes, "untracked": m.extra["untracked_bytes"],
               "traced": m.extra["estimates"]["traced"]["peak_bytes"],
               "analytic": m.extra["estimates"].get("analytic", {}).get("peak_bytes"),
               "accelerate": accelerate_estimate(workload),
               "deepspeed": deepspeed_estimate(workload, m.num_parameters),
               "traced_s": m.extra["estimates"]["traced"]["elapsed_s"],
               "analytic_s": m.extra["estimates"].get("analytic", {}).get("elapsed_s")}
        results.append(row)
        console.print(f"[{index}/{len(rows)}] {row['model']} {row['workload']}: "
                      f"measured {format_bytes(row['measured'])}"
                      f" ({time.perf_counter() - started:.0f} s)", style="dim")
    table = Table(title=f"Peak memory: measured vs estimated (CPU, torch {torch.__version__}, {platform.machine()})",
                  title_justify="left")
    for column in ("model", "workload", "measured", "memfit traced", "memfit analytic", "accelerate", "DeepSpeed"):
        table.add_column(column, justify="left" if column in ("model", "workload") else "right")

    def cell(value):
        if value is None:
            return "n/a"
        return f"{format_bytes(value)} ({value / row['measured'] - 1:+.1%})"

    for row in results:
        table.add_row(row["model"], row["workload"], format_bytes(row["measured"]), cell(row["traced"]),
                      cell(row["analytic"]), cell(row["accelerate"]), cell(row["deepspeed"]))
    console.print(table)
    console.print("Errors are estimate / measured - 1. DeepSpeed's estimator covers model states only; "
                  "accelerate's reports the largest single component as training memory.")
    for row in results:
        if row["untracked"] > 0.01 * row["measured"]:
            console.print(f"{row['model']} {row['workload']}: {format_bytes(row['untracked'])} allocated inside "
                          "kernels (oneDNN scratch) that no tensor accounts for; the trace probes it.")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as fh:
        json.dump({"torch": torch.__version__, "python": sys.version.split()[0], "rows": results}, fh, indent=1)
    with open(args.out + ".txt", "w") as fh:
        Console(file=fh, width=200).print(table)
    docs_sync.sync()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
