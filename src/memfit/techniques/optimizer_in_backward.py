"""The optimizer step fused into backward (`optimizer-in-backward`).

Mechanism: one optimizer per trainable parameter, stepped by the parameter's post-accumulate-grad hook
(`Tensor.register_post_accumulate_grad_hook`) the moment autograd has accumulated its gradient, which it then
frees (PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward pass"; torchtune's
`optimizer_in_bwd`). The states are the same as the optimizer's over all parameters; `step()` and `zero_grad()`
of the whole have nothing left to do.
Memory: no step holds every gradient: at most the gradients backward is still producing and one parameter's
step temporaries (foreach over one tensor: one copy; the for-loop: two; fused: none), where a normal step holds
all gradients plus the step's temporaries over all of them. Lossless: each parameter gets the same update.
It cannot accumulate gradients over micro-batches (each backward steps), nor clip or unscale them over the whole
model (fp16's GradScaler), and memfit runs it in one process only: torchtune refuses the same.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memfit.core.errors import MemfitError
from memfit.core.precision import precision_names
from memfit.steps.setup import StepSetup
from memfit.techniques.base import SNAPSHOT_RATIO, OomFix, Technique, register
from memfit.techniques.contracts import CostStep, OomMessage, OomSnapshot, PlanQuery


@register
@dataclass(frozen=True, kw_only=True)
class OptimizerInBackward(Technique):
    name = "optimizer-in-backward"
    examples = (("optimizer-in-backward", {"batch_size": 1, "seq_len": 16}),)
    risk = "lossless"
    stage = "optimizer"
    summary = "each parameter's optimizer step runs in backward as its gradient is complete, and frees it"
    traits = frozenset({"steps-in-backward", "around-blocks"})
    search_axis = "optimizer-step"
    conflicts_with = {
        "fp16-mixed": ("GradScaler unscales every gradient and checks them for overflow before any step",
                       f"use {precision_names(loss_scaling=False, master=False)} instead of {{other}}"),
        "own-backward": ("{other} accumulates gradients over its micro-batches; a step in backward cannot",
                         "drop one of them"),
        "sequence-chunks": ("{other} runs backward once per window and accumulates; a step in backward cannot",
                            "drop one of them"),
        "host-optimizer": ("{other} steps the optimizer on the host after backward", "drop one of them"),
        "layout": ("memfit runs the step in backward in one process only (its hooks would step before the "
                   "gradients are reduced across ranks)", "drop {other}, or the step in backward"),
    }
    deepspeed_conflict = ("DeepSpeed's engine steps its own optimizer after backward", "use --engine pytorch")
    oom_fixes = ("optimizer-in-backward",)

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        """Training on one GPU: each micro-batch is then a whole optimizer step (the search gives it the whole
        batch: a step in backward cannot accumulate)."""
        return [cls.name] if request.task == "train" and request.num_gpus == 1 else []

    def cost_overhead(self, step: CostStep) -> None:
        """Its steps still read every gradient, though the estimate holds one at a time: the optimizer's time
        (planner/cost.py) on those it does not hold, every weight trainable; and the host calls one optimizer's step
        per trainable parameter tensor (where a foreach step calls one for all), hidden behind the backward where the
        host issues ahead of the device (a GPU)."""
        if step.workload.with_trait("adapters"):
            return
        calls_s = step.parameter_tensors * step.cost.seconds_per_optimizer_call
        hidden_s = step.backward_share(step.work_s) if step.cost.host_overlaps else 0.0
        step.add("optimizer", max(0.0, calls_s - hidden_s))
        unheld = max(0, step.state_bytes("parameters") - step.state_bytes("gradients"))
        step.add("optimizer", step.optimizer_s(unheld, 0.0))

    def oom_fix(self, message: OomMessage | None, snapshot: OomSnapshot | None) -> OomFix | None:
        """From a snapshot: the gradients, never all held at once (the most it saves: the peak may lie before)."""
        gradients = snapshot.by_category.get("gradients") if snapshot is not None else None
        if not gradients:
            return None
        return OomFix(self.name, gradients, SNAPSHOT_RATIO + "; at most", f"-t {self.name}")

    def check(self, workload) -> None:
        if workload.task != "train":
            raise MemfitError("-t optimizer-in-backward changes the training step; drop it for --task inference.")
        if workload.zero_stage:
            raise MemfitError("-t optimizer-in-backward runs in one process; drop --zero.")

    def analytic_policy(self, workload) -> dict:
        return {"grads_leave": True}   # each gradient is freed by its own step

    def apply_(self, setup: StepSetup) -> None:
        setup.optimizer_wrapper = StepInBackward


class StepInBackward:
    """An optimizer over `params` (parameters, or groups of them) made of one optimizer per trainable parameter,
    each built by `build` and stepped by that parameter's post-accumulate-grad hook (the hooks hold it weakly: it
    lives as long as the user keeps it)."""

    def __init__(self, params, build: Callable[[list], torch.optim.Optimizer]) -> None:
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for group in groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p.requires_grad:
                    self.optimizers[p] = build([{**settings, "params": [p]}] if settings else [p])
        hook = functools.partial(_step_in_backward, weakref.ref(self))
        self.handles = [p.register_post_accumulate_grad_hook(hook) for p in self.optimizers]

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.optimizers.values() for p, s in optimizer.state.items()}

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def step(self, closure=None) -> None:
        """Each parameter stepped in backward already."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Each gradient was freed by its step."""

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()


def _step_in_backward(owner: weakref.ref, param: torch.Tensor) -> None:
    optimizers = owner()
    if optimizers is None:
        return
    optimizer = optimizers.optimizers[param]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
