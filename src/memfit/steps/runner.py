"""Run a workload's steps on an already-built model: a warm-up step, then the step that counts.

Training is measured in steady state: the second of two identical steps, when the optimizer state
exists. `before_measured_step` lets a tracker or profiler start exactly there.
"""
from __future__ import annotations

import gc
from collections.abc import Callable

from torch import nn

from memfit.core.precision import get_precision
from memfit.specs.workload import Workload
from memfit.steps.hooks import StepHooks
from memfit.steps.inference import run_inference
from memfit.steps.optim import make_optimizer
from memfit.steps.train import TrainLoop, autocast_region


def run_workload(model: nn.Module, batch, workload: Workload, *, device_type: str, hooks: StepHooks,
                 before_measured_step: Callable[[], None], trace_safe: bool = False,
                 foreach: bool | None = None, autocast: Callable | None = None) -> None:
    if workload.task == "train":
        model.train()
        optimizer = make_optimizer(model.parameters(), workload.optimizer, foreach=foreach)
        loop = TrainLoop(model, optimizer, get_precision(workload.precision), device_type=device_type,
                         hooks=hooks, trace_safe=trace_safe, autocast=autocast)
        loop.step(batch)
        gc.collect()
        before_measured_step()
        loop.step(batch)
        return
    model.eval()
    gc.collect()
    region = autocast_region(get_precision(workload.precision), device_type, autocast)
    before_measured_step()
    run_inference(model, batch, head=workload.source.head, new_tokens=workload.new_tokens, hooks=hooks,
                  autocast=region)
