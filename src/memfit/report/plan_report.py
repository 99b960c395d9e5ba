"""`memfit plan` output: the ranked plans, the best plan's savings, why nothing fits, and the Pareto plot."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memfit.core.errors import MemfitError
from memfit.core.units import GiB, format_bytes
from memfit.planner.instances import InstanceRanking
from memfit.planner.result import PlanResult
from memfit.report.tables import savings_table


def _seconds(value: float) -> str:
    if value < 0.01:
        return f"{value * 1e6:.0f} µs" if value < 1e-3 else f"{value * 1000:.1f} ms"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s" if value < 100 else f"{value:.0f} s"


WIDE = 120   # columns from which the plans table shows each plan's free memory and what it changes in training


def plans_table(result: PlanResult, width: int = WIDE) -> Table:
    """The ranked plans, in `width` columns (narrower: the technique lists wrap, free memory is left out and what a
    plan changes goes under its techniques)."""
    request = result.request
    batch = (f"global batch {request.sequences}" if request.task == "train"
             else f"batch {request.batch_size}, +{request.new_tokens} tokens")
    title = (f"memfit plan — {request.model} {request.task}, {batch}, {request.num_gpus} × {request.gpu.name} "
             f"({format_bytes(request.gpu.memory_bytes)}, {request.margin:.0%} margin), objective {request.objective}"
             + "".join(f"; {constraint}" for constraint in request.constraints()))
    if request.seq_len is None:
        title += "; seq len: the model's default"
    table = Table(title=title, title_justify="left")
    plans = [result.plan_json(index) for index in range(len(result.plans))]
    columns = ["#", "techniques", "mb×acc", "peak/GPU", "free", "host RAM", "step", _rate_column(plans), "changes"]
    if width < WIDE:   # narrower: what a plan changes goes under its techniques
        columns.remove("free")
        columns.remove("changes")
    for column in columns:
        table.add_column(column, justify="left" if column in ("techniques", "changes") else "right",
                         min_width=20 if column == "techniques" else None, overflow="fold")
    for index, plan in enumerate(plans):
        changes = plan["training_change"]   # what it changes in training (memfit techniques explains each)
        if plan["ppl_increase"]:
            changes += f" (ppl +{plan['ppl_increase']:.1%})"
        techniques = " + ".join(plan["techniques"])
        if "changes" not in columns:
            techniques += f"\n[dim]changes: {changes}[/dim]"
        cells = {"#": str(index + 1), "techniques": techniques,
                 "mb×acc": f"{plan['micro_batch']} × {plan['grad_accum']}",
                 "peak/GPU": format_bytes(plan["peak_bytes"], 1), "free": format_bytes(plan["headroom_bytes"], 1),
                 "host RAM": format_bytes(plan["host_ram_bytes"], 1) if plan["host_ram_bytes"] else "",
                 "step": _seconds(plan["step_time_s"]), "changes": changes}
        table.add_row(*(cells.get(column, f"{plan['throughput']:,.0f}") for column in columns))
    return table


def print_plans(result: PlanResult, console: Console | None = None) -> None:
    console = console or Console()
    if not result.feasible:
        console.print(f"[red]No plan fits.[/red] {result.reason}.")
        for suggestion in result.suggestions:
            console.print(f"  • {suggestion}")
    else:
        console.print(plans_table(result, console.width))
        for source in dict.fromkeys(plan["ppl_source"] for plan in map(result.plan_json, range(len(result.plans)))
                                    if plan.get("ppl_source")):
            console.print(f"[dim]ppl: {source}[/dim]")
        if result.savings and result.savings[0]:
            console.print(savings_table(result.savings[0]))
        best = result.plan_json(0)
        parts = ", ".join(f"{name} {_seconds(value)}" for name, value in best["time_parts_s"].items() if value)
        console.print(f"[dim]plan 1's step: {parts} (cost model: {best['sources']['time']} constants, "
                      f"planner/cost.py); peak per GPU "
                      f"is the {best['sources']['memory']} tensor peak {format_bytes(best['tensor_peak_bytes'])} + "
                      "cuBLAS workspaces (modelled) + the caching allocator's reserve (simulated) + CUDA context "
                      "(assumed)[/dim]")
        if result.tradeoff:
            console.print(f"[dim]{result.tradeoff}[/dim]")
        for warning in result.warnings:
            console.print(f"[yellow]{warning}[/yellow]")
        if "usd_per_million_tokens" in best:
            console.print(price_line(best))
        if result.request.host_ram_bytes is None and any(p.host_ram_bytes for p in result.plans):
            console.print("[dim]host RAM was not checked: pass --host-ram to rule out plans your machine cannot "
                          "hold[/dim]")
    console.print(f"[dim]searched {len(result.evaluated)} configurations ({result.num_estimates} "
                  f"{result.memory_method} estimates, "
                  f"{sum(result.rejected.values())} combinations refused by the composition rules) in "
                  f"{result.elapsed_s:.1f} s[/dim]")


def _unit(plan: dict) -> str:
    """What the plan's throughput counts: tokens, or samples for a model whose batch is not tokens."""
    return plan["throughput_unit"].split("/")[0]


def _rate_column(plans: list[dict]) -> str:
    return "sample/s/GPU" if plans and _unit(plans[0]) == "samples" else "tok/s/GPU"


def price_line(plan: dict) -> str:
    price, per_million = plan["price"], plan["usd_per_million_tokens"]
    if per_million is None:
        return f"on {plan['instance']}: no price"
    return (f"on {plan['instance']} at ${_usd(plan['usd_per_hour'])}/h ({price['kind']}, {price['date']}, "
            f"{price['source']}): ${_usd(per_million)} per million {_unit(plan)}")


def _usd(value: float) -> str:
    return f"{value:,.2f}" if value >= 1 else f"{value:.3g}"


def print_instance_ranking(ranking: InstanceRanking, console: Console) -> None:
    """Each priced machine's best plan, cheapest per million tokens (or samples) first, then the machines nothing
    fits."""
    fitting = ranking.fitting
    if fitting:
        request, plans = fitting[0].request, [result.plan_json(0) for result in fitting]
        unit = _unit(plans[0])
        table = Table(title=f"memfit plan — {request.model} {request.task} on every priced instance, cheapest per "
                            f"million {unit} first (on-demand list prices: `memfit instances` has each date and "
                            "source; --price NAME=USD to use yours)", title_justify="left")
        wide = console.width >= WIDE   # narrower: the GPUs go under the instance, the batch and host RAM under the plan
        columns = ["#", "instance", "GPUs", "$/h", "plan", "mb×acc", "peak/GPU", "host RAM", _rate_column(plans),
                   f"$/M {unit}"]
        if not wide:
            columns = [c for c in columns if c not in ("GPUs", "mb×acc", "host RAM")]
        for column in columns:
            table.add_column(column, justify="left" if column in ("instance", "GPUs", "plan") else "right",
                             no_wrap=column != "plan", overflow="fold", ratio=1 if column == "plan" else None)
        for index, (result, plan) in enumerate(zip(fitting, plans)):
            gpus = f"{result.request.num_gpus} × {result.request.gpu.name}"
            host = format_bytes(plan["host_ram_bytes"], 1) if plan["host_ram_bytes"] else ""
            batch = f"{plan['micro_batch']} × {plan['grad_accum']}"
            techniques = " + ".join(plan["techniques"])
            cells = {"#": str(index + 1), "instance": plan["instance"] if wide else f"{plan['instance']}\n{gpus}",
                     "GPUs": gpus, "$/h": _usd(plan["usd_per_hour"]),
                     "plan": techniques if wide else f"{techniques}\n[dim]{batch}" + (f", host {host}" if host else "")
                     + "[/dim]",
                     "mb×acc": batch, "peak/GPU": format_bytes(plan["peak_bytes"], 1), "host RAM": host,
                     _rate_column(plans): f"{plan['throughput']:,.0f}",
                     f"$/M {unit}": _usd(plan["usd_per_million_tokens"])}
            table.add_row(*(cells[column] for column in columns))
        console.print(table)
    else:
        console.print("[red]No priced instance fits this request.[/red]")
    for result in ranking.results:
        if not result.feasible:
            assert result.request.instance is not None   # each ranked result was planned on its instance
            console.print(f"  [dim]{result.request.instance.name}: {result.reason}[/dim]")
    if ranking.unpriced:
        console.print(f"[dim]left out (no list price; give one with --price NAME=USD): "
                      f"{', '.join(ranking.unpriced)}[/dim]")
    console.print(f"[dim]planned {len(ranking.results)} instances in {ranking.elapsed_s:.1f} s[/dim]")


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (memory, time) that no other point beats on both."""
    front, best_time = [], float("inf")
    for memory, seconds in sorted(points):
        if seconds < best_time:
            front.append((memory, seconds))
            best_time = seconds
    return front


def write_pareto_plot(result: PlanResult, path: str) -> None:
    """Every configuration sized: peak per GPU against step time, the frontier joined, the budget drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise MemfitError("plots need matplotlib: pip install 'memfit[plot]'") from None
    sized = [e for e in result.evaluated if e.time is not None]
    if not sized:
        raise MemfitError("--plot: no configuration was sized, so there is nothing to draw.")
    fig, ax = plt.subplots(figsize=(10, 6))
    for fits, colour, label in ((False, "0.7", "does not fit (smallest micro-batch)"),
                                (True, "tab:blue", "fits (largest micro-batch that does)")):
        chosen = [(e.device_bytes / GiB, e.timed.total_s) for e in sized if e.fits == fits]
        if chosen:
            ax.scatter(*zip(*chosen), s=14, color=colour, label=label)  # type: ignore[misc]  # *zip: x, y only
    front = pareto_front([(e.device_bytes / GiB, e.timed.total_s) for e in sized])
    ax.plot(*zip(*front), "-", color="tab:red", lw=1, label="Pareto frontier (memory vs time)")
    for rank, plan in enumerate(result.plans[:3]):
        ax.annotate(f"plan {rank + 1}: " + " + ".join(plan.techniques), (plan.device_bytes / GiB, plan.timed.total_s),
                    fontsize=7, xytext=(6, 6), textcoords="offset points")
    budget = result.request.budget_bytes / GiB
    ax.axvline(budget, color="k", ls="--", lw=0.8, label=f"budget per GPU ({budget:.1f} GiB)")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlim(min(min(p[0] for p in front), budget) * 0.8, max(e.device_bytes / GiB for e in sized) * 1.2)
    ax.set_xlabel("predicted peak per GPU (GiB, with overheads; log scale)")
    ax.set_ylabel("predicted step time (s)")
    request = result.request
    ax.set_title(f"{request.model} {request.task} on {request.num_gpus} × {request.gpu.name}: every configuration "
                 "sized")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
