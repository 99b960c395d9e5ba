"""memfit: make large PyTorch models fit in GPU memory.

    from memfit import Workload, estimate, measure, get_gpu
    w = Workload(model="llama-3.1-8b", task="train", batch_size=1, seq_len=4096, precision="bf16-mixed")
    e = estimate(w, gpu=get_gpu("rtx-4090"))          # traced where it can run, else analytic
    print(e.peak_bytes, e.peak_phase, e.at_peak, e.fits)
"""
from memfit.core.errors import MemfitError
from memfit.estimators import estimate
from memfit.estimators.breakdown import MemoryEstimate
from memfit.measurement import measure
from memfit.specs.hardware import get_gpu
from memfit.specs.workload import Workload

__version__ = "0.1.0"
__all__ = ["MemfitError", "MemoryEstimate", "Workload", "estimate", "get_gpu", "measure"]
