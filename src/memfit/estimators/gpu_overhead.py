"""What a CUDA device holds beyond the tensors PyTorch allocates.

- CUDA context and kernel images: per-GPU figure from the catalog (gpus.json, context_mib), ASSUMED.
- cuBLAS/cuDNN workspaces: PyTorch keeps one cuBLAS workspace per handle and stream, ASSUMED.
- The caching allocator's reserve: what it holds beyond the tensors (segments of 2 and 20 MiB, blocks it did not
  split, freed blocks too small for the next request). SIMULATED: the step's allocations and frees replayed through
  a model of PyTorch's allocator (caching_allocator.py) under the workload's allocator settings.
"""
from __future__ import annotations

from memfit.core.units import MiB, format_bytes
from memfit.estimators.breakdown import MemoryEstimate
from memfit.estimators.caching_allocator import Event, predict_reserve
from memfit.specs.hardware import GPU, AllocatorSettings

CUDA_ALLOCATION_ROUND_BYTES = 512          # every caching-allocator block is a multiple of this
CUBLAS_WORKSPACE_BYTES_ASSUMED = 32 * MiB


def allocator_settings(workload) -> AllocatorSettings:
    """The allocator settings the workload's techniques leave (default: PyTorch's)."""
    settings = AllocatorSettings()
    for technique in workload.technique_configs:
        settings = technique.allocator_settings(settings)
    return settings


def allocator_capacity(gpu: GPU) -> int:
    """The bytes the caching allocator can get from the device: its memory less what lives outside the allocator."""
    return gpu.memory_bytes - gpu.context_bytes - CUBLAS_WORKSPACE_BYTES_ASSUMED


def add_gpu_overheads(estimate: MemoryEstimate, gpu: GPU, workload, allocations: list[Event],
                      sampled: str | None = None, start_reserved: int | None = None) -> None:
    """Add the device's overheads to a tensor-peak estimate and decide whether it fits: the allocator's reserve,
    simulated on the step's `allocations` (`sampled`: what they are when they are not the step itself, e.g. the
    step at fewer layers, and `start_reserved` the model's reserved bytes as its step starts:
    caching_allocator.predict_reserve), and the assumed context and workspace."""
    settings = allocator_settings(workload)
    allocator, note = predict_reserve(allocations, settings, allocator_capacity(gpu), estimate.peak_bytes, sampled,
                                      start_reserved)
    # what the allocator reserves beyond its own allocated peak, added to the estimate's peak (they differ only
    # where the estimator adds tensors the replay does not see: DeepSpeed's states)
    reserved = estimate.peak_bytes + max(0, allocator.reserved_bytes - allocator.allocated_bytes)
    estimate.reserved_bytes = reserved
    estimate.allocator = {**allocator.to_json(), "reserved_bytes": reserved,
                          "expandable_segments": settings.expandable_segments}
    estimate.overhead_detail = {
        "cuda_context": gpu.context_bytes,
        "cublas_workspace": CUBLAS_WORKSPACE_BYTES_ASSUMED,
        "allocator_reserve": reserved - estimate.peak_bytes,
    }
    estimate.overhead_bytes = sum(estimate.overhead_detail.values())
    estimate.sources.update({"cuda_context": "assumed", "cublas_workspace": "assumed",
                             "allocator_reserve": "simulated", "reserved_bytes": "simulated"})
    if note:
        estimate.notes.append(note)
    if allocator.setup_reserved_bytes > reserved:
        estimate.notes.append(
            f"before the step the allocator reserves {format_bytes(allocator.setup_reserved_bytes)}, more than the "
            "step itself: the weights as loaded, then changed on the device (a quantization: quantizing before "
            "moving the model to the GPU avoids that peak)")
    estimate.apply_device(gpu.memory_bytes)
    if estimate.paged_bytes:
        spilled = estimate.paged_out_bytes
        estimate.host_bytes += spilled
        estimate.sources["paged_bytes"] = estimate.method
        estimate.notes.append(
            f"paged optimizer states: {format_bytes(estimate.paged_bytes)} in CUDA unified memory, outside the "
            "allocator" + (f"; {format_bytes(spilled)} of it does not fit beside the rest and pages to host RAM "
                           "(PCIe traffic every step)" if spilled else ", on the device beside the rest"))
