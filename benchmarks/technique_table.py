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

Part II, the lossy weight techniques (pruning, quantization, LoRA/QLoRA, distillation), starts from the
pretrained small LM of memfit.measurement.accuracy (trained once on the corpus, cached): fine-tuning rows
fine-tune it for the same steps; inference rows quantize or prune it and run it at a small and a large
batch. Accuracy there is the held-out perplexity against the unchanged model's (fine-tuned the same
steps, for the training rows).

Run:  python benchmarks/technique_table.py [--steps N] [--quick] [--part 1|2]
Writes benchmarks/results/technique_table.{txt,json} and technique_table_lossy.{txt,json}.
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

import docs_sync  # noqa: E402   # benchmarks/docs_sync.py: the docs show these results
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memfit.core.units import format_bytes  # noqa: E402
from memfit.measurement import accuracy, measure  # noqa: E402
from memfit.measurement.training import text_batches, train_run  # noqa: E402
from memfit.specs.workload import Workload  # noqa: E402
from memfit.steps.optim import default_lr  # noqa: E402
from memfit.techniques import REGISTRY, parse_technique  # noqa: E402
from memfit.techniques.resolve import resolve  # noqa: E402

MODEL, BATCH, SEQ = "tiny-llama", 8, 256
ROWS = [
    (),
    ("fp16-mixed",), ("bf16-mixed",), ("bf16",), ("bf16-master",),
    ("checkpointing",), ("checkpointing:every=2",), ("checkpointing:mode=selective",),
    ("adamw8bit",), ("adamw4bit",), ("adafactor",),
    ("truncate:max_len=128",), ("sequence-chunks:window=64",), ("sequence-chunks:window=128,stride=64",),
    ("chunked-ce",),
    ("checkpointing:mode=offload",), ("cpu-offload",),
    ("bf16-mixed", "checkpointing", "chunked-ce", "adamw8bit"),
    ("bf16-mixed", "checkpointing:mode=offload", "cpu-offload", "chunked-ce"),
]
QUICK = [0, 2, 5, 8, 16]

# Part II: fine-tuning the pretrained LM, and running it for inference (small and large batch)
FINETUNE_ROWS = [
    (), ("lora",), ("lora:rank=64",), ("lora:targets=all-linear",), ("qlora",), ("qlora:rank=64",),
    ("qlora:targets=all-linear",), ("qlora", "checkpointing", "bf16-mixed"), ("prune-structured:ratio=0.25",),
    ("prune-structured",),
    ("prune-unstructured:sparsity=0.5",), ("qat",), ("distill",), ("distill:teacher=int8",), ("distill:alpha=0",),
]
INFERENCE_ROWS = [
    (), ("bf16",), ("int8-weight-only",), ("int8-dynamic",), ("bnb-4bit",), ("bnb-4bit:format=fp4",),
    ("bf16", "bnb-4bit"), ("prune-structured",), ("prune-unstructured:sparsity=0.5",),
]
INFERENCE_BATCHES = (1, 32)
WHY = {   # one line where the common lore is wrong, shown beside the measured row
    ("prune-unstructured:sparsity=0.5",): "zeros in dense tensors take the same bytes (the 50-80 % needs sparse "
                                          "kernels)",
    ("distill:alpha=0",): "the same student and steps without the teacher's soft targets (alpha=0)",
    ("distill",): "the frozen teacher and both models' logits outweigh the student's saving at this size",
    ("qat",): "fake quantization saves a rounded copy of every weight and input for backward: QAT costs memory",
    ("int8-dynamic",): "each call quantizes its input: input-sized float and integer temporaries grow with the batch",
    ("bf16", "bnb-4bit"): "4-bit weights stay smaller at large batch: the dequantized weight is one linear's, "
                          "freed after each call",
}


def row(techniques: tuple[str, ...], batches, eval_batches, lr: float) -> dict:
    workload = resolve(Workload(model=MODEL, task="train", batch_size=BATCH, seq_len=SEQ, techniques=techniques))
    measured = measure(workload, estimates=("traced", "analytic"))
    own = REGISTRY[workload.optimizer].default_lr if workload.optimizer in REGISTRY else default_lr("adamw")
    if own != default_lr("adamw"):   # its own kind of learning rate: Adafactor at AdamW's would not train (the
        lr = own                     # 8-bit and 4-bit AdamWs train at AdamW's, as the baseline does)
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


def finetune_row(techniques: tuple[str, ...], batches, lr: float) -> dict:
    """Fine-tune the pretrained LM with `techniques` (memory measured on the same step shape); the held-out
    perplexity of what trained, as it runs (LoRA with its adapters, QLoRA on its 4-bit base, the pruned
    model, the distilled student)."""
    workload = Workload(model=MODEL, task="train", batch_size=BATCH, seq_len=SEQ, techniques=techniques)
    measured = measure(workload, estimates=("traced", "analytic"))
    run = train_run(workload, batches, lr=lr, start_from=accuracy.pretrained_lm(), eval_batches=accuracy.eval_batches())
    return {"techniques": list(techniques) or ["fine-tune"], "peak_bytes": measured.peak_bytes,
            "traced_peak_bytes": measured.extra["estimates"]["traced"]["peak_bytes"],
            "analytic_peak_bytes": measured.extra["estimates"]["analytic"]["peak_bytes"],
            "median_step_s": run.median_step_seconds, "perplexity": math.exp(run.eval_loss),
            "why": WHY.get(techniques, "")}


def inference_row(techniques: tuple[str, ...]) -> dict:
    """The pretrained LM with `techniques` for inference: peak at each batch (prefill of 256 tokens and 8
    generated), the median time of a forward over the held-out batches, the held-out perplexity."""
    peaks = {}
    for batch in INFERENCE_BATCHES:
        workload = Workload(model=MODEL, task="inference", batch_size=batch, seq_len=SEQ, new_tokens=8,
                            techniques=techniques)
        measured = measure(workload, estimates=("traced", "analytic"))
        peaks[batch] = {"peak_bytes": measured.peak_bytes, **{f"{m}_peak_bytes": e["peak_bytes"]
                                                               for m, e in measured.extra["estimates"].items()}}
    model = accuracy.pretrained_model(techniques)
    times = []
    with torch.no_grad():
        for batch in accuracy.eval_batches(3):
            started = time.perf_counter()
            model(input_ids=batch["input_ids"])
            times.append(time.perf_counter() - started)
    return {"techniques": list(techniques) or ["float32"], "peaks": peaks, "forward_s": sorted(times)[1],
            "perplexity": accuracy.held_out_perplexity(model=model), "why": WHY.get(techniques, "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per row (default 60)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of every row (default 1e-3)")
    parser.add_argument("--quick", action="store_true", help="five rows only (part 1)")
    parser.add_argument("--part", type=int, choices=(1, 2), help="only part 1 (techniques I) or 2 (lossy weights)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "technique_table"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    console = Console(width=200)
    machine = platform.processor() or platform.machine()
    header = (f"# {time.strftime('%Y-%m-%d')} · torch {torch.__version__} · {machine} · {torch.get_num_threads()} "
              f"threads · python benchmarks/technique_table.py{f' --part {args.part}' if args.part else ''} "
              f"--steps {args.steps}")
    if args.part != 1:
        lossy_tables(args, console, header)
    if args.part == 2:
        return
    batches = text_batches(batch_size=BATCH, seq_len=SEQ, num_batches=args.steps)
    eval_batches = text_batches(batch_size=BATCH, seq_len=SEQ, num_batches=8, split="held-out", seed=1)
    chosen = [ROWS[i] for i in QUICK] if args.quick else ROWS
    rows = []
    for techniques in chosen:
        started = time.perf_counter()
        rows.append(row(techniques, batches, eval_batches, args.lr))
        console.print(f"[dim]{' + '.join(techniques) or 'baseline'}: {time.perf_counter() - started:.0f} s[/dim]")
    table = render(rows, args.steps)
    console.print(table)
    save(args.out, header, [table], {"model": MODEL, "batch_size": BATCH, "seq_len": SEQ, "steps": args.steps,
                                     "rows": rows})


def save(path: str, header: str, tables: list[Table], data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".txt", "w") as fh:
        file_console = Console(file=fh, width=200)
        file_console.print(header)
        for table in tables:
            file_console.print(table)
    with open(path + ".json", "w") as fh:
        json.dump({"header": header, **data}, fh, indent=1)
    docs_sync.sync()


def lossy_tables(args, console: Console, header: str) -> None:
    accuracy.pretrained_lm(progress=console.print)
    batches = text_batches(batch_size=BATCH, seq_len=SEQ, num_batches=args.steps, seed=3)
    finetune = []
    for techniques in FINETUNE_ROWS:
        started = time.perf_counter()
        finetune.append(finetune_row(techniques, batches, args.lr))
        name = " + ".join(techniques) or "whole model"
        console.print(f"[dim]fine-tune {name}: {time.perf_counter() - started:.0f} s[/dim]")
    inference = []
    for techniques in INFERENCE_ROWS:
        started = time.perf_counter()
        inference.append(inference_row(techniques))
        name = " + ".join(techniques) or "float32"
        console.print(f"[dim]inference {name}: {time.perf_counter() - started:.0f} s[/dim]")
    tables = [render_finetune(finetune, args.steps), render_inference(inference)]
    for table in tables:
        console.print(table)
    base = finetune[0]["perplexity"]
    for r in finetune[1:]:    # each fine-tuning technique's accuracy cost, for `effect` and the planner
        if len(r["techniques"]) != 1 or r["techniques"] == ["distill:alpha=0"]:
            continue      # combinations, and the control run without the teacher
        accuracy.record_accuracy(r["techniques"][0], {
            "metric": f"held-out perplexity change after a {args.steps}-step fine-tune",
            "perplexity": round(r["perplexity"], 4), "whole_model_finetune": round(base, 4),
            "change": round(r["perplexity"] / base - 1, 5), "source": accuracy.LM_SOURCE,
            "command": f"python benchmarks/technique_table.py --part 2 --steps {args.steps}"})
    save(args.out + "_lossy", header, tables, {"model": MODEL, "subject": accuracy.LM_SOURCE, "batch_size": BATCH,
                                               "seq_len": SEQ, "steps": args.steps, "finetune": finetune,
                                               "inference": inference})


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="left" if column in ("technique", "why") else "right",
                         no_wrap=column not in ("technique", "why"))
    return table


def render_finetune(rows: list[dict], steps: int) -> Table:
    base = rows[0]
    table = _table(f"fine-tuning the pretrained {MODEL} ({accuracy.LM_SOURCE}) {steps} steps, batch {BATCH} × {SEQ}; "
                   "held-out perplexity of what trained", ["technique", "peak", "peak Δ", "traced / measured",
                                                           "analytic / measured", "step time ×", "held-out ppl",
                                                           "ppl Δ", "why"])
    for r in rows:
        table.add_row(" + ".join(r["techniques"]), format_bytes(r["peak_bytes"]),
                      f"{100 * (r['peak_bytes'] / base['peak_bytes'] - 1):+.1f} %",
                      f"{r['traced_peak_bytes'] / r['peak_bytes']:.4f}",
                      f"{r['analytic_peak_bytes'] / r['peak_bytes']:.4f}",
                      f"{r['median_step_s'] / base['median_step_s']:.2f}", f"{r['perplexity']:.3f}",
                      f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.2f} %", r["why"])
    return table


def render_inference(rows: list[dict]) -> Table:
    base = rows[0]
    columns = ["technique"] + [c for b in INFERENCE_BATCHES for c in (f"peak b{b}", f"Δ b{b}", f"traced/meas. b{b}")]
    table = _table(f"inference with the pretrained {MODEL}: prefill {SEQ} tokens + 8 generated; forward time over "
                   "held-out batches; held-out ppl", columns + ["analytic/meas.", "forward ×", "held-out ppl", "ppl Δ",
                                                                "why"])
    for r in rows:
        cells = []
        for b in INFERENCE_BATCHES:
            peak, base_peak = r["peaks"][b]["peak_bytes"], base["peaks"][b]["peak_bytes"]
            cells += [format_bytes(peak), f"{100 * (peak / base_peak - 1):+.1f} %",
                      f"{r['peaks'][b]['traced_peak_bytes'] / peak:.4f}"]
        worst = max(abs(p["analytic_peak_bytes"] / p["peak_bytes"] - 1) for p in r["peaks"].values())
        table.add_row(" + ".join(r["techniques"]), *cells, f"±{100 * worst:.1f} %",
                      f"{r['forward_s'] / base['forward_s']:.2f}", f"{r['perplexity']:.3f}",
                      f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.2f} %", r["why"])
    return table


if __name__ == "__main__":
    main()
