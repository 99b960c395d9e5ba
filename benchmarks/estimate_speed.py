"""How fast are the estimators, and how much memory does estimating take?

Targets (issue 2): a traced estimate of a llama-3.1-70b training step (bf16-mixed, batch 1, seq
4096) in under 60 s on a 2-core machine, under 2 GiB of resident memory; an analytic estimate of
any catalog model in under 50 ms. Issue 39: a traced inference estimate of llama-3.1-8b (batch 4, 8192 tokens
+ 512 new, bf16, L4) in under 10 s. Each traced case runs in a fresh process (so its resident-memory
peak is its own). Run:  python benchmarks/estimate_speed.py   -> benchmarks/results/estimate_speed.txt
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import docs_sync  # noqa: E402   # benchmarks/docs_sync.py: the docs show these results
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memfit.core.units import format_bytes  # noqa: E402
from memfit.estimators.analytic import analytic_estimate  # noqa: E402
from memfit.estimators.analytic.families.registry import has_family  # noqa: E402
from memfit.specs.hardware import get_gpu  # noqa: E402
from memfit.specs.model_source import catalog  # noqa: E402
from memfit.specs.workload import Workload  # noqa: E402
from memfit.techniques.resolve import resolve  # noqa: E402

TRAIN = dict(batch_size=1, seq_len=4096, precision="bf16-mixed")
# (model, workload, target, every layer traced); inference (issue 39): a few decode steps traced, the rest read off
TRACED = [("llama-3.1-70b", TRAIN, "h100", False), ("llama-3.1-405b", TRAIN, "h100", False),
          ("llama-2-7b", TRAIN, "h100", False), ("llama-2-7b", TRAIN, "h100", True),
          ("mixtral-8x7b", TRAIN, "h100", False),
          ("llama-3.1-8b", dict(task="inference", batch_size=4, seq_len=8192, new_tokens=512, precision="bf16"), "l4",
           False),
          ("qwen2.5-72b", dict(task="inference", batch_size=1, seq_len=32768, new_tokens=1024, precision="bf16"),
           "h200", False),
          ("qwen3-30b-a3b", dict(task="inference", batch_size=1, seq_len=4096, new_tokens=256, precision="bf16"),
           "h100", False)]
_CHILD = """
import json, resource, time, warnings; warnings.filterwarnings("ignore")
from memfit.estimators.traced import traced_estimate
from memfit.specs.hardware import get_gpu
from memfit.specs.workload import Workload
started = time.perf_counter()
e = traced_estimate(Workload(model={model!r}, **{workload!r}), get_gpu({gpu!r}), full_trace={full})
print(json.dumps({{"seconds": time.perf_counter() - started, "peak": e.peak_bytes,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def _shape(workload: dict) -> str:
    shape = f"{workload['batch_size']} × {workload['seq_len']}"
    if workload.get("task") == "inference":
        return f"inference {shape} + {workload['new_tokens']} new, {workload['precision']}"
    return f"train {shape}, {workload['precision']}"


def main() -> int:
    console = Console(width=160)
    traced = Table(title="traced estimates (one process each)", title_justify="left")
    for column in ("model", "step", "target", "mode", "seconds", "peak estimated", "resident memory"):
        traced.add_column(column, justify="left" if column in ("model", "step", "target", "mode") else "right")
    for model, workload, gpu, full in TRACED:
        child = _CHILD.format(model=model, workload=workload, gpu=gpu, full=full)
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        data = json.loads(out)
        traced.add_row(model, _shape(workload), gpu, "every layer" if full else "extrapolated",
                       f"{data['seconds']:.1f}", format_bytes(data["peak"]), format_bytes(data["rss"]))
    console.print(traced)

    analytic = Table(title="analytic estimates (median of 5; bf16-mixed training, batch 1 × 2048 or the model's "
                           "size, H100)", title_justify="left")
    for column in ("model", "milliseconds", "peak estimated"):
        analytic.add_column(column, justify="left" if column == "model" else "right")
    worst = 0.0
    for name in catalog():
        source = resolve(Workload(model=name)).source
        if not has_family(source):   # estimated by trace only (analytic programs: estimators/analytic/families)
            continue
        seq = source.image_size if source.head == "image-classification" else min(2048, source.max_seq_len or 512)
        workload = Workload(model=name, batch_size=1, seq_len=seq, precision="bf16-mixed")
        analytic_estimate(workload, get_gpu("h100"))   # first call builds the config object
        times = []
        for _ in range(5):
            started = time.perf_counter()
            result = analytic_estimate(workload, get_gpu("h100"))
            times.append((time.perf_counter() - started) * 1000)
        worst = max(worst, statistics.median(times))
        analytic.add_row(name, f"{statistics.median(times):.1f}", format_bytes(result.peak_bytes))
    console.print(analytic)
    console.print(f"slowest analytic estimate: {worst:.1f} ms")
    out = os.path.join(os.path.dirname(__file__), "results", "estimate_speed.txt")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        file_console = Console(file=fh, width=160)
        file_console.print(traced)
        file_console.print(analytic)
        file_console.print(f"slowest analytic estimate: {worst:.1f} ms")
    docs_sync.sync()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
