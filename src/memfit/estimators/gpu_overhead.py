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


def gpu_overheads(gpu: GPU, peak_bytes: int, workload=None) -> dict[str, int]:
    from memfit.techniques.allocator import reserve_fraction

    return {
        "cuda_context": gpu.context_bytes,
        "cublas_workspace": CUBLAS_WORKSPACE_BYTES_ASSUMED,
        "allocator_reserve": int(peak_bytes * reserve_fraction(workload)),
    }


def add_gpu_overheads(estimate: MemoryEstimate, gpu: GPU, workload=None) -> None:
    """Add the device's overheads to a tensor-peak estimate (labelled assumed) and decide whether it fits."""
    estimate.overhead_detail = gpu_overheads(gpu, estimate.peak_bytes, workload)
    estimate.overhead_bytes = sum(estimate.overhead_detail.values())
    estimate.sources.update({name: "assumed" for name in estimate.overhead_detail})
    estimate.apply_device(gpu.memory_bytes)
