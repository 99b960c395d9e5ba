"""What each technique saves and costs, measured side by side in one run on a small causal LM.

For every technique (and mode): the peak of a real training step (CPU allocator, via `memfit measure`)
against the baseline's, with memfit's traced and analytic predictions beside it; the median step time
over a short training run on the bundled real text (tinyshakespeare, byte tokens) against the
baseline's, measured in the same process one after the other; and the held-out loss after that
training (perplexity = exp(loss)) against the baseline's. All rows train from the same initial weights
on the same batches with the same learning rate (Adafactor with its own). Step times are CPU times on
this machine: they show recompute and extra work, not what a GPU would gain from half precision.
Offload rows move memory to the host (the "host RAM" column): on the CPU the copies stay in one
memory, so their step time shows the copying work, not a PCIe transfer.

Run:  python benchmarks/technique_table.py [--steps N] [--quick]
Writes benchmarks/results/technique_table.{txt,json}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memfit.core.units import format_bytes  # noqa: E402
from memfit.measurement import measure  # noqa: E402
from memfit.measurement.training import text_batches, train_run  # noqa: E402
from memfit.specs.workload import Workload  # noqa: E402
from memfit.steps.optim import DEFAULT_LR  # noqa: E402
from memfit.techniques.base import parse_technique  # noqa: E402

MODEL, BATCH, SEQ = "tiny-llama", 8, 256
ROWS = [
    (),
    ("fp16-mixed",), ("bf16-mixed",), ("bf16",),
    ("checkpointing",), ("checkpointing:every=2",), ("checkpointing:mode=selective",),
    ("adamw8bit",), ("adamw4bit",), ("adafactor",),
    ("truncate:max_len=128",), ("sequence-chunks:window=64",), ("sequence-chunks:window=128,stride=64",),
    ("chunked-ce",),
    ("checkpointing:mode=offload",), ("cpu-offload",),
    ("bf16-mixed", "checkpointing", "chunked-ce", "adamw8bit"),
    ("bf16-mixed", "checkpointing:mode=offload", "cpu-offload", "chunked-ce"),
]
QUICK = [0, 2, 4, 7, 15]


def row(techniques: tuple[str, ...], batches, eval_batches, lr: float) -> dict:
    workload = Workload(model=MODEL, task="train", batch_size=BATCH, seq_len=SEQ, techniques=techniques)
    measured = measure(workload, estimates=("traced", "analytic"))
    if workload.optimizer == "adafactor":   # its own learning rate: Adafactor at AdamW's would not train
        lr = DEFAULT_LR["adafactor"]
    run = train_run(workload, batches, lr=lr, eval_batches=eval_batches)
    risks = {parse_technique(t).risk for t in techniques} or {"lossless"}
    return {
        "techniques": list(techniques) or ["baseline"],
        "risk": "lossy" if "lossy" in risks else "numerical" if "numerical" in risks else "lossless",
        "peak_bytes": measured.peak_bytes, "host_bytes": measured.host_bytes,
        "traced_peak_bytes": measured.extra["estimates"]["traced"]["peak_bytes"],
        "analytic_peak_bytes": measured.extra["estimates"]["analytic"]["peak_bytes"],
        "lr": lr, "median_step_s": run.median_step_seconds, "first_loss": run.losses[0], "last_loss": run.losses[-1],
        "eval_loss": run.eval_loss, "skipped_steps": run.skipped_steps,
    }


def render(rows: list[dict], steps: int) -> Table:
    base = rows[0]
    table = Table(title=f"techniques on {MODEL}, batch {BATCH} × seq {SEQ}, {steps} training steps on tinyshakespeare "
                        f"(held-out perplexity); measured side by side in one run", title_justify="left")
    for column in ("technique", "risk", "peak", "peak Δ", "host RAM", "traced / measured", "analytic / measured",
                   "step time ×", "lr", "held-out ppl", "ppl Δ"):
        table.add_column(column, justify="left" if column in ("technique", "risk") else "right",
                         no_wrap=column != "technique", min_width=36 if column == "technique" else None)
    for r in rows:
        ppl, base_ppl = math.exp(r["eval_loss"]), math.exp(base["eval_loss"])
        table.add_row(" + ".join(r["techniques"]), r["risk"], format_bytes(r["peak_bytes"]),
                      f"{100 * (r['peak_bytes'] / base['peak_bytes'] - 1):+.1f} %",
                      format_bytes(r["host_bytes"]) if r["host_bytes"] else "",
                      f"{r['traced_peak_bytes'] / r['peak_bytes']:.4f}",
                      f"{r['analytic_peak_bytes'] / r['peak_bytes']:.4f}",
                      f"{r['median_step_s'] / base['median_step_s']:.2f}", f"{r['lr']:g}",
                      f"{ppl:.2f}", f"{100 * (ppl / base_ppl - 1):+.2f} %")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per row (default 60)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of every row (default 1e-3)")
    parser.add_argument("--quick", action="store_true", help="five rows only")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "technique_table"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    batches = text_batches(batch_size=BATCH, seq_len=SEQ, num_batches=args.steps)
    eval_batches = text_batches(batch_size=BATCH, seq_len=SEQ, num_batches=8, split="held-out", seed=1)
    chosen = [ROWS[i] for i in QUICK] if args.quick else ROWS
    console = Console(width=200)
    rows = []
    for techniques in chosen:
        started = time.perf_counter()
        rows.append(row(techniques, batches, eval_batches, args.lr))
        console.print(f"[dim]{' + '.join(techniques) or 'baseline'}: {time.perf_counter() - started:.0f} s[/dim]")
    table = render(rows, args.steps)
    console.print(table)
    header = (f"# {time.strftime('%Y-%m-%d')} · torch {torch.__version__} · {platform.processor() or platform.machine()} "
              f"· {torch.get_num_threads()} threads · python benchmarks/technique_table.py --steps {args.steps}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".txt", "w") as fh:
        file_console = Console(file=fh, width=200)
        file_console.print(header)
        file_console.print(table)
    with open(args.out + ".json", "w") as fh:
        json.dump({"header": header, "model": MODEL, "batch_size": BATCH, "seq_len": SEQ, "steps": args.steps,
                   "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
