"""What the published-row benchmarks share: their table (id, metric, reported, predicted, error, notes) and how
they write it (benchmarks/results/NAME.json and .txt, then the docs' results sections)."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import docs_sync
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"


def number(value) -> str:
    return f"{value:,.2f}" if isinstance(value, float) else f"{value:,}"


def rows_table(title: str, records: list[dict], *, label: Callable[[dict], str] = lambda r: r["id"],
               show: Callable[[dict, object], str] = lambda r, v: number(v),
               error: Callable[[dict], str] = lambda r: f"{100 * r['error']:+.1f}%") -> Table:
    """One row per record; a miss (metric "-") shows its reason alone."""
    table = Table(title=title)
    for column in ("id", "metric", "reported", "predicted", "error", "notes"):
        table.add_column(column, justify="right" if column in ("reported", "predicted", "error") else "left")
    for r in records:
        if r["metric"] == "-":
            table.add_row(r["id"], "-", "", "", "", r["notes"])
        else:
            table.add_row(label(r), r["metric"], show(r, r["reported"]), show(r, r["predicted"]), error(r), r["notes"])
    return table


def write_results(name: str, totals: dict, records: list[dict], table: Table) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"summary": totals, "rows": records}, indent=1) + "\n")
    console = Console(record=True, width=150)
    console.print(table)
    (RESULTS / f"{name}.txt").write_text(console.export_text())
    docs_sync.sync()
