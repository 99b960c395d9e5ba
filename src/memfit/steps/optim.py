"""Optimizers memfit runs, built the way users build them (torch.optim, default hyper-parameters).

The optimizers with their own state layouts (8-bit and 4-bit AdamW, Adafactor) are techniques: each one's
module builds it (techniques/optimizer_states.py) and hands its builder to the step (StepSetup).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from memfit.core.errors import MemfitError
from memfit.steps.hooks import plain_tensors

# name -> (torch.optim class, its default learning rate here, settings)
_TORCH = {"adamw": (torch.optim.AdamW, 1e-4, {}), "adam": (torch.optim.Adam, 1e-4, {}),
          "sgd": (torch.optim.SGD, 1e-3, {"momentum": 0.9})}
TORCH_OPTIMIZERS = tuple(_TORCH)


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, *, foreach: bool | None = None,
                   lr: float | None = None, shard: bool = False) -> torch.optim.Optimizer:
    """torch.optim's `name` over the trainable `params` (TORCH_OPTIMIZERS)."""
    if name not in _TORCH:
        raise MemfitError(f"unknown optimizer {name!r}; torch.optim's here are {', '.join(TORCH_OPTIMIZERS)}.")
    kind, default_lr, settings = _TORCH[name]
    return torch_optimizer(kind, params, lr=default_lr if lr is None else lr, foreach=foreach, shard=shard,
                           **settings)


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
                    foreach: bool | None = None, shard: bool = False, **settings) -> torch.optim.Optimizer:
    """`kind` over the trainable `params`. `foreach=None` keeps PyTorch's default for the device (per-tensor on
    CPU, foreach on CUDA). `shard`: ZeRO-1 over the process group (torch.distributed.optim.
    ZeroRedundancyOptimizer): each rank keeps the states of its share of the parameters, steps them and
    broadcasts them to the others."""
    params = trainable(params)
    if shard:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=kind, lr=lr, foreach=foreach, **settings)
    return kind(params, lr=lr, foreach=foreach, **settings)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor; tensor subclasses (torchao's quantized states, DTensor shards) as their inner tensors."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):   # ZeRO-1: this rank's states are its local optimizer's
        optimizer = optimizer.optim
    return [t for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            for t in plain_tensors(v)]
