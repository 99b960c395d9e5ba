"""The peak of a step of the user's own training loop (a framework's trainer), measured while it runs.

CUDA: the caching allocator's `max_memory_allocated` over the step (and `max_memory_reserved`). CPU: the bytes the
training held when the step began (the model's parameters, buffers and gradients, the optimizer's state, the
batch: each storage once) plus the highest running sum of the CPU allocator's events over the step, from PyTorch's
profiler — the same account as `memfit measure` (measurement/run.py), without memfit's own loop.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from memfit.steps import profiler
from memfit.steps.hooks import tensors_in
from memfit.steps.optim import optimizer_state_tensors

if TYPE_CHECKING:
    from torch.profiler import profile


def training_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None, batch=None) -> list[torch.Tensor]:
    """What a training step holds before it starts: parameters, buffers, gradients, optimizer state, the batch."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        tensors += optimizer_state_tensors(optimizer)
    return tensors + (tensors_in(batch) if batch is not None else [])


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a storage viewed by several tensors counts once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


class StepPeakMeter:
    """`start(tensors alive at the step's start)` ... `stop()` -> the step's peak bytes on `device`."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self._profiler: profile | None = None
        self._baseline = 0
        self.running = False
        self.reserved_bytes: int | None = None

    def start(self, tensors: Iterable[torch.Tensor]) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._baseline = storage_bytes(tensors)
            self._profiler = profiler.start_profiler()
        self.running = True

    def stop(self) -> int:
        self.running = False
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            self.reserved_bytes = torch.cuda.max_memory_reserved(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        prof, self._profiler = self._profiler, None
        assert prof is not None   # start() began it
        profiler.stop_profiler(prof)
        return self._baseline + profiler.allocation_peak(prof)[0]
