"""Run a workload's steps on an already-built model: a warm-up step, then the step that counts.

Training is measured in steady state: the second of two identical steps, when the optimizer state
exists. `before_measured_step` lets a tracker or profiler start exactly there.
"""
from __future__ import annotations

import gc
from collections.abc import Callable

from torch import nn

from memfit.specs.workload import Workload
from memfit.steps.hooks import StepHooks
from memfit.steps.inference import run_inference
from memfit.steps.train import TrainLoop


def run_workload(model: nn.Module, batch, workload: Workload, *, device_type: str, hooks: StepHooks,
                 before_measured_step: Callable[[], None], trace_safe: bool = False,
                 foreach: bool | None = None, autocast: Callable | None = None) -> None:
    from memfit.techniques.compose import prepare_step  # techniques build on the steps package

    setup = prepare_step(model, workload, device_type=device_type, foreach=foreach, autocast=autocast)
    hooks.mark("parameters", list(setup.model.parameters()))   # sharding replaces them with their shards
    if workload.task == "train":
        model.train()
        loop = TrainLoop(setup, hooks=hooks, trace_safe=trace_safe)
        loop.step(batch)
        gc.collect()
        before_measured_step()
        loop.step(batch)
        return
    model.eval()
    gc.collect()
    if setup.batch_transform is not None:
        batch = setup.batch_transform(batch)
    before_measured_step()
    run_inference(model, batch, head=workload.source.head, new_tokens=workload.new_tokens, hooks=hooks,
                  autocast=setup.autocast())
