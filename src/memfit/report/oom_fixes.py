"""`memfit explain-oom`: what held the memory when the allocation failed, and the fixes, ranked by what
each is predicted to save.

Predictions come from one of three places, each labelled: the OOM message itself (fragmentation, other
processes), the snapshot's categories with a published ratio (rough; each technique says which, e.g. 8-bit
AdamW keeps 2 of 8 bytes of state per parameter), or — when the workload is given — memfit's estimate of
the workload with and without each technique (the same numbers `memfit estimate -t` prints). The fixes
are the techniques' own (`oom_fixes`, `oom_fix`); this module ranks and prints them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from memfit.core.errors import MemfitError
from memfit.core.units import format_bytes
from memfit.estimators import estimate
from memfit.estimators.breakdown import MemoryEstimate
from memfit.measurement.oom import OomMessage, SnapshotSummary
from memfit.specs.hardware import GPU
from memfit.techniques import REGISTRY
from memfit.techniques.base import Technique, parse_technique
from memfit.techniques.resolve import ResolvedWorkload, all_techniques, with_technique
from memfit.techniques.rules import ordered

SCHEMA = "memfit.oom/1"
OTHER_PROCESSES = "stop other processes"


@dataclass
class Fix:
    fix: str
    saved_bytes: int
    basis: str            # where the prediction comes from
    how: str              # what to change

    def closes(self, shortfall: int | None) -> bool | None:
        return None if shortfall is None else self.saved_bytes >= shortfall


def shortfall_of(message: OomMessage | None, snapshot: SnapshotSummary | None) -> int | None:
    if message is not None:
        return message.shortfall_bytes
    if snapshot is not None and snapshot.oom_tried_bytes is not None:
        return max(0, snapshot.oom_tried_bytes - (snapshot.oom_device_free_bytes or 0))
    return None


def _techniques() -> list[Technique]:
    return ordered(cls() for cls in REGISTRY.values())


def evidence_fixes(message: OomMessage | None, snapshot: SnapshotSummary | None) -> list[Fix]:
    """What each technique predicts from the message or the snapshot alone (`Technique.oom_fix`)."""
    found = (technique.oom_fix(message, snapshot) for technique in _techniques())
    return [Fix(*fix) for fix in found if fix is not None]


def message_fixes(message: OomMessage) -> list[Fix]:
    fixes = evidence_fixes(message, None)
    others = sum(message.other_processes.values())
    if others:
        fixes.append(Fix(OTHER_PROCESSES, others, "message: " + ", ".join(message.other_processes),
                         "they hold the GPU too (nvidia-smi lists them)"))
    return fixes


def workload_fixes(workload: ResolvedWorkload, base: MemoryEstimate, gpu: GPU | None) -> list[Fix]:
    """Each configuration the techniques offer (`Technique.oom_fixes`), on the user's workload: memfit's estimate
    of it with the technique against `base`, the estimate without (analytic where it models the model, else
    traced)."""
    present = {t.name for t in all_techniques(workload)}
    fixes = []
    for spec in (spec for cls in _techniques() for spec in cls.oom_fixes):
        technique = parse_technique(spec)
        if technique.name in present:
            continue
        try:
            changed = estimate(with_technique(workload, technique), method=base.method, gpu=gpu)
        except MemfitError:   # does not apply to this workload (its rules, its model)
            continue
        saved = device_bytes(base) - device_bytes(changed)
        if saved > 0:
            fixes.append(Fix(spec, saved, f"{base.method} estimate ({technique.risk})", f"-t {spec}"))
    return fixes


def device_bytes(estimate_: MemoryEstimate) -> int:
    return estimate_.peak_bytes + estimate_.overhead_bytes


@dataclass
class Analysis:
    """The fixes, and what decides whether each is enough: with the workload, memfit's prediction of the whole
    step (`step_bytes` against `available_bytes`: the device less other processes); without, the bytes the
    failed allocation lacked (`shortfall_bytes`)."""

    message: OomMessage | None
    snapshot: SnapshotSummary | None
    fixes: list[Fix]
    shortfall_bytes: int | None
    step_bytes: int | None = None
    available_bytes: int | None = None
    others_bytes: int = 0

    def enough(self, fix: Fix) -> bool | None:
        if self.step_bytes is None or self.available_bytes is None:
            return fix.closes(self.shortfall_bytes)
        freed = self.others_bytes if fix.fix == OTHER_PROCESSES else 0
        return self.step_bytes - fix.saved_bytes <= self.available_bytes + freed


def analyze(message: OomMessage | None, snapshot: SnapshotSummary | None, workload: ResolvedWorkload | None,
            gpu: GPU | None) -> Analysis:
    fixes = []
    if message is not None:
        fixes += message_fixes(message)
    analysis = Analysis(message, snapshot, fixes, shortfall_of(message, snapshot))
    if workload is not None:
        base = estimate(workload, method="analytic" if workload.source.is_hf else "traced", gpu=gpu)
        fixes += workload_fixes(workload, base, gpu)
        # the device as the message reports it, else as the catalog knows the --gpu
        capacity = message.total_bytes if message is not None and message.total_bytes else (
            gpu.memory_bytes if gpu else None)
        analysis.others_bytes = sum(message.other_processes.values()) if message is not None else 0
        analysis.step_bytes = device_bytes(base)
        analysis.available_bytes = None if capacity is None else max(0, capacity - analysis.others_bytes)
    elif snapshot is not None:
        fixes += evidence_fixes(None, snapshot)
    best: dict[str, Fix] = {}
    for fix in fixes:   # one row per fix: what the run reported beats a model of it
        best.setdefault(fix.fix, fix)
    analysis.fixes = sorted(best.values(), key=lambda f: (-f.saved_bytes, f.fix))   # ties: by name
    return analysis


def to_json(analysis: Analysis) -> dict:
    message, snapshot, shortfall = analysis.message, analysis.snapshot, analysis.shortfall_bytes
    return {"schema": SCHEMA, "shortfall_bytes": shortfall, "step_bytes": analysis.step_bytes,
            "available_bytes": analysis.available_bytes,
            "message": None if message is None else asdict(message) | {
                "non_pytorch_bytes": message.non_pytorch_bytes, "reserved_bytes": message.reserved_bytes},
            "snapshot": None if snapshot is None else asdict(snapshot) | {
                "fragmentation_bytes": snapshot.fragmentation_bytes},
            "fixes": [asdict(f) | {"closes_shortfall": f.closes(shortfall), "enough": analysis.enough(f)}
                      for f in analysis.fixes]}


def print_report(analysis: Analysis, console: Console) -> None:
    message, snapshot, fixes, shortfall = analysis.message, analysis.snapshot, analysis.fixes, analysis.shortfall_bytes
    if message is not None:
        table = Table(title=f"{message.device} when the allocation failed (from the OOM message)", title_justify="left")
        table.add_column("")
        table.add_column("bytes", justify="right")
        rows = [("tried to allocate", message.tried_bytes), ("total capacity", message.total_bytes),
                ("free", message.free_bytes), ("allocated by PyTorch (tensors)", message.allocated_bytes),
                ("reserved by PyTorch, unallocated", message.reserved_unallocated_bytes),
                ("this process outside PyTorch (context, workspaces)", message.non_pytorch_bytes),
                *((f"other: {name}", value) for name, value in message.other_processes.items()),
                ("short by (tried − free)", message.shortfall_bytes)]
        for name, value in rows:
            if value is not None:
                table.add_row(name, format_bytes(value))
        console.print(table)
    if snapshot is not None:
        table = Table(title=f"live memory at {snapshot.moment} (snapshot; categories from "
                            f"{snapshot.categories_source})", title_justify="left")
        table.add_column("category")
        table.add_column("bytes", justify="right")
        for name, value in snapshot.by_category.items():
            table.add_row(name, format_bytes(value))
        table.add_section()
        table.add_row("reserved (segments)", format_bytes(snapshot.reserved_bytes))
        table.add_row("active blocks", format_bytes(snapshot.allocated_bytes))
        table.add_row("largest free block", format_bytes(snapshot.largest_free_block_bytes))
        console.print(table)
    if analysis.step_bytes is not None and analysis.available_bytes is not None:
        judged = (f"enough = the whole step fits: it needs {format_bytes(analysis.step_bytes)} (predicted), "
                  f"{format_bytes(analysis.available_bytes)} is there")
    else:
        judged = f"enough = covers the {format_bytes(shortfall)} the allocation lacked" if shortfall else ""
    table = Table(title="fixes, by predicted saving" + (f" ({judged})" if judged else ""), title_justify="left")
    for column in ("#", "fix", "saves", "enough?", "prediction from"):
        table.add_column(column, justify="right" if column in ("#", "saves") else "left",
                         no_wrap=column != "prediction from")
    for index, fix in enumerate(fixes):
        enough = analysis.enough(fix)
        table.add_row(str(index + 1), fix.fix, format_bytes(fix.saved_bytes),
                      "" if enough is None else "yes" if enough else "no", fix.basis)
    console.print(table)
    for index, fix in enumerate(fixes):   # whole lines, never cut: what to paste
        console.print(f"{index + 1}. {fix.fix}: {fix.how}", soft_wrap=True, markup=False, highlight=False)
    if not fixes:
        console.print("No fix could be predicted from this input alone: pass the workload (--model ...) or a "
                      "memory snapshot.")
    console.print("[dim]For a combination that fits, run `memfit plan MODEL --gpu GPU ...`.[/dim]")
