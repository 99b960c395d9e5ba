"""Optimizers memfit runs, built the way users build them (torch.optim, default hyper-parameters).

The optimizers with their own state layouts (8-bit and 4-bit AdamW, Adafactor) are techniques: each one's
module builds it (techniques/optimizer_states.py) and hands its builder to the step (StepSetup).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from memfit.core.errors import MemfitError
from memfit.specs.workload import OPTIMIZER_IMPLS
from memfit.steps.hooks import plain_tensors

# name -> (torch.optim class, its default learning rate here, settings)
_TORCH = {"adamw": (torch.optim.AdamW, 1e-4, {}), "adam": (torch.optim.Adam, 1e-4, {}),
          "sgd": (torch.optim.SGD, 1e-3, {"momentum": 0.9})}
TORCH_OPTIMIZERS = tuple(_TORCH)
# How torch.optim runs a step (`--optimizer-impl`, specs/workload.py OPTIMIZER_IMPLS): one kernel over all
# tensors of a group (foreach: CUDA's default), one fused kernel per group (fused), or tensor by tensor (for-loop:
# the CPU's default). Adam, AdamW and SGD have all three, on CUDA and on the CPU.
TORCH_OPTIMIZER_IMPLS = OPTIMIZER_IMPLS
_IMPL_SETTINGS = {None: {}, "foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, *, impl: str | None = None,
                   lr: float | None = None, shard: bool = False) -> torch.optim.Optimizer:
    """torch.optim's `name` over the trainable `params` (TORCH_OPTIMIZERS)."""
    if name not in _TORCH:
        raise MemfitError(f"unknown optimizer {name!r}; torch.optim's here are {', '.join(TORCH_OPTIMIZERS)}.")
    kind, default_lr, settings = _TORCH[name]
    return torch_optimizer(kind, params, lr=default_lr if lr is None else lr, impl=impl, shard=shard, **settings)


def torch_optimizer_name(optimizer: torch.optim.Optimizer) -> str | None:
    """memfit's name for a torch.optim instance it models with the same state (TORCH_OPTIMIZERS), else None."""
    for name, (kind, _, settings) in _TORCH.items():
        if type(optimizer) is kind and all(bool(optimizer.defaults.get(k)) == bool(v) for k, v in settings.items()):
            return name
    return None


def impl_of(optimizer: torch.optim.Optimizer) -> str | None:
    """The --optimizer-impl an instance was built with (None: PyTorch's default for the device)."""
    defaults: Any = getattr(optimizer, "defaults", {})
    return "fused" if defaults.get("fused") else {True: "foreach", False: "for-loop"}.get(defaults.get("foreach"))


def device_default_impl(on_cuda: bool) -> str:
    """PyTorch's choice when none is given (torch/optim/optimizer.py `_default_to_fused_or_foreach`): foreach
    when every tensor is on CUDA, else the for-loop; never fused."""
    return "foreach" if on_cuda else "for-loop"


def trainable(params) -> list:
    """The trainable parameters of `params`, or of each parameter group when `params` are groups (dicts; a group
    left empty stays, so that an LR scheduler's per-group settings still line up)."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in params]
    return [p for p in params if p.requires_grad]


def default_lr(name: str) -> float:
    return _TORCH[name][1]


def torch_optimizer(kind: type[torch.optim.Optimizer], params: Iterable[torch.nn.Parameter], *, lr: float,
                    impl: str | None = None, shard: bool = False, **settings) -> torch.optim.Optimizer:
    """`kind` over the trainable `params`, run by `impl` (OPTIMIZER_IMPLS; None keeps PyTorch's default for the
    device). `shard`: ZeRO-1 over the process group (torch.distributed.optim.ZeroRedundancyOptimizer): each
    rank keeps the states of its share of the parameters, steps them and broadcasts them to the others."""
    params = trainable(params)
    settings = {**settings, **_IMPL_SETTINGS[impl]}
    if shard:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=kind, lr=lr, **settings)
    # every torch.optim class takes lr (the base class's __init__ does not: it takes `defaults`)
    return cast("Callable[..., torch.optim.Optimizer]", kind)(params, lr=lr, **settings)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor; tensor subclasses (torchao's quantized states, DTensor shards) as their inner tensors."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):   # ZeRO-1: this rank's states are its local optimizer's
        optimizer = optimizer.optim
    return [t for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            for t in plain_tensors(v)]
