"""Memory partitioning on CUDA: how the caching allocator holds device memory. Neither changes the
tensors' peak (what `max_memory_allocated` reports); they change what the allocator reserves beyond it.

  expandable-segments  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set at run time through
                       torch.cuda.memory._set_allocator_settings): a segment grows in place by mapping
                       more pages, instead of a new fixed segment per size class, so freed blocks of
                       changing sizes (growing sequences, variable batches) fragment less. The estimators
                       replay the step through the allocator with this setting
                       (core/caching_allocator.py: simulated, not yet compared with a GPU run).
  release-cache        torch.cuda.empty_cache() between the step's phases (after backward, after the
                       optimizer step): cached, unused blocks go back to the driver, for another process
                       or a later phase of a different shape. The step's own peak is unchanged, so the
                       estimate is too; the cost is re-allocating through cudaMalloc every phase. The
                       simulated allocator empties its cache as each phase starts, as the run does.

On the CPU both are no-ops (CPU runs have no caching allocator), so their figures come from a GPU or the
simulated allocator.
expandable-segments is a process-wide setting: it stays on for later runs in the same process.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from memfit.core.caching_allocator import AllocatorSettings
from memfit.steps.setup import StepSetup
from memfit.techniques.base import OomFix, Technique, register
from memfit.techniques.contracts import CostCompute, OomMessage, OomSnapshot, PlanQuery


@register
@dataclass(frozen=True, kw_only=True)
class ExpandableSegments(Technique):
    name = "expandable-segments"
    examples = (("expandable-segments", {}),)
    risk = "lossless"
    stage = "memory"
    traits = frozenset({"allocator-only"})
    summary = "CUDA allocator segments that grow in place: less fragmentation, a smaller reserve (CUDA only)"
    oom_fixes = ("expandable-segments",)
    search_axis = "allocator"
    how = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [] if request.on_cpu else [cls.name]

    def cost_compute(self, compute: CostCompute) -> None:   # growing a segment in place costs no step time here
        pass

    def allocator_settings(self, settings: AllocatorSettings) -> AllocatorSettings:
        return replace(settings, expandable_segments=True)

    def oom_fix(self, message: OomMessage | None, snapshot: OomSnapshot | None) -> OomFix | None:
        """What the allocator held but no tensor used: the message's "reserved but unallocated", or a snapshot's
        reserved segments less its active blocks."""
        if message is not None and message.reserved_unallocated_bytes:
            return OomFix(self.name, message.reserved_unallocated_bytes, "message: reserved, unallocated", self.how)
        if snapshot is not None and snapshot.fragmentation_bytes > 0:
            return OomFix(self.name, snapshot.fragmentation_bytes, "snapshot: reserved − active", self.how)
        return None

    def apply_(self, setup: StepSetup) -> None:
        if setup.device_type == "cuda" and torch.cuda.is_available():
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


@register
@dataclass(frozen=True, kw_only=True)
class ReleaseCache(Technique):
    name = "release-cache"
    examples = (("release-cache", {}),)
    risk = "lossless"
    stage = "memory"
    traits = frozenset({"allocator-only"})
    summary = "return cached CUDA blocks to the driver between phases (torch.cuda.empty_cache; CUDA only)"
    time_factor = 1.02

    def allocator_settings(self, settings: AllocatorSettings) -> AllocatorSettings:
        return replace(settings, empty_cache_between_phases=True)

    def apply_(self, setup: StepSetup) -> None:
        if setup.device_type == "cuda" and torch.cuda.is_available():
            setup.phase_callbacks.append(lambda phase: torch.cuda.empty_cache())
