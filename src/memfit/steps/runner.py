"""Run a workload's steps on an already-built model: a warm-up step, then the step that counts.

Training is measured in steady state: the second of two identical steps, when the optimizer state
exists. `before_measured_step` lets a tracker or profiler start exactly there.
"""
from __future__ import annotations

import gc
from collections.abc import Callable

from memfit.specs.workload import Workload
from memfit.steps.deepspeed_loop import DeepSpeedLoop  # DeepSpeed itself loads when a loop is built
from memfit.steps.hooks import StepHooks
from memfit.steps.inference import run_inference
from memfit.steps.setup import StepSetup
from memfit.steps.train import TrainLoop
from memfit.steps.user_step import run_user_step


def train_loop(setup: StepSetup, workload: Workload, *, hooks: StepHooks | None = None, trace_safe: bool = False):
    """The workload's training loop: PyTorch's (TrainLoop) or DeepSpeed's engine, which casts and shards
    the weights itself."""
    if workload.engine == "deepspeed":
        return DeepSpeedLoop(setup, workload, hooks=hooks)
    return TrainLoop(setup, hooks=hooks, trace_safe=trace_safe)


def run_workload(setup: StepSetup, batch, workload: Workload, *, head: str, hooks: StepHooks,
                 before_measured_step: Callable[[], None], trace_safe: bool = False) -> None:
    """The workload's step on `setup` (its techniques applied: techniques.compose.prepare_step); `head` is the
    model's (what inference generates with)."""
    model = setup.model
    if workload.step is not None:
        run_user_step(setup, batch, workload, hooks=hooks, before_measured_step=before_measured_step)
        return
    if workload.task == "train":
        model.train()
        loop = train_loop(setup, workload, hooks=hooks, trace_safe=trace_safe)
        hooks.mark("parameters", loop.parameter_tensors())   # sharding replaces them with their shards
        loop.step(batch)
        gc.collect()
        before_measured_step()
        loop.step(batch)
        return
    hooks.mark("parameters", list(model.parameters()))
    model.eval()
    gc.collect()
    if setup.batch_transform is not None:
        batch = setup.batch_transform(batch)
    before_measured_step()
    run_inference(model, batch, head=head, new_tokens=workload.new_tokens, hooks=hooks, autocast=setup.autocast())
