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
from memfit.measurement.oom import OomMessage, SnapshotSummary
from memfit.specs.hardware import GPU
from memfit.techniques import REGISTRY
from memfit.techniques.base import Technique, parse_technique
from memfit.techniques.resolve import ResolvedWorkload, all_techniques, with_technique
from memfit.techniques.rules import ordered

SCHEMA = "memfit.oom/1"


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
        fixes.append(Fix("stop other processes", others, "message: " + ", ".join(message.other_processes),
                         "they hold the GPU too (nvidia-smi lists them)"))
    return fixes


def workload_fixes(workload: ResolvedWorkload, gpu: GPU | None) -> list[Fix]:
    """Each configuration the techniques offer (`Technique.oom_fixes`), on the user's workload: memfit's estimate
    of it without and with the technique (analytic where it models the model, else traced)."""
    method = "analytic" if workload.source.is_hf else "traced"
    base = estimate(workload, method=method, gpu=gpu)
    present = {t.name for t in all_techniques(workload)}
    fixes = []
    for spec in (spec for cls in _techniques() for spec in cls.oom_fixes):
        technique = parse_technique(spec)
        if technique.name in present:
            continue
        try:
            changed = estimate(with_technique(workload, technique), method=method, gpu=gpu)
        except MemfitError:   # does not apply to this workload (its rules, its model)
            continue
        saved = (base.peak_bytes + base.overhead_bytes) - (changed.peak_bytes + changed.overhead_bytes)
        if saved > 0:
            fixes.append(Fix(spec, saved, f"{method} estimate ({technique.risk})", f"-t {spec}"))
    return fixes


def ranked_fixes(message: OomMessage | None, snapshot: SnapshotSummary | None, workload: ResolvedWorkload | None,
                 gpu: GPU | None) -> list[Fix]:
    fixes = []
    if message is not None:
        fixes += message_fixes(message)
    if workload is not None:
        fixes += workload_fixes(workload, gpu)
    elif snapshot is not None:
        fixes += evidence_fixes(None, snapshot)
    best: dict[str, Fix] = {}
    for fix in fixes:   # one row per fix: what the run reported beats a model of it
        best.setdefault(fix.fix, fix)
    return sorted(best.values(), key=lambda f: (-f.saved_bytes, f.fix))   # ties: by name, not by registry order


def to_json(message, snapshot, fixes: list[Fix]) -> dict:
    shortfall = shortfall_of(message, snapshot)
    return {"schema": SCHEMA, "shortfall_bytes": shortfall,
            "message": None if message is None else asdict(message) | {
                "non_pytorch_bytes": message.non_pytorch_bytes, "reserved_bytes": message.reserved_bytes},
            "snapshot": None if snapshot is None else asdict(snapshot) | {
                "fragmentation_bytes": snapshot.fragmentation_bytes},
            "fixes": [asdict(f) | {"closes_shortfall": f.closes(shortfall)} for f in fixes]}


def print_report(message, snapshot, fixes: list[Fix], console: Console | None = None) -> None:
    console = console or Console()
    shortfall = shortfall_of(message, snapshot)
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
    table = Table(title="fixes, by predicted saving" + (f" (short by {format_bytes(shortfall)})" if shortfall else ""),
                  title_justify="left")
    for column in ("fix", "saves", "enough?", "how", "prediction from"):
        table.add_column(column, justify="right" if column == "saves" else "left")
    for fix in fixes:
        closes = fix.closes(shortfall)
        table.add_row(fix.fix, format_bytes(fix.saved_bytes), "" if closes is None else "yes" if closes else "no",
                      fix.how, fix.basis)
    console.print(table)
    if not fixes:
        console.print("No fix could be predicted from this input alone: pass the workload (--model ...) or a "
                      "memory snapshot.")
    console.print("[dim]For a combination that fits, run `memfit plan MODEL --gpu GPU ...`.[/dim]")
