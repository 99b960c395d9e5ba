"""memfit: make large PyTorch models fit in GPU memory.

    from memfit import Workload, estimate, measure, get_gpu
    w = Workload(model="llama-3.1-8b", task="train", batch_size=1, seq_len=4096, precision="bf16-mixed")
    e = estimate(w, gpu=get_gpu("rtx-4090"))          # traced where it can run, else analytic
    print(e.peak_bytes, e.peak_phase, e.at_peak, e.fits)
    p = plan(PlanRequest(model="llama-3.1-8b", gpu=get_gpu("rtx-4090"), seq_len=4096, global_batch=64))
    print(p.to_json()["plans"][0])                    # the fastest configuration that fits

The names below load on first use, so `import memfit` stays light (the CLI sets up torch's logging
before torch loads).
"""
from importlib import import_module

__version__ = "0.1.0"
_EXPORTS = {
    "MemfitError": "memfit.core.errors", "MemoryEstimate": "memfit.estimators.breakdown",
    "Workload": "memfit.specs.workload", "estimate": "memfit.estimators", "get_gpu": "memfit.specs.hardware",
    "measure": "memfit.measurement", "apply_": "memfit.techniques.compose", "StepSetup": "memfit.steps.setup",
    "plan": "memfit.planner", "PlanRequest": "memfit.planner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
