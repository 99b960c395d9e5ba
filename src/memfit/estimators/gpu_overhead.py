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

from memfit.core.caching_allocator import AllocatorSettings, Event, Replay, replay, simulate_reserved
from memfit.core.units import KiB, MiB, format_bytes
from memfit.estimators.breakdown import MemoryEstimate
from memfit.specs.hardware import GPU

CUDA_ALLOCATION_ROUND_BYTES = 512          # every caching-allocator block is a multiple of this
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
    step at fewer layers, and `start_reserved` what the model's set-up leaves reserved: predict_reserve), cuBLAS's
    workspaces (allocated through the allocator, so replayed with the step) and the assumed CUDA context."""
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


def predict_reserve(events: list[Event], settings: AllocatorSettings, capacity: int, peak_bytes: int,
                    sampled: str | None = None, start_reserved: int | None = None,
                    training: bool = False) -> tuple[Replay, str | None]:
    """The allocator's figures for a step whose tensors peak at `peak_bytes`, and a note for the estimate.
    `events` are the whole step's, or (`sampled`: what they are, e.g. "the step at 2 layers") those of a step like
    it at fewer layers. Then what the allocator reserves beyond the sample's tensors is carried over to the model:
    - a training step (`training`): in proportion to the peak. Its backward leaves each layer's gradients behind
      among the activation blocks it frees, so the holes grow with depth like the tensors do (an H200: Qwen2.5-7B,
      28 layers, reserved 9 GiB beyond its tensors, where the same step at 4 layers replays to 2.4 GiB).
    - inference: as it is, in bytes. Nothing a layer allocates outlives the next layer's requests, which reuse the
      same blocks (torchao's int4 Llama-3-8B replayed at 2, 3, 4 and 8 layers and at full depth: 0.91 to 1.03 GB).
    What the set-up leaves reserved grows with depth too (the weights' segments, and the cached originals of weights
    converted on the device, layer by layer): `start_reserved`, what the model's set-up leaves reserved into its step
    (Replay.start_reserved_bytes, extrapolated from the samples by the caller), is a floor for its reserved peak."""
    if peak_bytes > capacity:
        return (Replay(peak_bytes, peak_bytes, 0, out_of_memory=True),
                "allocator not simulated: the tensors alone exceed the device")
    if sampled is None:
        replayed = simulate_reserved(events, settings, capacity)
        if replayed.out_of_memory:
            return replayed, "the simulated allocator runs out of device memory even after releasing its cache"
        if replayed.cache_flushes:
            times = "once" if replayed.cache_flushes == 1 else f"{replayed.cache_flushes} times"
            return replayed, f"the simulated allocator releases its cache {times} to make room (a device sync each)"
        return replayed, None
    sample = replay(events, settings)
    reserve = max(0, sample.reserved_bytes - sample.allocated_bytes)
    if training:
        share = reserve / max(1, sample.allocated_bytes)
        reserve = int(share * peak_bytes)
        note = (f"allocator reserve simulated on {sampled} ({share:.1%} of its peak) and scaled to the model's peak "
                "(a training step's reserve grows with depth)")
    else:
        note = (f"allocator reserve simulated on {sampled} ({format_bytes(reserve)} beyond its tensors) and carried "
                "over to the model's peak")
    left = (start_reserved or 0) - peak_bytes
    if left > reserve:
        assert start_reserved is not None   # left > reserve >= 0 needs a start_reserved over the peak
        reserve = left
        note = (f"allocator reserve: the segments the set-up leaves reserved into the step "
                f"({format_bytes(start_reserved)}, extrapolated in depth from {sampled} and the shallower samples: "
                "the weights as loaded, and the cached originals of weights converted on the device) hold more than "
                "the step adds, and it runs inside them")
    return Replay(peak_bytes + reserve, peak_bytes, reserve, start_reserved_bytes=start_reserved or 0), note
