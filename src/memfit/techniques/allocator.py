"""Memory partitioning on CUDA: how the caching allocator holds device memory. Neither changes the
tensors' peak (what `max_memory_allocated` reports); they change what the allocator reserves beyond it.

  expandable-segments  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set at run time through
                       torch.cuda.memory._set_allocator_settings): a segment grows in place by mapping
                       more pages, instead of a new fixed segment per size class, so freed blocks of
                       changing sizes (growing sequences, variable batches) fragment less. Modelled as
                       an allocator reserve of 2 % of the tensor peak instead of 10 % (both ASSUMED until
                       benchmarks/gpu_validate.py measures max_memory_reserved / max_memory_allocated).
  release-cache        torch.cuda.empty_cache() between the step's phases (after backward, after the
                       optimizer step): cached, unused blocks go back to the driver, for another process
                       or a later phase of a different shape. The step's own peak is unchanged, so the
                       estimate is too; the cost is re-allocating through cudaMalloc every phase.

On the CPU both are no-ops (CPU runs have no caching allocator), so their figures come from a GPU.
expandable-segments is a process-wide setting: it stays on for later runs in the same process.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.techniques.base import Technique, register
from memfit.techniques.setup import StepSetup

RESERVE_FRACTION_ASSUMED = 0.10                     # PyTorch's default allocator, training loops
EXPANDABLE_RESERVE_FRACTION_ASSUMED = 0.02          # with expandable segments


@register
@dataclass(frozen=True, kw_only=True)
class ExpandableSegments(Technique):
    name = "expandable-segments"
    risk = "lossless"
    stage = "memory"
    summary = "CUDA allocator segments that grow in place: less fragmentation, a smaller reserve (CUDA only)"

    def apply_(self, setup: StepSetup) -> None:
        if setup.device_type == "cuda" and torch.cuda.is_available():
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


@register
@dataclass(frozen=True, kw_only=True)
class ReleaseCache(Technique):
    name = "release-cache"
    risk = "lossless"
    stage = "memory"
    summary = "return cached CUDA blocks to the driver between phases (torch.cuda.empty_cache; CUDA only)"
    time_factor = 1.02

    def apply_(self, setup: StepSetup) -> None:
        if setup.device_type == "cuda" and torch.cuda.is_available():
            setup.phase_callbacks.append(lambda phase: torch.cuda.empty_cache())


def reserve_fraction(workload) -> float:
    """The caching allocator's reserve beyond the tensor peak, as a fraction of it (ASSUMED)."""
    if workload is not None and workload.technique("expandable-segments"):
        return EXPANDABLE_RESERVE_FRACTION_ASSUMED
    return RESERVE_FRACTION_ASSUMED
