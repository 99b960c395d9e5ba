"""Optimizers memfit runs, built the way users build them (torch.optim, default hyper-parameters)."""
from __future__ import annotations

import importlib
import os
from collections.abc import Iterable

import torch

from memfit.core.errors import MemfitError

DEFAULT_LR = {"adamw": 1e-4, "adam": 1e-4, "sgd": 1e-3, "adafactor": 1e-2, "adamw8bit": 1e-4, "adamw4bit": 1e-4}


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, *, foreach: bool | None = None,
                   lr: float | None = None, shard: bool = False) -> torch.optim.Optimizer:
    """`foreach=None` keeps PyTorch's default for the device (per-tensor on CPU, foreach on CUDA).
    `shard`: ZeRO-1 over the process group (torch.distributed.optim.ZeroRedundancyOptimizer): each rank
    keeps the states of its share of the parameters, steps them and broadcasts them to the others."""
    params = [p for p in params if p.requires_grad]
    if name not in DEFAULT_LR:
        raise MemfitError(f"unknown optimizer {name!r}.")
    lr = DEFAULT_LR[name] if lr is None else lr
    torch_optimizers = {"adamw": (torch.optim.AdamW, {}), "adam": (torch.optim.Adam, {}),
                        "sgd": (torch.optim.SGD, {"momentum": 0.9}), "adafactor": (torch.optim.Adafactor, {})}
    if name in torch_optimizers:
        kind, settings = torch_optimizers[name]
        if shard:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(params, optimizer_class=kind, lr=lr, foreach=foreach, **settings)
        return kind(params, lr=lr, foreach=foreach, **settings)
    if shard:
        raise MemfitError(f"--zero 1 shards torch.optim optimizers; {name} keeps its own state layout.")
    if name == "adamw8bit":
        return _bitsandbytes_adamw8bit(params, lr)
    return _torchao_adamw4bit(params, lr)


def _bitsandbytes_adamw8bit(params: list, lr: float) -> torch.optim.Optimizer:
    # Imported and built outside any tracking or fake mode: the import creates constant tables and the
    # constructor computes its quantization maps from real values; neither is the step's memory.
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        bnb = _import("bitsandbytes", "adamw8bit")
        return bnb.optim.AdamW8bit(params, lr=lr)


def _torchao_adamw4bit(params: list, lr: float) -> torch.optim.Optimizer:
    from torch._subclasses.fake_tensor import is_fake

    if params and is_fake(params[0]):
        # torchao's step is compiled and reads data, which fake tensors cannot do; trace its exact state
        # layout instead (the compiled step allocates no parameter-sized temporaries).
        from memfit.estimators.optimizer_layouts import Blockwise4bitLayout

        return Blockwise4bitLayout(params, lr=lr)
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    optim = _import("torchao.optim", "adamw4bit")
    optimizer = optim.AdamW4bit(params, lr=lr)
    optimizer.step = _outside_dispatch_modes(optimizer.step)
    return optimizer


def _outside_dispatch_modes(step):
    """torch.compile will not run under a Python dispatch mode (memfit's tracker is one), so the compiled
    step runs outside them; the allocator, which `measure` reads, still sees everything it allocates."""
    from torch.utils._python_dispatch import _disable_current_modes

    def wrapped(*args, **kwargs):
        with _disable_current_modes():
            return step(*args, **kwargs)

    return wrapped


def _import(module: str, technique: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MemfitError(f"-t {technique} needs {module.split('.')[0]}: pip install 'memfit[optim]'.") from None


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor; tensor subclasses (torchao's quantized states, DTensor shards) as their inner tensors."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from memfit.steps.hooks import plain_tensors

    if isinstance(optimizer, ZeroRedundancyOptimizer):   # ZeRO-1: this rank's states are its local optimizer's
        optimizer = optimizer.optim
    return [t for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            for t in plain_tensors(v)]
