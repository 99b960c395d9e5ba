"""What a CUDA device holds beyond the tensors PyTorch allocates.

- CUDA context and kernel images: per-GPU figure from the catalog (gpus.json, context_mib), ASSUMED.
- cuBLAS workspaces: PyTorch gives each (cuBLAS handle, stream) pair its own workspace, allocated through the caching
  allocator at the first matmul (so max_memory_allocated and max_memory_reserved count it) and kept for the
  process's life: 4096 KiB x 8 on compute capability 9.0, 4096 KiB x 2 + 16 KiB x 8 elsewhere (CublasHandlePool.cpp,
  parseChosenWorkspaceSize), and beside it cuBLASLt's own 1 MiB (CUBLASLT_WORKSPACE_SIZE's default; hipBLASLt's
  76 MiB on ROCm). Handles are per thread: a training step also runs its backward on autograd's device thread, a
  second pair. Measured on an H200 (torch 2.11): +32 MiB at the first matmul, +1 MiB at the first cuBLASLt one,
  +33 MiB at the first backward, and 65 MiB beyond the traced tensors in every row of gpu_validate.
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
KiB = 1024
BLAS_WORKSPACE = "<cuBLAS workspace {}>"   # an allocation event's tensor: a thread's cuBLAS workspace


def blas_workspaces(gpu: GPU, workload) -> list[int]:
    """The bytes of each cuBLAS (or hipBLAS) and cuBLASLt workspace the step's threads allocate (module docstring)."""
    cublas = 4096 * KiB * 8 if tuple(gpu.compute_capability) == (9, 0) else 4096 * KiB * 2 + 16 * KiB * 8
    lt = 76 * MiB if gpu.vendor == "amd" else 1 * MiB
    threads = 2 if workload.task == "train" else 1   # the step's own thread, and autograd's device thread
    return [cublas, lt] * threads


def allocator_settings(workload) -> AllocatorSettings:
    """The allocator settings the workload's techniques leave (default: PyTorch's)."""
    settings = AllocatorSettings()
    for technique in workload.technique_configs:
        settings = technique.allocator_settings(settings)
    return settings


def allocator_capacity(gpu: GPU) -> int:
    """The bytes the caching allocator can get from the device: its memory less what lives outside the allocator."""
    return gpu.memory_bytes - gpu.context_bytes


def add_gpu_overheads(estimate: MemoryEstimate, gpu: GPU, workload, allocations: list[Event],
                      sampled: str | None = None, start_reserved: int | None = None) -> None:
    """Add the device's overheads to a tensor-peak estimate and decide whether it fits: the allocator's reserve,
    simulated on the step's `allocations` (`sampled`: what they are when they are not the step itself, e.g. the
    step at fewer layers, and `start_reserved` the model's reserved bytes as its step starts:
    caching_allocator.predict_reserve), and the assumed context and workspace."""
    settings = allocator_settings(workload)
    workspaces = blas_workspaces(gpu, workload)
    allocated = estimate.peak_bytes + sum(workspaces)   # the tensors and the workspaces: max_memory_allocated
    allocations = [(BLAS_WORKSPACE.format(i), nbytes, 0) for i, nbytes in enumerate(workspaces)] + allocations
    allocator, note = predict_reserve(allocations, settings, allocator_capacity(gpu), allocated, sampled,
                                      start_reserved, training=workload.task == "train")
    # what the allocator reserves beyond its own allocated peak, added to the estimate's (they differ only where
    # the estimator adds tensors the replay does not see: DeepSpeed's states)
    reserved = allocated + max(0, allocator.reserved_bytes - allocator.allocated_bytes)
    estimate.reserved_bytes = reserved
    estimate.allocator = {**allocator.to_json(), "allocated_bytes": allocated, "reserved_bytes": reserved,
                          "expandable_segments": settings.expandable_segments}
    estimate.overhead_detail = {
        "cuda_context": gpu.context_bytes,
        "cublas_workspace": sum(workspaces),
        "allocator_reserve": reserved - allocated,
    }
    estimate.overhead_bytes = sum(estimate.overhead_detail.values())
    estimate.sources.update({"cuda_context": "assumed", "cublas_workspace": "modelled",
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
