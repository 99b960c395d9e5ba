"""An optimizer that steps on float32 master copies of the trainable parameters, for weights kept in half
precision: on the device (`--precision bf16-master`, as Megatron-LM and DeepSpeed train in bf16) or in host
RAM (cpu-offload's HostOffloadOptimizer, a subclass).

Each gradient autograd completes is added into its master's float32 gradient at once (a post-accumulate-grad
hook: micro-batches accumulate in float32) and freed; the step updates the masters and copies them back into the
parameters. Memory per trainable parameter, beside the half weight: 4 bytes of master, 4 of float32 gradient and
the optimizer's states over the masters (AdamW: 8), one half gradient at a time.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable

import torch

from memfit.core.errors import MemfitError
from memfit.steps.host import note_category
from memfit.steps.setup import over_copies


class MasterWeightsOptimizer:
    """`build(masters)` makes the real optimizer over the masters (in the trainable parameters' order). Used like
    any optimizer: `step()`, `zero_grad()`, `param_groups` and `state` (the inner optimizer's)."""

    def __init__(self, params, build: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [self._master(p).requires_grad_() for p in self.params]
        self.grads = [torch.zeros_like(m) for m in self.masters]
        self._note(self.masters, self.grads)
        self._empty = [True] * len(self.params)    # no gradient arrived for it since zero_grad
        self.inner = build(self.masters)
        owner = weakref.ref(self)   # a hook holding the optimizer would keep its masters alive for ever
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(functools.partial(_receive_gradient, owner, index))

    # where the masters live: the parameters' device (here) or the host (offload.HostOffloadOptimizer)
    def _master(self, param: torch.Tensor) -> torch.Tensor:
        return param.detach().to(torch.float32, copy=True)

    def _note(self, masters: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        note_category(masters, "optimizer_states")   # the optimizer's own copy, as ZeRO counts it
        note_category(grads, "gradients")

    def _arrived(self, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def _region(self):
        return contextlib.nullcontext()

    def _copy_back(self, param: torch.Tensor, master: torch.Tensor) -> None:
        param.copy_(master)                     # cast into the parameter's dtype in place (one kernel)

    def _receive(self, index: int, param: torch.Tensor) -> None:
        assert param.grad is not None   # a post-accumulate-grad hook: the gradient has just been accumulated
        arrived = self._arrived(param.grad)
        if self._empty[index]:
            self.grads[index].copy_(arrived)
        else:                                   # gradient accumulation: later micro-batches add in float32
            self.grads[index].add_(arrived)
        self._empty[index] = False
        del arrived
        param.grad = None                       # the half gradient is freed as soon as it is added

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self, closure=None):
        if closure is not None:
            raise MemfitError(f"{type(self).__name__} takes no closure.")
        for master, grad, empty in zip(self.masters, self.grads, self._empty):
            master.grad = None if empty else grad
        with self._region():
            self.inner.step()
            with torch.no_grad():
                for param, master in zip(self.params, self.masters):
                    self._copy_back(param, master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._empty = [True] * len(self.params)
        for param in self.params:
            param.grad = None


def _receive_gradient(owner: weakref.ref, index: int, param: torch.Tensor) -> None:
    optimizer = owner()
    if optimizer is not None:
        optimizer._receive(index, param)


def over_masters(params, build: Callable[[list], torch.optim.Optimizer]) -> MasterWeightsOptimizer:
    """A MasterWeightsOptimizer over `params` (parameters, or groups of them) whose inner optimizer, built by
    `build`, keeps their groups and settings (a StepSetup's optimizer_wrapper)."""
    params = list(params)
    flat = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
    trainable = [p for p in flat if p.requires_grad]
    return MasterWeightsOptimizer(trainable, lambda masters: build(over_copies(params, trainable, masters)))
