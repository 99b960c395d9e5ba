"""GPU checks of what memfit models but cannot measure on a CPU (run where a CUDA GPU is present).

For each row: the real step on CUDA (max_memory_allocated and max_memory_reserved after the steady-state step)
beside memfit's traced and analytic estimates for that GPU (their tensor peaks, and the reserved bytes of the
simulated caching allocator), plus the device memory that lies outside PyTorch's allocator (CUDA context, library
workspaces). The rows: the test zoo × {fp32, fp16-mixed, bf16-mixed, bf16, fp16}
× {foreach, fused} optimizer × {eager, sdpa} attention, then the techniques whose CUDA behaviour is modelled
(checkpointing, 8-bit and 4-bit states, offload, the allocator settings). The ratios it prints are what the
`assumed` figures in estimators/gpu_overhead.py and gpus.json should be replaced with.

    python benchmarks/gpu_validate.py               # one CUDA GPU: stops starting rows after --budget-s
    python benchmarks/gpu_validate.py --dry-run     # the rows it would run, and what it would skip (no GPU)
    python benchmarks/gpu_validate.py --replay      # today's memfit against the committed GPU measurements (no GPU)
    python benchmarks/gpu_validate.py --sites tiny-t5   # also record where those rows' peaks lie (peak_sites)
    PYTHONPATH=src python benchmarks/gpu_validate.py   # memfit from source, on whatever torch is installed

Every row is written to benchmarks/results/gpu_validate.json as soon as it is measured (a run cut off keeps
what it measured), with the versions it ran on; the table goes to gpu_validate.txt. A row that needs a package
that is not installed (bitsandbytes, torchao) is skipped by name. Every row runs in this one process: cuBLAS's
workspaces (one per thread and stream, kept for the process's life) stay allocated from the rows before, so a row
after the first training row holds both threads' (65 MiB on an H100 or H200) where memfit predicts an inference
step's one (33 MiB).

`--replay` needs no GPU: it predicts every measured row of the committed gpu_validate.json again with the memfit
and the torch / transformers installed here (which may differ from those the GPU ran: the JSON names them), for the
GPU that was measured, and prints each row's error then and now beside the measured bytes (also written to
gpu_validate_replay.txt and .json). A change to a CUDA model is checked against real GPU runs this way.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memfit.core.precision import PRECISIONS  # noqa: E402
from memfit.core.units import format_bytes  # noqa: E402
from memfit.specs.model_source import catalog  # noqa: E402
from memfit.specs.workload import Workload  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_validate")
ZOO = ("tiny-llama", "tiny-bert", "tiny-gpt2", "tiny-t5", "tiny-vit", "tiny-mixtral")
SHAPE = dict(batch_size=8, seq_len=256)
IMPLS = ("foreach", "fused")
ATTENTION = ("sdpa", "eager")
TECHNIQUES = [
    dict(model="gpt2", batch_size=8, seq_len=1024, precision="bf16-mixed"),          # dropout, fused attention
    dict(model="bert-base-uncased", batch_size=32, seq_len=512, precision="fp16-mixed"),
    dict(model="llama-3.1-8b", task="inference", batch_size=8, seq_len=2048, new_tokens=64, precision="bf16"),
    dict(model="qwen2.5-7b", batch_size=1, seq_len=2048, precision="bf16", optimizer="sgd"),
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("checkpointing",)),
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed",
         techniques=("checkpointing:mode=selective",)),
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed",
         techniques=("checkpointing:mode=selective-op",)),
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("chunked-ce",)),
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("compile",)),
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="fp32", techniques=("compile",)),
    dict(model="gpt2", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("adamw8bit", "checkpointing")),
    dict(model="gpt2", batch_size=8, seq_len=1024, precision="bf16", techniques=("adamw4bit",)),
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed",
         techniques=("checkpointing:mode=offload",)),
    dict(model="gpt2", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("cpu-offload",)),
    dict(model="qwen2.5-7b", task="inference", batch_size=1, seq_len=2048, new_tokens=16, precision="bf16",
         techniques=("stream-layers",)),
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("release-cache",)),
    # the allocator setting is process-wide and stays on: this row comes last (reserved / allocated is its check)
    dict(model="tiny-llama", batch_size=8, seq_len=1024, precision="bf16-mixed", techniques=("expandable-segments",)),
]
NEEDS = {"adamw8bit": "bitsandbytes", "adamw4bit": "torchao", "qlora": "bitsandbytes"}   # technique -> package


def rows(config_dir: str) -> list[dict]:
    """The rows in the order they run: every model at every precision first (the default optimizer and
    attention), then the other optimizer implementation, then eager attention, then the techniques; a run cut
    off by its budget still covers each axis."""
    def zoo_row(model, precision, impl, attention):
        config = os.path.join(config_dir, f"{model}-{attention}.json")
        return dict(model=config, label=model, **SHAPE, precision=precision, optimizer_impl=impl,
                    attention=attention)

    grid = [zoo_row(m, p, IMPLS[0], ATTENTION[0]) for m in ZOO for p in PRECISIONS]
    grid += [zoo_row(m, p, IMPLS[1], ATTENTION[0]) for m in ZOO for p in PRECISIONS]
    grid += [zoo_row(m, p, i, ATTENTION[1]) for m in ZOO for p in PRECISIONS for i in IMPLS]
    return grid + [dict(kw, label=kw["model"]) for kw in TECHNIQUES]


def write_configs(config_dir: str) -> None:
    for model in ZOO:
        for attention in ATTENTION:
            with open(os.path.join(config_dir, f"{model}-{attention}.json"), "w") as fh:
                json.dump({**catalog()[model]["hf_config"], "attn_implementation": attention}, fh)


def missing_package(row: dict) -> str | None:
    for spec in row.get("techniques", ()):
        package = NEEDS.get(spec.split(":")[0])
        if package and importlib.util.find_spec(package) is None:
            return package
    return None


def workload_of(row: dict) -> Workload:
    return Workload(**{k: v for k, v in row.items() if k not in ("label", "attention")})


def check(row: dict) -> str:
    """'' when memfit accepts the row's workload, else the reason (a dry run shows it before any GPU time)."""
    from memfit.core.errors import MemfitError
    from memfit.techniques.resolve import resolve

    try:
        resolve(workload_of(row))
    except MemfitError as exc:
        return f"   (refused: {exc})"
    return ""


def row_name(row: dict) -> str:
    parts = [row["label"], row.get("task", "train"), f"b{row['batch_size']}×{row['seq_len']}", row["precision"]]
    parts += [row[k] for k in ("optimizer_impl", "attention") if k in row] + list(row.get("techniques", ()))
    return " ".join(parts)


def versions() -> dict:
    import transformers

    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                cwd=os.path.dirname(RESULTS), timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "python": platform.python_version(), "memfit_commit": commit,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def predicted(estimates: dict) -> dict:
    """The prediction columns from estimates' JSON by method: max_memory_allocated (the tensors and cuBLAS's
    workspaces) and the simulated allocator's reserved bytes."""
    def allocated(method):
        found = estimates.get(method)
        return found and (found.get("allocator") or {}).get("allocated_bytes", found["peak_bytes"])
    return {"traced": allocated("traced"), "analytic": allocated("analytic"),
            "traced_reserved": estimates["traced"].get("reserved_bytes"),
            "analytic_reserved": estimates.get("analytic", {}).get("reserved_bytes")}


def measure_row(row: dict, sites: bool = False) -> dict:
    """The row on the GPU; with `sites`, where its measured step's peak lies (peak_sites of a memory snapshot)."""
    import pickle

    from memfit.measurement import measure

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        snapshot = os.path.join(folder, "step.pickle") if sites else None
        try:
            m = measure(workload_of(row), device="cuda:0", snapshot_path=snapshot)
        finally:
            torch.cuda.empty_cache()
        where = {}
        if snapshot:
            with open(snapshot, "rb") as fh:
                where = {"peak_sites": peak_sites(pickle.load(fh))}
    return {"allocated": m.extra["max_memory_allocated"], "reserved": m.extra["max_memory_reserved"],
            **predicted(m.extra["estimates"]), "host": m.host_bytes,
            "seconds": round(time.perf_counter() - started, 1), **where}


def peak_sites(snapshot: dict, top: int = 25) -> dict:
    """Where a measured step's allocated peak lies, from the allocator's trace in a memory snapshot (recording starts
    with the step, so what was allocated before it, weights and optimizer states, is not in the trace): the blocks the
    step allocated that are alive at its highest point, grouped by the innermost Python frame outside torch (the model
    code that asked) and the innermost frame (the op), largest first; `freed_before_peak` is what the step freed of the
    blocks it found. Compared with memfit's trace, it shows which tensors a miss is made of."""
    events = max(snapshot.get("device_traces") or [[]], key=len)
    live, freed_earlier, height, best, at_best, freed_at_best = {}, 0, 0, 0, {}, 0
    for event in events:
        action, addr, size = event.get("action"), event.get("addr"), event.get("size", 0)
        if action == "alloc":
            live[addr] = event
            height += size
        elif action == "free_completed":
            if live.pop(addr, None) is None:
                freed_earlier += size
            height -= size
        if height > best:
            best, at_best, freed_at_best = height, dict(live), freed_earlier
    groups: dict[tuple[str, str], list[int]] = {}
    for event in at_best.values():
        frames = [f for f in event.get("frames") or [] if str(f.get("filename", "")).endswith(".py")]
        outside = next((f for f in frames if "/torch/" not in f["filename"]), None)
        site = f"{os.path.basename(outside['filename'])}:{outside['line']} {outside['name']}" if outside else "?"
        group = groups.setdefault((site, frames[0]["name"] if frames else "?"), [0, 0])
        group[0] += event.get("size", 0)
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    return {"step_peak_bytes": best, "freed_before_peak": freed_at_best,
            "sites": [{"site": site, "op": op, "bytes": size, "blocks": count}
                      for (site, op), (size, count) in ranked[:top]]}


def replay(planned: list[dict], only: str = "") -> int:
    """Each measured row of the committed run (those whose name contains `only`), predicted again here for the GPU
    it ran on (no GPU needed). A full replay is written beside the run's results; a filtered one only printed."""
    from memfit.estimators import estimate, methods_for
    from memfit.specs.hardware import gpu_of_device_name
    from memfit.techniques.resolve import resolve

    with open(RESULTS + ".json") as fh:
        report = json.load(fh)
    here = versions()   # before anything is written: the tree is then as committed
    gpu = gpu_of_device_name(report["versions"]["device"], report["total_bytes"])
    by_name = {row_name(row): row for row in planned}
    console, started, results = Console(width=200), time.perf_counter(), []
    for measured in (r for r in report["rows"] if "allocated" in r and only in r["row"]):
        row = by_name.get(measured["row"])
        result = {"row": measured["row"], "allocated": measured["allocated"], "reserved": measured["reserved"],
                  "then": {k: measured.get(k) for k in ("traced", "analytic")}}
        if row is None:
            result["error"] = "no longer a row of this script"
        else:
            workload = resolve(workload_of(row))
            result |= predicted({m: estimate(workload, method=m, gpu=gpu).to_json() for m in methods_for(workload)})
        results.append(result)
        console.print(f"{time.perf_counter() - started:6.0f} s  {result['row']}: "
                      f"{result.get('error') or replay_cells(result)[1]}")
    title = (f"{report['versions']['device']} (torch {report['versions']['torch']}, transformers "
             f"{report['versions']['transformers']}) measured; predicted then (memfit "
             f"{report['versions']['memfit_commit']}) and now (torch {torch.__version__})")
    table = Table(title=title, title_justify="left")
    for column in ("row", "max allocated", "traced then → now", "analytic then → now", "max reserved",
                   "traced reserved now", "analytic reserved now"):
        table.add_column(column, justify="left" if column == "row" else "right")
    for r in results:
        table.add_row(*replay_cells(r))
    summary = replay_summary(results)
    console.print(table, summary)
    if only:
        return 0
    with open(RESULTS + "_replay.txt", "w") as fh:
        Console(file=fh, width=200).print(table, summary)
    with open(RESULTS + "_replay.json", "w") as fh:
        json.dump({"measured_on": report["versions"], "predicted_with": here, "summary": summary,
                   "rows": results}, fh, indent=1)
    return 0


def _error(predicted_bytes, measured_bytes) -> str:
    return "n/a" if not predicted_bytes else f"{(predicted_bytes / measured_bytes - 1) * 100:+.1f} %"


def replay_cells(r: dict) -> list[str]:
    if "error" in r:
        return [r["row"], format_bytes(r["allocated"]), r["error"], "", "", "", ""]
    return [r["row"], format_bytes(r["allocated"]),
            *(f"{_error(r['then'][m], r['allocated'])} → {_error(r[m], r['allocated'])}"
              for m in ("traced", "analytic")),
            format_bytes(r["reserved"]), _error(r["traced_reserved"], r["reserved"]),
            _error(r["analytic_reserved"], r["reserved"])]


def replay_summary(results: list[dict]) -> str:
    """How many rows each estimator puts within 2 % and 5 % of max_memory_allocated, then and now."""
    lines = []
    for method in ("traced", "analytic"):
        for label, pick in (("then", lambda r, m=method: r["then"][m]), ("now", lambda r, m=method: r.get(m))):
            errors = [abs(pick(r) / r["allocated"] - 1) for r in results if pick(r)]
            lines.append(f"{method} {label}: {sum(e <= 0.02 for e in errors)} of {len(errors)} rows within 2 %, "
                         f"{sum(e <= 0.05 for e in errors)} within 5 %")
    return "\n".join(lines)


def table_of(results: list[dict], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("row", "max allocated", "traced", "analytic", "max reserved", "traced (simulated)",
                   "analytic (simulated)", "host RAM", "s"):
        table.add_column(column, justify="left" if column == "row" else "right")
    for r in results:
        if "allocated" not in r:
            table.add_row(r["row"], r.get("error") or r.get("skipped", ""), *[""] * 7)
            continue

        def cell(v, measured):
            return "n/a" if v is None else f"{format_bytes(v)} ({measured / v:.3f})"
        table.add_row(r["row"], format_bytes(r["allocated"]), cell(r["traced"], r["allocated"]),
                      cell(r["analytic"], r["allocated"]), format_bytes(r["reserved"]),
                      cell(r.get("traced_reserved"), r["reserved"]), cell(r.get("analytic_reserved"), r["reserved"]),
                      format_bytes(r["host"]) if r["host"] else "", f"{r['seconds']:.0f}")
    return table


def context_bytes() -> tuple[int, int]:
    """Device memory outside PyTorch's allocator after CUDA's init and a first matmul (context, cuBLAS)."""
    free_before, total = torch.cuda.mem_get_info()
    torch.zeros(1, device="cuda")
    torch.matmul(torch.ones(64, 64, device="cuda"), torch.ones(64, 64, device="cuda"))
    free_after, _ = torch.cuda.mem_get_info()
    return free_before - free_after - torch.cuda.memory_reserved(), total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="list the rows and what would be skipped; no GPU")
    parser.add_argument("--replay", action="store_true",
                        help="predict the committed GPU run's rows again with today's memfit; no GPU")
    parser.add_argument("--only", metavar="TEXT", default="",
                        help="with --replay: only the rows whose name contains TEXT (printed, no files written)")
    parser.add_argument("--sites", metavar="TEXT", action="append", default=[],
                        help="on the GPU: record where the peak lies (a memory snapshot, summarised into the JSON) "
                             "for the rows whose name contains TEXT; repeatable")
    parser.add_argument("--budget-s", type=float, default=220.0,
                        help="start no row after this many seconds (default 220: the run ends within ~4 minutes)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memfit-gpu-validate-") as config_dir:
        write_configs(config_dir)
        planned = rows(config_dir)
        if args.dry_run:
            for row in planned:
                package = missing_package(row)
                print(row_name(row) + (f"   (skipped: needs {package})" if package else check(row)))
            print(f"{len(planned)} rows; versions here: {json.dumps(versions())}")
            return 0
        if args.replay:
            return replay(planned, args.only)
        if not torch.cuda.is_available():
            print("gpu_validate: no CUDA device here; nothing to check (--dry-run lists the rows).")
            return 0
        return run(planned, args.budget_s, args.sites)


def run(planned: list[dict], budget_s: float, sites: list[str] = ()) -> int:
    started = time.perf_counter()
    context, total = context_bytes()
    report = {"versions": versions(), "context_bytes": context, "total_bytes": total, "rows": []}
    console = Console(width=200)
    for row in planned:
        result = {"row": row_name(row), "workload": {k: v for k, v in row.items() if k != "model"} | {
            "model": row["label"]}}
        package = missing_package(row)
        if package:
            result["skipped"] = f"skipped: needs {package}"
        elif time.perf_counter() - started > budget_s:
            result["skipped"] = f"not run: the {budget_s:.0f} s budget was spent"
        else:
            try:
                result |= measure_row(row, sites=any(text in result["row"] for text in sites))
            except Exception as exc:   # report and go on: one failure must not hide the rest
                result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        report["rows"].append(result)
        console.print(f"{time.perf_counter() - started:6.0f} s  {result['row']}: "
                      f"{result.get('error') or result.get('skipped') or format_bytes(result['allocated'])}")
        with open(RESULTS + ".json", "w") as fh:   # after every row: a run cut off keeps what it measured
            json.dump(report, fh, indent=1)
    title = (f"{report['versions']['device']}: measured vs memfit (GPU target); memory outside PyTorch's allocator "
             f"{format_bytes(context)} of {format_bytes(total)}")
    table = table_of(report["rows"], title)
    console.print(table)
    with open(RESULTS + ".txt", "w") as fh:
        Console(file=fh, width=200).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
