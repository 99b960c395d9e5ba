"""The analytic estimate: the simulated step (simulate.py) at a few depths, extrapolated to the model's depth, per
rank, with the host RAM, DeepSpeed's states and the GPU's overheads added.

Instant at any size (no tensors, real or fake): the program is run at three small depths and extrapolated
exactly to the model's depth, like the traced estimator. Model states follow the optimizer's implementation
(optimizer.py) and the ZeRO stages (sharding.py); `--engine deepspeed` runs the model in half precision with
DeepSpeed's own states and buffers (host.deepspeed_states).
"""
from __future__ import annotations

import time
from typing import cast

from memfit.core.categories import CATEGORIES, MODEL_STATE_CATEGORIES
from memfit.core.errors import MemfitError
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.host import deepspeed_states, offload_host_bytes, parameter_sizes
from memfit.estimators.analytic.simulate import program_of, simulate
from memfit.estimators.breakdown import MemoryEstimate
from memfit.estimators.derived_program import DerivedProgram
from memfit.estimators.extrapolate import (
    NotLinear,
    RegionPeak,
    Regions,
    extrapolate,
    extrapolate_host,
    extrapolation_depths,
    peak_of,
)
from memfit.estimators.gpu_overhead import add_gpu_overheads, allocator_capacity
from memfit.estimators.sharding import per_rank, ranks_to_estimate, state_weights
from memfit.specs.hardware import GPU
from memfit.specs.workload import Workload
from memfit.techniques.resolve import resolve


def regions_of(e: Engine, num_layers: int, period: int, tail: int | None = None) -> dict[tuple[str, str], RegionPeak]:
    """Peaks per (phase, region): pre, first `period` layers, last `tail` (default `period`) layers, post."""
    tail = tail or period
    regions: dict[tuple[str, str], RegionPeak] = {}
    for (phase, segment), (point, cmax) in e.peak_table().items():
        if phase == "setup":
            continue
        if isinstance(segment, tuple):   # (stack, layer): a layer of one of the repeated stacks
            stack, layer = segment
            if layer < period:
                name = f"{stack}:first"
            elif layer >= num_layers - tail:
                name = f"{stack}:last"
            else:
                continue
        else:   # the engine's named segments: "pre", "mid", "post"
            name = cast(str, segment)
        at, cm = dict(point.at), dict(cmax)
        key = (phase, name)
        if key in regions:   # first and last coincide for a one-period stack
            old = regions[key]
            if sum(at.values()) > old.total:
                old.at_max = at
            old.category_max = {c: max(old.category_max[c], cm[c]) for c in CATEGORIES}
        else:
            regions[key] = RegionPeak(phase, at, cm)
    if num_layers <= period:   # one run of layers: it is both the first and the last
        for (phase, name), region in list(regions.items()):
            if name.endswith(":first"):
                regions[(phase, name[:-5] + "last")] = RegionPeak(phase, dict(region.at_max),
                                                                  dict(region.category_max))
    return regions


def analytic_estimate(workload: Workload, gpu: GPU | None = None, *, modules: bool = False) -> MemoryEstimate:
    started = time.perf_counter()
    workload = resolve(workload)
    source = workload.source
    if workload.step is not None:
        raise MemfitError(f"--step {workload.step}: the analytic model knows memfit's own step, not yours; use "
                          "--method traced.")
    if not source.is_hf:   # under DeepSpeed's engine nothing else models the step
        raise MemfitError(f"the analytic estimator needs a transformer config; {source.name!r} is a custom module: " + (
            "--engine deepspeed has no other model, so measure it (memfit measure ... --engine deepspeed --world-size "
            "N runs DeepSpeed on CPU ranks) or estimate it with --engine pytorch and its own sharding and offload "
            "techniques (memfit techniques)." if workload.engine == "deepspeed" else "use --method traced."))
    traced_only = workload.with_trait("traced-only")
    if traced_only:
        raise MemfitError(f"-t {traced_only.name}: the analytic model has no program for it; use --method traced.")
    _, spec = program_of(workload, gpu)
    period = spec.period
    layers = cast(int, source.num_layers)   # a family's config names its depth
    weights, divisor, notes = state_weights(workload)
    if isinstance(spec, DerivedProgram):
        notes.append(spec.note)
    depths, failure, allocations = None, None, None
    if all(t.depth_linear for t in workload.technique_configs):
        # FSDP2 prefetches the next block's parameters, so in backward the second-to-last block differs from
        # the rest too: when the first fit fails, the last region is two periods wide, sampled from 3 periods
        for first, tail in ((2, period), (3, 2 * period)):
            depths = extrapolation_depths(layers, period, first=first)
            if not depths:
                break
            engines = {n: simulate(workload, gpu, n, weights) for n in depths}
            # extrapolate's Regions are keyed (phase, ordinal), these (phase, name): it reads no key's parts
            samples = {n: cast(Regions, regions_of(e, n, period, tail)) for n, e in engines.items()}
            try:
                regions = extrapolate(samples, layers)
                saved = extrapolate_host({n: {"step": e.host_peak} for n, e in engines.items()}, layers)
                paged = extrapolate_host({n: {"paged": e.paged_bytes} for n, e in engines.items()}, layers)
                break
            except NotLinear as exc:
                failure, depths = exc, None
            del engines
    if failure and not depths:   # not expected for these programs; fall back to the full depth
        notes.append(f"depth extrapolation failed ({failure}); simulated every layer")
    if not depths:
        ranks, why = ranks_to_estimate(workload, "analytic")
        by_rank = {}
        for rank in ranks:
            engine = simulate(workload, gpu, layers, weights, rank, record_allocations=gpu is not None)
            by_rank[rank] = (cast(Regions, regions_of(engine, layers, layers)), engine.host_peak, engine.allocations,
                             engine.paged_bytes)
            del engine
        highest = max(ranks, key=lambda r: peak_of(by_rank[r][0])[0].total)
        regions, saved, allocations, paged = by_rank[highest]
        if why:
            notes.append(f"simulated ranks {' and '.join(map(str, ranks))} ({why}); rank {highest} has the highest "
                         "peak")
    top, components, _ = peak_of(regions)
    at_peak = per_rank(top.at_max, divisor)
    component_peaks = per_rank(components, divisor)
    num_parameters = sum(parameter_sizes(workload, gpu))
    held, step = offload_host_bytes(workload, gpu)   # the engine's host bytes (saved activations, streamed
    # weights) are held outside the optimizer step
    drive, phase = 0, top.phase
    if workload.engine == "deepspeed":
        at_peak, component_peaks, held, drive, in_step = deepspeed_states(workload, num_parameters, at_peak,
                                                                          component_peaks)
        phase = "optimizer" if in_step else phase
        step = 0   # DeepSpeed's CPU Adam steps in place
        notes.append(f"engine deepspeed (ZeRO-{workload.zero_stage}): half weights, float32 master weights, Adam "
                     f"moments and gradient partition, a reduction bucket of {workload.reduce_bucket:,} elements"
                     + (" (stage 3: the weights it gathers stay until reused, up to 1e9 elements)"
                        if workload.zero_stage == 3 else ""))
    estimate = MemoryEstimate(
        model=source.name, num_parameters=num_parameters, workload=workload.to_json(),
        method="analytic", device=gpu.name if gpu else "cpu", peak_bytes=sum(at_peak.values()),
        peak_phase=phase, at_peak=at_peak, component_peaks=component_peaks,
        model_state_bytes={k: component_peaks[k] for k in MODEL_STATE_CATEGORIES},
        host_bytes=held + max(saved, step), nvme_bytes=drive, sources={name: "analytic" for name in CATEGORIES},
        notes=notes,
    )
    if gpu:
        if depths and estimate.peak_bytes <= allocator_capacity(gpu):   # the whole step: milliseconds, no tensors
            allocations = simulate(workload, gpu, layers, weights, record_allocations=True).allocations
        events = [(uid, -(-nbytes // divisor), stream) for uid, nbytes, stream in allocations or ()]
        estimate.paged_bytes = paged
        # ZeRO-3's own sequence holds partitions, not the simulated step's whole weights: that step's reserve is
        # scaled to ZeRO-3's peak (a guess: no ZeRO-3 run was compared)
        add_gpu_overheads(estimate, gpu, workload, events, "the step with whole weights (DeepSpeed's ZeRO-3 "
                          "sequence is not modelled)" if workload.engine == "deepspeed" and workload.zero_stage == 3
                          else None)
    estimate.elapsed_s = time.perf_counter() - started
    return estimate


def count_parameters(workload: Workload) -> int:
    return sum(parameter_sizes(resolve(workload)))
