"""Rich tables for estimates, measurements, and the catalogs."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memfit.core.categories import CATEGORIES
from memfit.core.units import format_bytes
from memfit.estimators.breakdown import MemoryEstimate
from memfit.techniques import parse_technique


def _fmt(value: int | None) -> str:
    return "—" if value is None else format_bytes(value)


def workload_line(estimate: MemoryEstimate) -> str:
    w = estimate.workload
    parts = [estimate.model, w["task"], f"batch {w['batch_size']} × seq {w['seq_len']}"]
    if w["task"] == "inference" and w.get("new_tokens"):
        parts.append(f"+{w['new_tokens']} new tokens")
    parts.append(w["precision"])
    if w["task"] == "train":
        parts.append(w["optimizer"])
        if w["world_size"] > 1:
            parts.append(f"{w['world_size']} ranks, ZeRO-{w['zero_stage']} ({w['engine']})")
    parts += w.get("techniques", [])
    parts.append(f"device {estimate.device}")
    return " · ".join(parts)


def estimate_table(estimate: MemoryEstimate) -> Table:
    table = Table(title=f"memfit {estimate.method} estimate — {workload_line(estimate)}", title_justify="left")
    table.add_column("category")
    table.add_column("at peak", justify="right")
    table.add_column("own peak", justify="right")
    table.add_column("source")
    for name in CATEGORIES:
        at, own = estimate.at_peak[name], estimate.component_peaks[name]
        if at or own:
            table.add_row(name, _fmt(at), _fmt(own), estimate.sources.get(name, estimate.method))
    table.add_section()
    table.add_row("[bold]peak (tensors)[/bold]", f"[bold]{_fmt(estimate.peak_bytes)}[/bold]", "",
                  f"during {estimate.peak_phase}")
    for name, value in estimate.overhead_detail.items():
        table.add_row(f"+ {name.replace('_', ' ')}", _fmt(value), "", estimate.sources.get(name, "assumed"))
    if estimate.overhead_bytes:
        total = _fmt(estimate.peak_bytes + estimate.overhead_bytes)
        table.add_row("[bold]total on device[/bold]", f"[bold]{total}[/bold]", "", "")
    if estimate.host_bytes or estimate.paged_bytes or estimate.nvme_bytes:
        table.add_section()
    if estimate.paged_bytes:
        table.add_row("paged states (unified memory)", _fmt(estimate.paged_bytes), "", "outside the allocator")
    if estimate.host_bytes:
        table.add_row("host RAM (offloaded)", _fmt(estimate.host_bytes), "", "at its own peak")
    if estimate.nvme_bytes:
        table.add_row("NVMe (swapped states)", _fmt(estimate.nvme_bytes), "", "files on the local drive")
    return table


def fit_line(estimate: MemoryEstimate) -> str | None:
    if estimate.fits is None:
        return None
    assert estimate.device_memory_bytes is not None and estimate.headroom_bytes is not None   # set with fits
    capacity = format_bytes(estimate.device_memory_bytes)
    if estimate.fits:
        headroom = format_bytes(estimate.headroom_bytes)
        return f"[green]Fits[/green] {estimate.device} ({capacity}) with {headroom} headroom."
    return (f"[red]Does not fit[/red] {estimate.device} ({capacity}): short by "
            f"{format_bytes(-estimate.headroom_bytes)}.")


def modules_table(estimate: MemoryEstimate) -> Table:
    table = Table(title="top modules (per layer for repeated layers; activations at their own peak)",
                  title_justify="left")
    for column in ("module", "count", "parameters", "gradients", "optimizer", "activations"):
        table.add_column(column, justify="left" if column == "module" else "right")
    for row in estimate.modules:
        table.add_row(row.name, str(row.count), _fmt(row.parameters), _fmt(row.gradients),
                      _fmt(row.optimizer_states), _fmt(row.activations))
    return table


def measure_table(measured: MemoryEstimate) -> Table:
    estimates = measured.extra.get("estimates", {})
    table = Table(title=f"memfit measure — {workload_line(measured)}", title_justify="left")
    table.add_column("category")
    table.add_column("measured", justify="right")
    for method in estimates:
        table.add_column(method, justify="right")
    for name in CATEGORIES:
        values = [measured.at_peak[name]] + [e["at_peak"][name] for e in estimates.values()]
        if any(values):
            table.add_row(name, *[_fmt(v) for v in values])
    table.add_section()
    table.add_row("[bold]peak[/bold]", f"[bold]{_fmt(measured.peak_bytes)}[/bold]",
                  *[f"[bold]{_fmt(e['peak_bytes'])}[/bold]" for e in estimates.values()])
    table.add_row("peak phase", measured.peak_phase, *[e["peak_phase"] for e in estimates.values()])
    for key, label in (("host_bytes", "host RAM (offloaded)"), ("nvme_bytes", "NVMe (swapped states)")):
        if getattr(measured, key) or any(e.get(key) for e in estimates.values()):
            table.add_row(label, _fmt(getattr(measured, key)), *[_fmt(e.get(key, 0)) for e in estimates.values()])
    if estimates:
        table.add_row("measured / estimated", "", *[f"{measured.peak_bytes / e['peak_bytes']:.4f}"
                                                     for e in estimates.values() if e["peak_bytes"]])
    return table


def print_estimate(estimate: MemoryEstimate, console: Console | None = None) -> None:
    console = console or Console()
    console.print(estimate_table(estimate))
    line = fit_line(estimate)
    if line:
        console.print(line)
    if estimate.modules:
        console.print(modules_table(estimate))
    for note in estimate.notes:
        console.print(f"[dim]note: {note}[/dim]")
    if "step_time_s" in estimate.extra:
        extra = estimate.extra
        rate = extra.get("tokens_per_second_per_gpu", extra.get("samples_per_second_per_gpu"))
        console.print(f"[dim]step time {extra['step_time_s']:.3g} s, {rate:,.0f} {extra['throughput_unit']} "
                      f"(step-time model, {extra['time_source']} constants: planner/cost.py)[/dim]")
    if estimate.extra.get("zero_table"):
        console.print(zero_table(estimate.extra["zero_table"]))
    if estimate.extra.get("technique_savings"):
        console.print(savings_table(estimate.extra["technique_savings"]))


def savings_table(rows: list[dict]) -> Table:
    table = Table(title="what each technique saves here (peak without it − peak with all; "
                        f"{rows[0]['method']})", title_justify="left")
    for column in ("technique", "saves", "host RAM", "step time ×", "changes"):
        table.add_column(column, justify="left" if column in ("technique", "changes") else "right")
    for row in rows:   # host RAM: what the technique adds (+) or frees (−) there
        saved, host = row["saved_bytes"], row["host_bytes"]
        table.add_row(row["technique"], ("−" if saved < 0 else "") + format_bytes(abs(saved)),
                      ("−" if host < 0 else "+") + format_bytes(abs(host)) if host else "",
                      f"{row['time_factor']:.2f} ({row['time_factor_source']})",
                      parse_technique(row["technique"]).training_change())
    return table


def zero_table(rows: list[dict]) -> Table:
    table = Table(title="model states per device by ZeRO stage (ZeRO paper accounting, K = 12)",
                  title_justify="left")
    for column in ("stage", "parameters", "gradients", "optimizer states", "total"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["stage"]), _fmt(row["parameters"]), _fmt(row["gradients"]),
                      _fmt(row["optimizer_states"]), _fmt(row["total"]))
    return table
