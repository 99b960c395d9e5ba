"""Applying techniques: to a workload's step (`prepare_step`, what memfit's own runs use) or to a user's own model
and optimizer (`apply_`), in the canonical order (rules.py), after the rules have been checked.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch
from torch import nn

from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision
from memfit.steps.setup import StepSetup, precision_of_model
from memfit.techniques.base import Technique
from memfit.techniques.resolve import ResolvedWorkload
from memfit.techniques.rules import check_rules, ordered, parse_all


def prepare_step(model: nn.Module, workload: ResolvedWorkload, *, device_type: str, foreach: bool | None = None,
                 autocast: Callable | None = None) -> StepSetup:
    """The workload's step for `model` (built in the workload's precision), techniques applied in order (its
    precision and optimizer too, where they are techniques)."""
    setup = StepSetup(model=model, precision=get_precision(workload.precision), device_type=device_type,
                      optimizer_name=workload.optimizer, foreach=foreach, autocast_fn=autocast,
                      shard_optimizer=workload.zero_stage == 1)
    for technique in ordered(workload.field_techniques + list(workload.technique_configs)):
        technique.apply_(setup)
    return setup


def apply_(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
           techniques: Iterable[str | Technique] = (), *, device_type: str | None = None) -> StepSetup:
    """Apply techniques to a user's own model (in place) and return what their loop needs: `setup.optimizer`
    (rebuilt when an optimizer technique is given, with the given optimizer's learning rate; with
    cpu-offload, the given optimizer's kind and settings over host master weights — drop the old one),
    `setup.autocast()`, `setup.loss(model, batch)`, `setup.prepare_batch(batch)` — or `setup.step(batch)`.
    With lora, `setup.model` is peft's wrapper and the optimizer is rebuilt (same kind and settings) over
    the adapters."""
    configs = parse_all(techniques)
    check_rules(configs, None)
    new_optimizer = any(t.workload_field == "optimizer" for t in configs)
    if optimizer is None and not new_optimizer and any("host-optimizer" in t.traits for t in configs):
        names = ", ".join(t.name for t in configs if "host-optimizer" in t.traits)
        raise MemfitError(f"-t {names} moves the optimizer to the host: pass your optimizer to apply_.")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    setup = StepSetup(model=model, precision=precision_of_model(model), device_type=device_type or device.type,
                      optimizer=optimizer)
    for technique in configs:
        technique.apply_(setup)
    if new_optimizer:
        setup.lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None
        setup.optimizer = None
        setup.build_optimizer()
        return setup
    trainable = [p for p in setup.model.parameters() if p.requires_grad]
    if setup.host_optimizer is not None:   # the user's optimizer, rebuilt over host master weights
        setup.optimizer = setup.host_optimizer(setup.model.parameters(), _same_kind(setup.optimizer))
    elif optimizer is not None and {id(p) for p in trainable} != {
            id(p) for group in optimizer.param_groups for p in group["params"]}:   # lora froze the weights
        setup.optimizer = _same_kind(optimizer)(trainable)
    return setup


def _same_kind(optimizer: torch.optim.Optimizer) -> Callable[[list], torch.optim.Optimizer]:
    """A builder of `optimizer`'s kind with its settings (capturable dropped: CUDA graphs only)."""
    kind = type(optimizer)
    accepted = inspect.signature(kind.__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "capturable"}
    return lambda params: kind(params, **settings)
