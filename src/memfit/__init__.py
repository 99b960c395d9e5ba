"""memfit: make large PyTorch models fit in GPU memory.

    from memfit import Workload, estimate, measure, get_gpu
    w = Workload(model="llama-3.1-8b", task="train", batch_size=1, seq_len=4096, precision="bf16-mixed")
    e = estimate(w, gpu=get_gpu("rtx-4090"))          # traced where it can run, else analytic
    print(e.peak_bytes, e.peak_phase, e.at_peak, e.fits)
    p = plan(PlanRequest(model="llama-3.1-8b", gpu=get_gpu("rtx-4090"), seq_len=4096, global_batch=64))
    print(p.to_json()["plans"][0])                    # the fastest configuration that fits

    from memfit.techniques import Checkpointing      # every technique's config class
    setup = apply_(model, optimizer, [Checkpointing(every=2), "bf16-mixed"], scheduler=scheduler)

The names below load on first use, so `import memfit` stays light (the CLI sets up torch's logging
before torch loads); type checkers see them through the imports under TYPE_CHECKING.
"""
from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"
_EXPORTS = {
    "MemfitError": "memfit.core.errors", "MemoryEstimate": "memfit.estimators.breakdown",
    "Workload": "memfit.specs.workload", "estimate": "memfit.estimators", "get_gpu": "memfit.specs.hardware",
    "measure": "memfit.measurement", "apply_": "memfit.techniques.compose", "StepSetup": "memfit.steps.setup",
    "plan": "memfit.planner", "PlanRequest": "memfit.planner", "PlanResult": "memfit.planner",
    "resolve": "memfit.techniques.resolve", "ResolvedWorkload": "memfit.techniques.resolve",
}
__all__ = [
    "MemfitError", "MemoryEstimate", "PlanRequest", "PlanResult", "ResolvedWorkload", "StepSetup", "Workload",
    "apply_", "estimate", "get_gpu", "measure", "plan", "resolve", "techniques",
]

if TYPE_CHECKING:
    from memfit import techniques
    from memfit.core.errors import MemfitError
    from memfit.estimators import estimate
    from memfit.estimators.breakdown import MemoryEstimate
    from memfit.measurement import measure
    from memfit.planner import PlanRequest, PlanResult, plan
    from memfit.specs.hardware import get_gpu
    from memfit.specs.workload import Workload
    from memfit.steps.setup import StepSetup
    from memfit.techniques.compose import apply_
    from memfit.techniques.resolve import ResolvedWorkload, resolve


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    if name == "techniques":
        return import_module("memfit.techniques")
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
