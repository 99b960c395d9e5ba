"""Optimizers memfit runs, built the way users build them (torch.optim, default hyper-parameters)."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from memfit.core.errors import MemfitError


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, *, foreach: bool | None = None) -> torch.optim.Optimizer:
    """`foreach=None` keeps PyTorch's default for the device (per-tensor on CPU, foreach on CUDA)."""
    params = [p for p in params if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2, foreach=foreach)
    raise MemfitError(f"unknown optimizer {name!r}.")


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
