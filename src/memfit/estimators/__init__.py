"""Estimators: traced (the real step on fake tensors) and analytic (closed forms)."""
from __future__ import annotations

from typing import Any, Literal, overload

import torch
from torch import nn

from memfit import serving
from memfit.core.errors import MemfitError, closest
from memfit.core.versions import version_notes
from memfit.estimators import stand_ins  # noqa: F401  (registers the trace stand-ins)
from memfit.estimators.analytic import analytic_estimate
from memfit.estimators.analytic import count_parameters as analytic_parameters
from memfit.estimators.analytic.families.registry import has_family as has_analytic_family
from memfit.estimators.analytic.families.registry import has_program
from memfit.estimators.breakdown import MemoryEstimate
from memfit.estimators.sdpa_backend import grouped_math_note
from memfit.estimators.traced import traced_estimate
from memfit.serving.estimate import ServingEstimate
from memfit.serving.releases import LOCAL_ENGINES
from memfit.specs.hardware import GPU, get_gpu
from memfit.specs.live import live_workload
from memfit.specs.workload import Workload
from memfit.steps.user_step import step_notes
from memfit.techniques.optimizer_states import optimizer_of
from memfit.techniques.resolve import resolve

METHODS = ("auto", "traced", "analytic")


def methods_for(workload: Workload) -> tuple[str, ...]:
    """The estimators that model `workload`: the trace where it runs (PyTorch's engine), the analytic model for
    the transformer families it has a program of, unless a technique (or the user's own --step) has none."""
    workload = resolve(workload)
    analytic = has_program(workload)
    if workload.engine == "deepspeed":   # no trace of DeepSpeed's engine; a custom module has no analytic model
        return ("analytic",) if analytic else ()
    if not analytic or workload.with_trait("traced-only") or workload.step is not None:
        return ("traced",)
    return ("traced", "analytic")


def count_parameters(workload: Workload) -> int:
    """The parameters of the workload's model (from its config's closed forms, else built on the meta device)."""
    workload = resolve(workload)
    if has_analytic_family(workload.source):
        return analytic_parameters(workload)
    return sum(p.numel() for p in workload.source.build(device="meta", dtype=torch.float32).parameters())


ESTIMATE_OPTIONS = frozenset({"full_trace", "modules", "timeline"})   # traced_estimate's own (analytic: modules)


@overload
def estimate(workload: str | dict, batch: None = None, *, task: Literal["serve"], gpu: GPU | str | None = None,
             **options: Any) -> ServingEstimate: ...


@overload
def estimate(workload: Workload | nn.Module, batch=None, *, method: str = "auto", gpu: GPU | str | None = None,
             optimizer=None, step=None, task: str = "train", precision: str | None = None, techniques=(),
             **options) -> MemoryEstimate: ...


def estimate(workload, batch=None, *, method="auto", gpu=None, optimizer=None, step=None, task="train",
             precision=None, techniques=(), **options):
    """`workload`'s memory. `auto`: traced where it can run (PyTorch engine), analytic otherwise.

    Given a live `nn.Module` and its `batch` instead of a Workload (a notebook's objects), the model is traced on
    a meta copy (specs/live.py): nothing model-sized is allocated and the model and `optimizer` (an instance or a
    name) are left as they were; `step` is fn(model, batch, optimizer), the user's own step.

    task="serve": an LLM serving engine's start-up (memfit.serving.estimate): `workload` is the model's name, the
    engine's settings are keywords (engine="vllm", max_model_len=...), the answer a ServingEstimate."""
    if task == "serve":
        training_only = (batch, optimizer, step, precision)
        if isinstance(workload, Workload | nn.Module) or any(x is not None for x in training_only) or techniques \
                or method != "auto":
            raise MemfitError("task='serve' takes a model's name (or its config) and the engine's settings as "
                              "keywords: "
                              "memfit.estimate('llama-3.1-8b', task='serve', engine='vllm', gpu='l4', ...).")
        if options.get("engine") in LOCAL_ENGINES:   # llama.cpp's buffers: its own settings
            return serving.estimate_gguf(workload, gpu=gpu, **options)
        return serving.estimate(workload, gpu or "h100", **options)
    live = workload if isinstance(workload, nn.Module) else None   # held: the registry keeps a weak reference
    unknown = sorted(set(options) - ESTIMATE_OPTIONS)
    if unknown:
        hint = (" A live model takes its batch as the second argument: memfit.estimate(model, batch)."
                if live is not None and "inputs" in unknown else "")
        raise MemfitError(f"memfit.estimate got unknown keyword argument(s) {', '.join(unknown)}; it takes "
                          f"{', '.join(sorted(ESTIMATE_OPTIONS))} beside method, gpu, optimizer, step, task, precision "
                          f"and techniques.{hint}")
    if live is None and not isinstance(workload, Workload):
        raise MemfitError(f"expected a memfit Workload (e.g. Workload(model='gpt2')) or a torch.nn.Module and its "
                          f"batch, got {type(workload).__name__}.")
    if live is not None:
        workload = live_workload(live, batch, optimizer=optimizer_of(optimizer), step=step, task=task,
                                 precision=precision, techniques=techniques)
    elif batch is not None or optimizer is not None or step is not None or precision is not None or techniques:
        raise MemfitError("a Workload carries its batch shape, optimizer, step, precision and techniques; pass "
                          "them to the Workload, or pass a live model and its batch.")
    if isinstance(gpu, str):
        gpu = get_gpu(gpu)
    if method not in METHODS:
        raise MemfitError(f"unknown --method {method!r}; choose auto, traced or analytic."
                          f"{closest(str(method), METHODS)}")
    assert isinstance(workload, Workload)   # a live model became one above; anything else raised
    workload = resolve(workload)
    if method == "auto":
        method = "traced" if workload.engine == "pytorch" else "analytic"
    if method == "traced":
        result = traced_estimate(workload, gpu, **options)
    else:
        result = analytic_estimate(workload, gpu, **{k: v for k, v in options.items() if k == "modules"})
    if workload.source.note:
        result.notes.insert(0, workload.source.note)
    result.notes += [note for technique in workload.hooked_techniques
                     for note in technique.estimate_notes(workload)]
    if workload.step is not None:
        result.notes += step_notes(workload)
    if gpu is not None and (note := grouped_math_note(workload, gpu.compute_capability)):
        result.notes.append(note)
    if live is not None:
        result.notes.append("traced on a meta copy of the live model: the model and optimizer were not touched")
    result.notes += version_notes("estimate")
    return result
