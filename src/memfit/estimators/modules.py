"""Per-module memory: weights, gradients and optimizer state by parameter ownership, activations by
the module whose forward created them. Layers of a repeated stack collapse into one
row (`model.layers.*`) with per-layer figures and a count."""
from __future__ import annotations

from typing import cast

from torch import nn

from memfit.estimators.breakdown import ModuleMemory
from memfit.estimators.tracker import Trace


def _rows_of(model: nn.Module, stacks: list[nn.ModuleList]) -> list[tuple[str, list[str], int]]:
    """(row name, module-name prefixes it covers, layer count) for the row layout of this model."""
    names = {id(m): n for n, m in model.named_modules()}
    stack_ids = {id(s) for s in stacks}
    holders = {id(m) for m in model.modules() if any(id(s) in stack_ids for s in m.modules())}
    rows = []

    def visit(module: nn.Module) -> None:
        name = names[id(module)]
        if id(module) in stack_ids:
            stack = cast(nn.ModuleList, module)   # one of `stacks`
            prefixes = [f"{name}.{i}" for i in range(len(stack))]
            rows.append((f"{name}.*", prefixes, len(stack)))
        elif id(module) in holders:
            for child in module.children():
                visit(child)
        elif name:
            rows.append((name, [name], 1))

    visit(model)
    return rows


def _under(name: str | None, prefixes: list[str]) -> bool:
    return name is not None and any(name == p or name.startswith(p + ".") for p in prefixes)


def module_rows(trace: Trace, model: nn.Module, stacks: list[nn.ModuleList], full_layers: int | None,
                top: int = 15) -> list[ModuleMemory]:
    """Model states by owning module at the step's peak; activations at their own peak (the end of the
    forward in training), where they tell which modules to checkpoint."""
    peak, _, _ = trace.summary()
    alive = trace.alive_at(peak.event)
    activation_event = max(trace.walk(), key=lambda point: point[1]["activations"])[0]
    alive_activations = trace.alive_at(activation_event)
    totals = {c: sum(s.nbytes for s in alive if trace.category_of(s) == c) for c in ("gradients", "optimizer_states")}
    param_bytes = {n: p.untyped_storage().nbytes() for n, p in model.named_parameters()}
    all_params = sum(param_bytes.values()) or 1
    rows = []
    for name, prefixes, count in _rows_of(model, stacks):
        params = sum(b for n, b in param_bytes.items() if _under(n.rsplit(".", 1)[0], prefixes))
        acts = sum(s.nbytes for s in alive_activations
                   if trace.category_of(s) == "activations" and _under(s.module, prefixes))
        share = params / all_params
        row = ModuleMemory(name=name, parameters=params, activations=acts,
                           gradients=int(totals["gradients"] * share),
                           optimizer_states=int(totals["optimizer_states"] * share), count=count)
        if count > 1:  # per-layer figures; the row stands for `full_layers` layers
            row = ModuleMemory(name=name, parameters=row.parameters // count, gradients=row.gradients // count,
                               optimizer_states=row.optimizer_states // count,
                               activations=row.activations // count, count=full_layers or count)
        rows.append(row)
    rows.sort(key=lambda r: r.total * r.count, reverse=True)
    return rows[:top]
