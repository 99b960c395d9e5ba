"""What a CUDA device holds beyond the tensors PyTorch allocates (all ASSUMED until measured).

- CUDA context and kernel images: per-GPU figure from the catalog (gpus.json, context_mib).
- cuBLAS/cuDNN workspaces: PyTorch keeps one cuBLAS workspace per handle and stream.
- The caching allocator's reserve: reserved bytes exceed allocated bytes (block splitting,
  2 MiB / 20 MiB segments, fragmentation). A fraction of the tensor peak, typical of training
  loops, smaller with expandable segments (techniques/allocator.py); `benchmarks/gpu_validate`
  measures the real ratio.
"""
from __future__ import annotations

from memfit.core.units import MiB
from memfit.estimators.breakdown import MemoryEstimate
from memfit.specs.hardware import GPU

CUDA_ALLOCATION_ROUND_BYTES = 512          # every caching-allocator block is a multiple of this
CUBLAS_WORKSPACE_BYTES_ASSUMED = 32 * MiB
RESERVE_FRACTION_ASSUMED = 0.10            # PyTorch's default caching allocator, training loops


def reserve_fraction(techniques) -> float:
    """The caching allocator's reserve beyond the tensor peak, as a fraction of it (ASSUMED): the smallest an
    allocator technique among `techniques` declares, else the default allocator's."""
    declared = [t.reserve_fraction for t in techniques if t.reserve_fraction is not None]
    return min(declared, default=RESERVE_FRACTION_ASSUMED)


def gpu_overheads(gpu: GPU, peak_bytes: int, techniques=()) -> dict[str, int]:
    return {
        "cuda_context": gpu.context_bytes,
        "cublas_workspace": CUBLAS_WORKSPACE_BYTES_ASSUMED,
        "allocator_reserve": int(peak_bytes * reserve_fraction(techniques)),
    }


def add_gpu_overheads(estimate: MemoryEstimate, gpu: GPU, workload=None) -> None:
    """Add the device's overheads to a tensor-peak estimate (labelled assumed) and decide whether it fits."""
    estimate.overhead_detail = gpu_overheads(gpu, estimate.peak_bytes,
                                             workload.technique_configs if workload is not None else ())
    estimate.overhead_bytes = sum(estimate.overhead_detail.values())
    estimate.sources.update({name: "assumed" for name in estimate.overhead_detail})
    estimate.apply_device(gpu.memory_bytes)
