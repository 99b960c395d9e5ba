"""The technique table's last two families, measured side by side: distributed training and memory partitioning.

Distributed (seed technique 8, and DeepSpeed's ZeRO): each layout trains tiny-llama on 2 real ranks (torchrun, gloo,
this CPU; FSDP2 x tensor parallel on a 2 x 2 mesh on 4), every rank on the same micro-batch as the one-process
baseline: the highest per-rank peak of a real step
(CPU allocator, via `memfit measure`) with memfit's traced and analytic predictions beside it (DeepSpeed's engine
has no trace: analytic only), host RAM, the median step time over a short run on the bundled text against one
process's (gloo on one machine's CPU: communication is memory copies, not a network), and the loss after that run
against one process's (the ranks average gradients of identical batches: the same training up to rounding).

Memory partitioning (seed technique 7): parking frozen modules in host RAM is measured (a classifier on a frozen
encoder, memfit.examples.frozen_encoder); the CUDA allocator's settings (expandable segments, releasing the cache)
act only on CUDA's caching allocator, so their rows are modelled — the analytic estimate on an H100 target with the
simulated allocator's reserve — and the measured columns stay empty.

Run:  python benchmarks/technique_table_distributed.py [--steps N]
Writes benchmarks/results/technique_table_distributed.{txt,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
warnings.filterwarnings("ignore")

import docs_sync  # noqa: E402   # benchmarks/docs_sync.py: the docs show these results
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memfit.core.units import format_bytes  # noqa: E402
from memfit.estimators import estimate  # noqa: E402
from memfit.measurement import measure  # noqa: E402
from memfit.measurement.ranks import train_ranks_runs  # noqa: E402
from memfit.measurement.run import measure_many  # noqa: E402
from memfit.measurement.training import text_batches, train_run  # noqa: E402
from memfit.specs.hardware import get_gpu  # noqa: E402
from memfit.specs.workload import Workload  # noqa: E402
from memfit.techniques.resolve import resolve  # noqa: E402

MODEL, BATCH, SEQ, LR = "tiny-llama", 4, 256, 1e-3
DEEPSPEED = {"engine": "deepspeed", "precision": "bf16-mixed", "reduce_bucket": 1_000_000}
LAYOUTS = [   # (row label, the workload's fields; on 2 ranks unless they say otherwise)
    ("ddp", {"techniques": ("ddp",)}),
    ("ddp + ZeRO-1 (ZeroRedundancyOptimizer)", {"zero_stage": 1}),
    ("fsdp2", {"techniques": ("fsdp2",)}),
    ("fsdp2:reshard=false", {"techniques": ("fsdp2:reshard=false",)}),
    ("fsdp2 + cpu-offload", {"techniques": ("fsdp2", "cpu-offload")}),
    ("tensor-parallel", {"techniques": ("tensor-parallel",)}),
    ("pipeline-parallel (1f1b, 2 micro-batches)", {"techniques": ("pipeline-parallel",)}),
    ("fsdp2 × tensor-parallel:size=2 (2-D mesh, 4 ranks: 4 processes on this CPU)",
     {"techniques": ("fsdp2", "tensor-parallel:size=2"), "world_size": 4}),
    ("fsdp2 × pipeline-parallel:stages=2 (2-D mesh, 4 ranks: 4 processes on this CPU)",
     {"techniques": ("fsdp2", "pipeline-parallel:stages=2"), "world_size": 4}),
    ("DeepSpeed ZeRO-1 (bf16)", {**DEEPSPEED, "zero_stage": 1}),
    ("DeepSpeed ZeRO-2 (bf16)", {**DEEPSPEED, "zero_stage": 2}),
    ("DeepSpeed ZeRO-3 (bf16)", {**DEEPSPEED, "zero_stage": 3}),
    ("DeepSpeed ZeRO-2 + ZeRO-Offload (bf16)", {**DEEPSPEED, "zero_stage": 2, "techniques": ("cpu-offload",)}),
    ("DeepSpeed ZeRO-3 + ZeRO-Offload (bf16)", {**DEEPSPEED, "zero_stage": 3, "techniques": ("cpu-offload",)}),
    ("DeepSpeed ZeRO-3 + NVMe offload (ZeRO-Infinity, bf16; the swap files on this machine's disk)",
     {**DEEPSPEED, "zero_stage": 3, "techniques": ("nvme-offload",)}),
    ("DeepSpeed ZeRO-2 + checkpointing (bf16)", {**DEEPSPEED, "zero_stage": 2, "techniques": ("checkpointing",)}),
]
FROZEN = {"model": "memfit.examples.frozen_encoder:build", "inputs": "memfit.examples.frozen_encoder:make_inputs",
          "task": "train", "batch_size": 8, "seq_len": 128}
ALLOCATOR = ("expandable-segments", "release-cache")


def layout_rows(steps: int, console: Console) -> list[dict]:
    """The one-process baseline and every layout: measured peaks, predictions, step times, losses."""
    workloads = [resolve(Workload(model=MODEL, task="train", batch_size=BATCH, seq_len=SEQ,
                                  **{"world_size": 2, **fields})) for _, fields in LAYOUTS]
    baseline = resolve(Workload(model=MODEL, task="train", batch_size=BATCH, seq_len=SEQ))
    bf16_baseline = resolve(Workload(model=MODEL, task="train", batch_size=BATCH, seq_len=SEQ, precision="bf16-mixed"))
    started = time.perf_counter()
    pytorch = [i for i, w in enumerate(workloads) if w.engine == "pytorch"]
    deepspeed = [i for i, w in enumerate(workloads) if w.engine == "deepspeed"]
    measured = dict(zip(pytorch, measure_many([workloads[i] for i in pytorch], estimates=("traced", "analytic"))))
    measured |= dict(zip(deepspeed, measure_many([workloads[i] for i in deepspeed], estimates=("analytic",))))
    console.print(f"[dim]measured {len(workloads)} layouts on their ranks: {time.perf_counter() - started:.0f} s[/dim]")
    trained = []   # one launch per layout, so that each reports when it is done (a bf16 layout takes minutes)
    for (label, _), workload in zip(LAYOUTS, workloads):
        trained += train_ranks_runs([workload], steps=steps, lr=LR)
        console.print(f"[dim]trained {label} {steps} steps ({len(trained)} of {len(workloads)}): "
                      f"{time.perf_counter() - started:.0f} s[/dim]")
    batches = text_batches(batch_size=BATCH, seq_len=SEQ, num_batches=steps)
    rows = []
    for label, one in (("one process", baseline), ("one process, bf16-mixed", bf16_baseline)):
        run, alone = measure(one, estimates=("traced", "analytic")), train_run(one, batches, lr=LR)
        rows.append(_row(label, one, run, alone.median_step_seconds, alone.losses[-1]))
    for (label, _), workload, i in zip(LAYOUTS, workloads, range(len(workloads))):
        per_rank = trained[i]
        step_s = max(sorted(r["step_seconds"])[len(r["step_seconds"]) // 2] for r in per_rank)
        rows.append(_row(label, workload, measured[i], step_s, per_rank[0]["losses"][-1]))
    return rows


def _row(label: str, workload, run, step_s: float, last_loss: float) -> dict:
    estimates = run.extra["estimates"]
    return {"layout": label, "world_size": workload.world_size, "workload": workload.to_json(),
            "peak_bytes": run.peak_bytes, "rank_peak_bytes": run.extra.get("rank_peak_bytes", [run.peak_bytes]),
            "host_bytes": run.host_bytes, "analytic_host_bytes": estimates["analytic"]["host_bytes"],
            "nvme_bytes": run.nvme_bytes, "analytic_nvme_bytes": estimates["analytic"].get("nvme_bytes", 0),
            **{f"{method}_peak_bytes": e["peak_bytes"] for method, e in estimates.items()},
            "median_step_s": step_s, "last_loss": last_loss}


def partitioning_rows() -> list[dict]:
    """park-frozen measured against the same model without it; the allocator settings modelled on an H100."""
    base, parked = (measure(Workload(**FROZEN, techniques=t), estimates=("traced",)) for t in ((), ("park-frozen",)))
    rows = [{"technique": name, "peak_bytes": run.peak_bytes, "host_bytes": run.host_bytes,
             "traced_peak_bytes": run.extra["estimates"]["traced"]["peak_bytes"], "source": "measured"}
            for name, run in (("frozen encoder, nothing parked", base), ("park-frozen", parked))]
    gpu = get_gpu("h100")
    for techniques in ((), *((name,) for name in ALLOCATOR)):
        modelled = estimate(Workload(model=MODEL, task="train", batch_size=BATCH, seq_len=SEQ, techniques=techniques),
                            method="analytic", gpu=gpu)
        rows.append({"technique": " + ".join(techniques) or "tiny-llama, allocator defaults", "source": "modelled",
                     "analytic_peak_bytes": modelled.peak_bytes, "reserved_bytes": modelled.reserved_bytes})
    return rows


def render(rows: list[dict], partitioning: list[dict], steps: int) -> list[Table]:
    base = rows[0]
    layouts = Table(title=f"distributed layouts on 2 gloo ranks, the 2-D mesh on 4 (this CPU): {MODEL}, "
                          f"micro-batch {BATCH} × seq {SEQ} "
                          f"per rank, {steps} training steps; the highest per-rank peak", title_justify="left")
    for column in ("layout", "ranks", "peak / rank", "peak Δ", "host RAM (analytic)", "NVMe (analytic)",
                   "traced / measured",
                   "analytic / measured", "step time ×", "loss after", "loss Δ"):
        layouts.add_column(column, justify="left" if column == "layout" else "right",
                           no_wrap=column != "layout", min_width=30 if column == "layout" else None)
    for r in rows:
        layouts.add_row(r["layout"], str(r["world_size"]), format_bytes(r["peak_bytes"]),
                        f"{100 * (r['peak_bytes'] / base['peak_bytes'] - 1):+.1f} %",
                        f"{format_bytes(r['host_bytes'])} ({format_bytes(r['analytic_host_bytes'])})"
                        if r["host_bytes"] else "",
                        f"{format_bytes(r['nvme_bytes'])} ({format_bytes(r['analytic_nvme_bytes'])})"
                        if r.get("nvme_bytes") else "",
                        f"{r['traced_peak_bytes'] / r['peak_bytes']:.4f}" if "traced_peak_bytes" in r else "—",
                        f"{r['analytic_peak_bytes'] / r['peak_bytes']:.4f}",
                        f"{r['median_step_s'] / base['median_step_s']:.2f}", f"{r['last_loss']:.4f}",
                        f"{100 * (r['last_loss'] / base['last_loss'] - 1):+.2f} %")
    memory = Table(title="memory partitioning: park-frozen measured (a classifier on a frozen encoder, batch 8 × 128); "
                         f"the CUDA allocator's settings modelled ({MODEL} on an H100: the simulated allocator's "
                         "reserve), not measurable on a CPU", title_justify="left")
    for column in ("technique", "source", "peak (measured)", "host RAM", "traced / measured", "peak (analytic)",
                   "reserved (simulated)"):
        memory.add_column(column, justify="left" if column in ("technique", "source") else "right")
    for r in partitioning:
        measured = r["source"] == "measured"
        memory.add_row(r["technique"], r["source"], format_bytes(r["peak_bytes"]) if measured else "",
                       format_bytes(r["host_bytes"]) if measured and r["host_bytes"] else "",
                       f"{r['traced_peak_bytes'] / r['peak_bytes']:.4f}" if measured else "",
                       "" if measured else format_bytes(r["analytic_peak_bytes"]),
                       "" if measured else format_bytes(r["reserved_bytes"]))
    return [layouts, memory]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per layout (default 20)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "technique_table_distributed"))
    args = parser.parse_args()
    console = Console(width=200)
    header = (f"# {time.strftime('%Y-%m-%d')} · torch {torch.__version__} · {platform.machine()} · "
              f"python benchmarks/technique_table_distributed.py --steps {args.steps}")
    rows = layout_rows(args.steps, console)
    partitioning = partitioning_rows()
    tables = render(rows, partitioning, args.steps)
    for table in tables:
        console.print(table)
    with open(args.out + ".txt", "w") as fh:
        file_console = Console(file=fh, width=200)
        file_console.print(header)
        for table in tables:
            file_console.print(table)
    with open(args.out + ".json", "w") as fh:
        json.dump({"header": header, "layouts": rows, "partitioning": partitioning}, fh, indent=1)
    docs_sync.sync()


if __name__ == "__main__":
    main()
