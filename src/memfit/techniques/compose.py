"""Applying techniques: to a workload's step (`prepare_step`, what memfit's own runs use) or to a user's own model
and optimizer (`apply_`), in the canonical order (rules.py), after the rules have been checked.
"""
from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Iterable

import torch
from torch import nn

from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision, precision_of_model
from memfit.steps.setup import StepSetup, over_host_copies
from memfit.techniques.base import Technique
from memfit.techniques.resolve import ResolvedWorkload
from memfit.techniques.rules import check_rules, ordered, parse_all


def prepare_step(model: nn.Module, workload: ResolvedWorkload, *, device_type: str,
                 default_impl: str | None = None, autocast: Callable | None = None) -> StepSetup:
    """The workload's step for `model` (built in the workload's precision), techniques applied in order (its
    precision and optimizer too, where they are techniques). `default_impl`: the optimizer's implementation
    where the workload names none (None: PyTorch's default on this device)."""
    setup = StepSetup(model=model, precision=get_precision(workload.precision), device_type=device_type,
                      optimizer_name=workload.optimizer,
                      optimizer_impl=workload.required_optimizer_impl or default_impl,
                      autocast_fn=autocast, shard_optimizer=workload.zero_stage == 1)
    decide_layout(setup, workload.technique_configs, workload.world_size)
    for technique in ordered(workload.hooked_techniques):
        technique.apply_(setup)
    return setup


def apply_(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
           techniques: Iterable[str | Technique] = (), *, device_type: str | None = None,
           scheduler=None) -> StepSetup:
    """Apply techniques to a user's own model (in place) and return what their loop needs: `setup.optimizer`,
    `setup.autocast()`, `setup.loss(model, batch)`, `setup.prepare_batch(batch)` — or `setup.step(batch)`.

    `setup.optimizer` is rebuilt when a technique needs another one (drop the old one): an optimizer technique
    builds its kind; cpu-offload rebuilds the given kind over host master weights; lora rebuilds it over the
    adapters (`setup.model` is then peft's wrapper). The rebuilt optimizer keeps the given parameter groups and
    their settings (another kind takes each group's learning rate and weight decay); an adapter joins the group
    of the weight it adapts. Given `scheduler` (an LR scheduler of `optimizer`), `setup.scheduler` is the same
    schedule, its state included, driving the rebuilt optimizer."""
    configs = parse_all(techniques)
    check_rules(configs, None)
    new_optimizer = any(t.workload_field == "optimizer" for t in configs)
    rebuilds = [t.name for t in configs if t.traits & {"host-optimizer", "steps-in-backward", "float32-masters"}]
    if optimizer is None and not new_optimizer and rebuilds:
        raise MemfitError(f"-t {', '.join(rebuilds)} rebuilds your optimizer (on the host, over float32 masters, or "
                          "one per parameter stepped in backward): pass your optimizer to apply_.")
    if scheduler is not None and (optimizer is None or getattr(scheduler, "optimizer", None) is not optimizer):
        raise MemfitError("apply_(scheduler=...) takes the LR scheduler of the optimizer you pass with it.")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    setup = StepSetup(model=model, precision=precision_of_model(model), device_type=device_type or device.type,
                      optimizer=optimizer)
    decide_layout(setup, configs, _world_size())
    for technique in configs:
        technique.apply_(setup)
    trainable = [p for p in setup.model.parameters() if p.requires_grad]
    groups = _groups_over(optimizer, trainable, setup.model) if optimizer is not None else None
    if new_optimizer:
        setup.param_groups = [{k: v for k, v in g.items() if k in PORTABLE_SETTINGS} for g in groups or ()] or None
        setup.optimizer = None
        setup.build_optimizer()
    elif setup.host_optimizer is not None:   # the user's optimizer, rebuilt over host master weights
        assert optimizer is not None and groups is not None   # given: refused above when it is not
        same = _same_kind(optimizer)
        setup.optimizer = setup.host_optimizer(setup.model.parameters(),
                                               lambda masters: same(over_host_copies(groups, setup.model, masters)))
    elif setup.optimizer_wrapper is not None:   # the user's optimizer: stepped in backward, or over float32 masters
        assert optimizer is not None   # given: refused above when it is not
        setup.optimizer = setup.optimizer_wrapper(groups, _same_kind(optimizer))
    elif optimizer is not None and {id(p) for p in trainable} != {
            id(p) for group in optimizer.param_groups for p in group["params"]}:   # lora froze the weights
        assert groups is not None   # built when an optimizer is given
        setup.optimizer = _same_kind(optimizer)(groups)
    if scheduler is not None:
        setup.scheduler = scheduler if setup.optimizer is optimizer else _rebound(scheduler, setup.optimizer)
    return setup


def decide_layout(setup: StepSetup, techniques: Iterable[Technique], world_size: int) -> None:
    """What techniques share, decided once before any of them applies (steps/setup.py): the device mesh's axes
    (the technique that splits blocks or stages over part of the ranks declares them; the rules allow one), and
    whether the sharding layout keeps offloaded states itself (offload asked for beside a layout that does)."""
    techniques = list(techniques)
    setup.mesh_axes = next((axes for t in techniques if (axes := t.mesh_axes(world_size))), ())
    traits = set().union(*(t.traits for t in techniques))
    setup.layout_offloads = {"host-optimizer", "offloads-shards"} <= traits


def _world_size() -> int:
    """The ranks of the process group a user's loop runs in (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# what a parameter group's settings mean to any optimizer (another kind has its own betas, eps, ...)
PORTABLE_SETTINGS = ("params", "lr", "weight_decay", "initial_lr")


def _groups_over(optimizer: torch.optim.Optimizer, params: list, model: nn.Module) -> list[dict]:
    """`optimizer`'s parameter groups, with their settings, over `params`: each in the group it was in; a new
    parameter (an adapter) in the group of the weight its module adapts (peft's `base_layer`), else the first.
    Every group stays, empty or not, so that a scheduler's per-group settings still line up."""
    group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
    for module in model.modules():
        base = getattr(getattr(module, "base_layer", None), "weight", None)
        if base is not None and id(base) in group_of:
            for p in module.parameters():
                group_of.setdefault(id(p), group_of[id(base)])
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": []}
              for group in optimizer.param_groups]
    for p in params:
        groups[group_of.get(id(p), 0)]["params"].append(p)
    return groups


def _same_kind(optimizer: torch.optim.Optimizer) -> Callable[[list], torch.optim.Optimizer]:
    """A builder of `optimizer`'s kind with its settings (capturable dropped: CUDA graphs only)."""
    kind = type(optimizer)
    accepted = inspect.signature(kind.__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "capturable"}
    return lambda params: kind(params, **settings)


def _rebound(scheduler, optimizer):
    """`scheduler` (its schedule and state: epoch, base and last learning rates) driving `optimizer`, whose groups
    take the scheduler's current learning rates. The step is wrapped as an LR scheduler's constructor wraps it,
    so that PyTorch's check that optimizer.step() runs before scheduler.step() keeps working."""
    old_groups = scheduler.optimizer.param_groups
    if len(old_groups) != len(optimizer.param_groups):
        raise MemfitError(f"the rebuilt optimizer has {len(optimizer.param_groups)} parameter groups and the "
                          f"scheduler's {len(old_groups)}; pass the scheduler's optimizer unchanged.")
    for group, old in zip(optimizer.param_groups, old_groups):
        group.update({k: old[k] for k in ("lr", "initial_lr") if k in old})
    rebound = copy.copy(scheduler)
    rebound.optimizer = optimizer
    step = optimizer.step

    @functools.wraps(step)
    def counted_step(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    counted_step._wrapped_by_lr_sched = True
    optimizer.step = counted_step
    return rebound
