"""Estimators: traced (the real step on fake tensors) and analytic (closed forms)."""
from __future__ import annotations

from memfit.core.errors import MemfitError
from memfit.estimators.analytic import analytic_estimate
from memfit.estimators.breakdown import MemoryEstimate
from memfit.estimators.traced import traced_estimate
from memfit.specs.hardware import GPU
from memfit.specs.workload import Workload
from memfit.techniques.resolve import resolve

METHODS = ("auto", "traced", "analytic")


def methods_for(workload: Workload) -> tuple[str, ...]:
    """The estimators that model `workload`: the trace where it runs (PyTorch's engine), the analytic model for
    transformer configs unless a technique (or the user's own --step) has no analytic model."""
    workload = resolve(workload)
    if workload.engine == "deepspeed":
        return ("analytic",)
    if not workload.source.is_hf or workload.with_trait("traced-only") or workload.step is not None:
        return ("traced",)
    return ("traced", "analytic")


def estimate(workload: Workload, *, method: str = "auto", gpu: GPU | None = None, **options) -> MemoryEstimate:
    """`auto`: traced where it can run (PyTorch engine), analytic otherwise."""
    if method not in METHODS:
        raise MemfitError(f"unknown --method {method!r}; choose auto, traced or analytic.")
    workload = resolve(workload)
    if method == "auto":
        method = "traced" if workload.engine == "pytorch" else "analytic"
    if method == "traced":
        result = traced_estimate(workload, gpu, **options)
    else:
        result = analytic_estimate(workload, gpu, **{k: v for k, v in options.items() if k == "modules"})
    result.notes += [note for technique in workload.field_techniques + list(workload.technique_configs)
                     for note in technique.estimate_notes(workload)]
    return result
