"""One training step: forward and loss, backward, optimizer step, zero_grad(set_to_none=True).

The model's outputs are dropped before backward (only the loss is kept), as HF Trainer and
torchtitan do; holding them would keep the logits alive through backward.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from memfit.core.precision import Precision
from memfit.steps.hooks import NullHooks, StepHooks
from memfit.steps.host import note_host, on_host
from memfit.steps.optim import optimizer_state_tensors

if TYPE_CHECKING:
    from memfit.steps.setup import StepSetup


def loss_of(output: Any) -> torch.Tensor:
    """`.loss` when the output has one (HF models given labels); else the mean of the first tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = _first_tensor(output)
    if first is None:
        raise TypeError("the model returned no tensor to take a loss from")
    return first.mean()


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def autocast_region(precision: Precision, device_type: str,
                    autocast: Callable[[torch.dtype], Any] | None = None):
    """The step's mixed-precision region: `autocast(dtype)` (default: torch.autocast on the device), or
    none when the precision has no autocast."""
    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    if autocast is None:
        return torch.autocast(device_type, dtype=precision.autocast_dtype)
    return autocast(precision.autocast_dtype)


def call_model(model: nn.Module, batch: dict | tuple | torch.Tensor) -> Any:
    """The model on one batch: a dict as keyword arguments, a tuple or list as positional ones, a tensor whole."""
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


def enter_phase(setup: StepSetup, hooks: StepHooks, name: str) -> None:
    """A new phase of the step: the observer hears it, then the techniques' phase callbacks."""
    hooks.phase(name)
    for callback in setup.phase_callbacks:
        callback(name)


class TrainLoop:
    """A user's training loop, step by step, as the techniques in `setup` changed it. A step runs the
    setup's micro-batches (forward, loss, backward each; gradients accumulate), then the optimizer.
    `trace_safe=True` avoids the one data-dependent branch (GradScaler's skip-on-inf check reads a
    value), which fake tensors cannot take; memory is the same."""

    def __init__(self, setup: StepSetup, *, hooks: StepHooks | None = None, trace_safe: bool = False) -> None:
        self.setup = setup
        self.model = setup.model
        self.optimizer = setup.build_optimizer()
        self.hooks = hooks or NullHooks()
        self.trace_safe = trace_safe
        self.scaler = torch.amp.GradScaler(setup.device_type) if setup.precision.loss_scaling else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.skipped_steps = 0        # fp16: steps the scaler skipped because a gradient overflowed

    def parameter_tensors(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def step(self, batch: dict | tuple) -> torch.Tensor:
        hooks, setup = self.hooks, self.setup
        micro_batches = setup.prepare_batch(batch)
        total = None
        if setup.pipeline is not None:   # the schedule runs every micro-batch's forward and backward
            self._phase("forward")
            (batch,) = micro_batches
            with setup.autocast():
                total = setup.pipeline.step(batch)
            micro_batches = []
        for micro_batch in micro_batches:
            self._phase("forward")
            with setup.autocast():
                loss = setup.loss(self.model, micro_batch)
            if len(micro_batches) > 1:
                loss = loss / len(micro_batches)
            self._phase("backward")
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
            del loss
        grads = [p.grad for p in self.params if p.grad is not None]
        hooks.mark("gradients", grads)
        host_step = setup.states_on_host   # e.g. FSDP2's CPUOffloadPolicy: gradient shards, states, step on the host
        if host_step:
            note_host(grads)
        self._phase("optimizer")
        with on_host() if host_step else contextlib.nullcontext():
            self._optimizer_step()
        states = optimizer_state_tensors(self.optimizer)
        hooks.mark("optimizer_states", states + self.scaler_state())
        if host_step:
            note_host(states)
        self.optimizer.zero_grad(set_to_none=True)
        return cast(torch.Tensor, total)   # None only when the batch split into no micro-batch

    def _phase(self, name: str) -> None:
        enter_phase(self.setup, self.hooks, name)

    def _optimizer_step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
        elif self.trace_safe:
            self.scaler.unscale_(self.optimizer)
            self.optimizer.step()
            self.scaler.update()
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale:     # the scaler backs off only after skipping a step
                self.skipped_steps += 1

    def scaler_state(self) -> list[torch.Tensor]:
        if self.scaler is None:
            return []
        return [t for t in (self.scaler._scale, self.scaler._growth_tracker) if t is not None]
