"""The user's own step (`--step module:function`, `Workload(step=...)`): fn(model, batch, optimizer) runs one whole
training step however the user writes it (their loss, outputs kept alive, several forwards, accumulation inside),
or, for `--task inference`, their inference or generation loop with `optimizer=None`.

memfit builds the model, the batch and the optimizer as for its own step, with the techniques applied to them, and
calls the function: twice for training (a warm-up that creates the optimizer state, then the step that counts),
once for inference. The step runs inside the precision's autocast unless its source mentions autocast (it sets its
own), or it takes an `autocast` keyword: then memfit passes its precision's region for the target device (a
context-manager factory; emulated in a trace for a GPU) and the step enters it where its framework does (around the
forward only, as accelerate and Lightning do). Techniques that change memfit's own step rather than the model or
optimizer (its loss, its batch, its backward) are refused with the reason.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
from collections.abc import Callable

from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision
from memfit.specs.user_code import call_user, import_callable
from memfit.steps.hooks import StepHooks
from memfit.steps.optim import optimizer_state_tensors
from memfit.steps.setup import StepSetup
from memfit.steps.train import enter_phase

# traits of techniques that change memfit's own step, and why they cannot apply to the user's
REPLACES_THE_STEP = {
    "replaces-loss": "it replaces the loss of memfit's step, and your step computes its own",
    "own-backward": "its schedule runs the forward and backward passes itself",
    "shapes-batch": "it reshapes the batch inside memfit's step; shorten the batch your --inputs returns instead",
}


def check_user_step(workload) -> None:
    """Refuse what cannot run with the user's step (a ResolvedWorkload with `step` set)."""
    import_callable(workload.step, "step")
    if workload.engine != "pytorch":
        raise MemfitError(f"--step {workload.step} runs your step in PyTorch; --engine {workload.engine} runs its "
                          "engine's own step: drop one.")
    for technique in workload.technique_configs:
        for trait, why in REPLACES_THE_STEP.items():
            if trait in technique.traits:
                raise MemfitError(f"-t {technique.name} cannot apply to your --step {workload.step}: {why}.")


def step_notes(workload) -> list[str]:
    """What memfit did around the user's step (a ResolvedWorkload with `step` set)."""
    notes = [f"the step is yours ({workload.step}), traced as it runs"]
    fn = import_callable(workload.step, "step")
    if get_precision(workload.precision).autocast_dtype is not None:
        if takes_autocast(fn):
            notes.append(f"your step enters memfit's {workload.precision} autocast where it chooses")
        elif sets_own_autocast(fn):
            notes.append(f"your step enters autocast itself: memfit's {workload.precision} autocast does not wrap it")
        else:
            notes.append(f"your step runs inside memfit's {workload.precision} autocast")
    if get_precision(workload.precision).loss_scaling:
        notes.append("loss scaling (GradScaler) is your step's to do: memfit adds none around it")
    return notes


def sets_own_autocast(fn: Callable) -> bool:
    """Whether the step's source enters autocast itself (then memfit's precision does not wrap it)."""
    try:
        return "autocast" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def takes_autocast(fn: Callable) -> bool:
    """Whether the step takes memfit's mixed-precision region as its `autocast` keyword."""
    try:
        return "autocast" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def run_user_step(setup: StepSetup, batch, workload, *, hooks: StepHooks,
                  before_measured_step: Callable[[], None]) -> None:
    fn = import_callable(workload.step, "step")
    model = setup.model
    region = contextlib.nullcontext if takes_autocast(fn) or sets_own_autocast(fn) else setup.autocast
    hooks.mark("parameters", list(model.parameters()))
    if workload.task == "train":
        model.train()
        optimizer = setup.build_optimizer()
        _call(fn, workload.step, model, batch, optimizer, region, setup, hooks)
        gc.collect()
        before_measured_step()
        _call(fn, workload.step, model, batch, optimizer, region, setup, hooks)
        hooks.mark("optimizer_states", optimizer_state_tensors(optimizer))
        return
    model.eval()
    gc.collect()
    before_measured_step()
    _call(fn, workload.step, model, batch, None, region, setup, hooks)


def _call(fn: Callable, spec: str, model, batch, optimizer, region, setup: StepSetup, hooks: StepHooks) -> None:
    enter_phase(setup, hooks, "step")
    keywords = {"autocast": setup.autocast} if takes_autocast(fn) else {}
    with region():
        call_user(fn, spec, "step", model, batch, optimizer, **keywords)
