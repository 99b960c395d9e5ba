"""The analytic estimator against the traced one on every bundled model at real size, three shapes each.

The suite checks one model of each family (tests/test_analytic.py); this is the whole sweep: a bf16-mixed training
step on an H100 target at three (batch, sequence) points per model. Passes when each peak is within 5 % and each
category's own peak within 10 % (or 0.5 % of the peak), as the suite asks. Run:
    python benchmarks/analytic_vs_traced.py     -> benchmarks/results/analytic_vs_traced.{txt,json}
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memfit.core.categories import CATEGORIES  # noqa: E402
from memfit.core.units import format_bytes  # noqa: E402
from memfit.estimators.analytic import analytic_estimate  # noqa: E402
from memfit.estimators.traced import traced_estimate  # noqa: E402
from memfit.specs.hardware import get_gpu  # noqa: E402
from memfit.specs.model_source import catalog  # noqa: E402
from memfit.techniques.resolve import ResolvedWorkload  # noqa: E402

PEAK_TOLERANCE, CATEGORY_TOLERANCE, SLIVER = 0.05, 0.10, 0.005
BUNDLED = [name for name in catalog() if not name.startswith("tiny-")]


def points(name: str) -> list[tuple[int, int]]:
    """(batch, sequence) points: short and long, small and large batches, within the model's own limits."""
    model_type = catalog()[name]["hf_config"]["model_type"]
    if model_type == "vit":
        return [(1, 224), (8, 224), (4, 384)]
    if model_type in ("bert", "t5"):
        return [(1, 128), (8, 512), (32, 256)]
    if model_type == "gpt2":
        return [(1, 512), (4, 1024), (16, 256)]
    return [(1, 512), (2, 2048), (8, 1024)]


def compare(analytic, traced) -> tuple[float, str | None]:
    """(peak error, the first category out of tolerance or None)."""
    error = analytic.peak_bytes / traced.peak_bytes - 1
    floor = SLIVER * traced.peak_bytes
    for name in CATEGORIES:
        a, t = analytic.component_peaks[name], traced.component_peaks[name]
        if abs(a - t) > max(CATEGORY_TOLERANCE * t, floor):
            return error, name
    return error, None


def main() -> int:
    gpu = get_gpu("h100-sxm-80gb")
    table = Table(title="analytic vs traced: bf16-mixed training step, H100 target (error = analytic / traced - 1)",
                  title_justify="left")
    for column in ("model", "batch × seq", "traced peak", "analytic peak", "error", "categories", "seconds"):
        table.add_column(column, justify="left" if column in ("model", "categories") else "right")
    rows, failed = [], 0
    for name in BUNDLED:
        for batch, seq in points(name):
            started = time.perf_counter()
            workload = ResolvedWorkload(model=name, batch_size=batch, seq_len=seq, precision="bf16-mixed")
            analytic, traced = analytic_estimate(workload, gpu), traced_estimate(workload, gpu)
            error, off = compare(analytic, traced)
            ok = abs(error) < PEAK_TOLERANCE and off is None
            failed += not ok
            seconds = time.perf_counter() - started
            rows.append({"model": name, "batch": batch, "seq_len": seq, "traced_peak_bytes": traced.peak_bytes,
                         "analytic_peak_bytes": analytic.peak_bytes, "error": error, "category_off": off, "ok": ok})
            table.add_row(name, f"{batch} × {seq}", format_bytes(traced.peak_bytes), format_bytes(analytic.peak_bytes),
                          f"{error:+.2%}", "within tolerance" if off is None else f"{off} off", f"{seconds:.1f}")
            print(f"{name} {batch}x{seq}: {error:+.2%}", file=sys.stderr, flush=True)
    console = Console(width=140, record=True)
    console.print(table)
    worst = max(rows, key=lambda r: abs(r["error"]))
    console.print(f"{len(rows)} points, {failed} out of tolerance; worst peak error {worst['error']:+.2%} "
                  f"({worst['model']} {worst['batch']} × {worst['seq_len']})")
    results = os.path.join(os.path.dirname(__file__), "results")
    with open(os.path.join(results, "analytic_vs_traced.txt"), "w") as fh:
        fh.write(console.export_text())
    with open(os.path.join(results, "analytic_vs_traced.json"), "w") as fh:
        json.dump({"gpu": gpu.name, "rows": rows}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
