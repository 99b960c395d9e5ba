"""StepSetup: everything a training or inference step needs after the techniques have changed it.

memfit's own runs build one with `prepare_step` (for a workload); a user's loop gets one from
`memfit.apply_(model, optimizer, techniques)` and uses `setup.autocast()`, `setup.scaler`,
`setup.optimizer`, `setup.loss(model, batch)` and `setup.micro_batches(batch)` — or just
`setup.step(batch)`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.core.precision import Precision, get_precision
from memfit.steps.train import autocast_region, call_model, loss_of

LossFn = Callable[[nn.Module, Any], torch.Tensor]
BatchSplit = Callable[[Any], list]


def model_loss(model: nn.Module, batch) -> torch.Tensor:
    return loss_of(call_model(model, batch))


def whole_batch(batch) -> list:
    return [batch]


@dataclass
class StepSetup:
    model: nn.Module
    precision: Precision
    device_type: str
    optimizer_name: str = "adamw"
    foreach: bool | None = None                      # None: PyTorch's default for the device
    autocast_fn: Callable | None = None               # replaces torch.autocast (GPU emulation in traces)
    loss: LossFn = model_loss                         # forward + loss of one micro-batch
    micro_batches: BatchSplit = whole_batch           # how one batch is run (accumulated gradients)
    batch_transform: Callable[[Any], Any] | None = None   # applied to the batch before it is split
    optimizer: torch.optim.Optimizer | None = None
    lr: float | None = None                           # None: memfit's default for the optimizer
    # cpu-offload (offload.py): "optimizer" when the optimizer steps in host RAM on master weights,
    # "fsdp2" when FSDP2 keeps its shards, gradients and optimizer states there itself
    offload: str | None = None
    shard_optimizer: bool = False     # ZeRO-1 (--zero 1 with DDP): ZeroRedundancyOptimizer
    pipeline: Any = None              # pipeline-parallel (pipeline.py): runs each step's micro-batches itself
    phase_callbacks: list[Callable[[str], None]] = field(default_factory=list)   # called as each phase starts

    def autocast(self):
        return autocast_region(self.precision, self.device_type, self.autocast_fn)

    def build_optimizer(self) -> torch.optim.Optimizer:
        from memfit.steps.optim import make_optimizer

        if self.optimizer is None:
            if self.offload == "optimizer":   # the host optimizer steps on the CPU: the CPU's kernels
                self.optimizer = self.offloaded(lambda masters: make_optimizer(masters, self.optimizer_name,
                                                                               lr=self.lr))
            else:
                self.optimizer = make_optimizer(self.model.parameters(), self.optimizer_name,
                                                foreach=self.foreach, lr=self.lr, shard=self.shard_optimizer)
        return self.optimizer

    def offloaded(self, build: Callable[[list], torch.optim.Optimizer]):
        from memfit.techniques.offload import HostOffloadOptimizer

        return HostOffloadOptimizer(self.model.parameters(), build)

    def step(self, batch):
        """One training step (forward and backward per micro-batch, optimizer step, zero_grad); the loss."""
        from memfit.steps.train import TrainLoop

        if getattr(self, "_loop", None) is None:
            self._loop = TrainLoop(self)
        return self._loop.step(batch)

    def prepare_batch(self, batch) -> list:
        if self.batch_transform is not None:
            batch = self.batch_transform(batch)
        return self.micro_batches(batch)


def precision_of_model(model: nn.Module) -> Precision:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return get_precision("bf16" if dtype == torch.bfloat16 else "fp32")
