"""`memfit explain-oom`: what held the memory when the allocation failed, and the fixes, ranked by what
each is predicted to save.

Predictions come from one of three places, each labelled: the OOM message itself (fragmentation, other
processes), the snapshot's categories with a published ratio (rough: 8-bit AdamW keeps 2 of 8 bytes of
state per parameter; full checkpointing keeps about 2 of Korthikanti et al.'s 34 bytes per activation
element; bf16 halves float32 weights), or — when the workload is given — memfit's analytic estimate of
the workload with and without each technique (the same numbers `memfit estimate -t` prints).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from memfit.core.errors import MemfitError
from memfit.core.units import format_bytes
from memfit.measurement.oom import OomMessage, SnapshotSummary
from memfit.specs.hardware import GPU
from memfit.specs.workload import Workload

SCHEMA = "memfit.oom/1"
CANDIDATES = ("expandable-segments", "checkpointing", "checkpointing:mode=selective", "chunked-ce", "sdpa",
              "bf16-mixed", "bf16", "adamw8bit", "cpu-offload", "checkpointing:mode=offload", "lora", "qlora",
              "int8-weight-only", "bnb-4bit", "stream-layers")
KEEP_8BIT_STATE, KEEP_CHECKPOINTED = 2 / 8, 2 / 34


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


def message_fixes(message: OomMessage) -> list[Fix]:
    fixes = []
    if message.reserved_unallocated_bytes:
        fixes.append(Fix("expandable-segments", message.reserved_unallocated_bytes, "message: reserved, unallocated",
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"))
    others = sum(message.other_processes.values())
    if others:
        fixes.append(Fix("stop other processes", others, "message: " + ", ".join(message.other_processes),
                         "they hold the GPU too (nvidia-smi lists them)"))
    return fixes


def snapshot_fixes(snapshot: SnapshotSummary) -> list[Fix]:
    by = snapshot.by_category
    basis = "snapshot × published ratio (rough)"
    fixes = []
    if by.get("optimizer_states"):
        states = by["optimizer_states"]
        fixes.append(Fix("adamw8bit", int(states * (1 - KEEP_8BIT_STATE)), basis, "-t adamw8bit"))
        fixes.append(Fix("cpu-offload", states + by.get("gradients", 0), basis, "-t cpu-offload"))
    if by.get("activations"):
        fixes.append(Fix("checkpointing", int(by["activations"] * (1 - KEEP_CHECKPOINTED)), basis,
                         "-t checkpointing"))
    if by.get("parameters"):
        fixes.append(Fix("bf16", by["parameters"] // 2, basis + "; float32 weights", "-t bf16"))
    if by.get("kv_cache"):
        fixes.append(Fix("half the context", by["kv_cache"] // 2, basis, "shorter prompts or "
                         "-t sliding-window:window=W"))
    if snapshot.fragmentation_bytes > 0:
        fixes.append(Fix("expandable-segments", snapshot.fragmentation_bytes, "snapshot: reserved − active",
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"))
    return fixes


def workload_fixes(workload: Workload, gpu: GPU | None) -> list[Fix]:
    """Each candidate technique's saving on the user's workload: memfit's analytic estimate without and with it."""
    from memfit.estimators import estimate
    from memfit.techniques.base import parse_technique
    from memfit.techniques.effects import with_technique

    method = "analytic" if workload.source.is_hf else "traced"
    base = estimate(workload, method=method, gpu=gpu)
    fixes = []
    for spec in CANDIDATES:
        technique = parse_technique(spec)
        present = technique.name in {t.name for t in workload.technique_configs} or technique.name in (
            workload.precision, workload.optimizer)
        if present:
            continue
        try:
            changed = estimate(with_technique(workload, technique), method=method, gpu=gpu)
        except MemfitError:   # does not apply to this workload (its rules, its model)
            continue
        saved = (base.peak_bytes + base.overhead_bytes) - (changed.peak_bytes + changed.overhead_bytes)
        if saved > 0:
            fixes.append(Fix(spec, saved, f"{method} estimate ({technique.risk})", f"-t {spec}"))
    return fixes


def ranked_fixes(message: OomMessage | None, snapshot: SnapshotSummary | None, workload: Workload | None,
                 gpu: GPU | None) -> list[Fix]:
    fixes = []
    if message is not None:
        fixes += message_fixes(message)
    if workload is not None:
        fixes += workload_fixes(workload, gpu)
    elif snapshot is not None:
        fixes += snapshot_fixes(snapshot)
    best: dict[str, Fix] = {}
    for fix in fixes:   # one row per fix: what the run reported beats a model of it
        best.setdefault(fix.fix, fix)
    return sorted(best.values(), key=lambda f: -f.saved_bytes)


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
