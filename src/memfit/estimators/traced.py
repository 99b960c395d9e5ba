"""The traced estimator: run the real step of the real model on fake tensors and track every storage.

The model is built on the meta device and materialised as fake CPU tensors, so nothing real is
allocated at any size. Deep stacks of identical layers are traced at three small depths and
extrapolated (see extrapolate.py), with an exact check; `full_trace=True` traces every layer.
For a GPU target the trace models what CUDA runs: the caching allocator's 512-byte rounding,
the optimizer's implementation (foreach, CUDA's default, unless --optimizer-impl names one), CUDA's
autocast lists, fused dropout and attention kernels (cuda_emulation.py), plus the overheads in
gpu_overhead.py. For the CPU, the scratch that oneDNN convolution and LSTM kernels allocate inside the
kernel is probed (kernel_probe.py).
"""
from __future__ import annotations

import gc
import json
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.core.caching_allocator import replay
from memfit.core.categories import CATEGORIES, MODEL_STATE_CATEGORIES
from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision
from memfit.estimators.batch_interpolation import NotInterpolable, interpolate
from memfit.estimators.breakdown import MemoryEstimate
from memfit.estimators.cuda_emulation import CudaAutocast, CudaKernels
from memfit.estimators.extrapolate import (
    NotLinear,
    RegionPeak,
    extend_decode,
    extend_roughly,
    extrapolate,
    extrapolate_host,
    extrapolation_depths,
    peak_of,
    region_peaks,
)
from memfit.estimators.fake_patches import FakeKernelFixes, real_data_decisions
from memfit.estimators.gpu_overhead import CUDA_ALLOCATION_ROUND_BYTES, add_gpu_overheads, allocator_settings
from memfit.estimators.kernel_probe import KernelScratchProbe
from memfit.estimators.modules import module_rows
from memfit.estimators.sharding import per_rank, ranks_to_estimate, state_weights
from memfit.estimators.timeline import timeline_of
from memfit.estimators.tracker import MemoryTracker, Trace
from memfit.specs.hardware import GPU
from memfit.specs.workload import Workload
from memfit.steps.hooks import tensors_in
from memfit.steps.optim import device_default_impl
from memfit.steps.runner import run_workload
from memfit.techniques.base import parse_technique
from memfit.techniques.compose import prepare_step
from memfit.techniques.resolve import ResolvedWorkload, resolve

WHOLE_RUN = 10**9   # a "period" longer than any stack: regions cover every layer (no extrapolation)


@dataclass
class _Run:
    trace: Trace
    model: nn.Module
    stacks: list[nn.ModuleList]
    probed: set = field(default_factory=set)     # CPU kernels whose scratch was probed
    skipped: set = field(default_factory=set)    # CPU kernels too large to probe
    read_off: tuple[int, int] | None = None      # the micro-batches it was interpolated from (not traced)


def repeated_stacks(model: nn.Module, num_layers: int | None) -> list[nn.ModuleList]:
    """ModuleLists of same-type layers, as many as the model's layer count (HF models)."""
    if not num_layers:
        return []
    stacks = []
    for module in model.modules():
        if (isinstance(module, nn.ModuleList) and len(module) == num_layers
                and len({type(child) for child in module}) == 1):
            stacks.append(module)
    return stacks


def build_fake(workload: ResolvedWorkload, num_layers: int | None, fake_mode: FakeTensorMode) -> nn.Module:
    source = workload.source
    precision = get_precision(workload.precision)
    model = source.build(device="meta", dtype=precision.param_dtype, num_layers=num_layers)
    shared = shared_parameters(model)
    with fake_mode:
        model = model.to_empty(device="cpu")
    for group in shared:   # to_empty gives each module its own copy: tie them again, as they were
        first_module, first_name = group[0]
        for module, name in group[1:]:
            module._parameters[name] = first_module._parameters[first_name]
    if hasattr(model, "tie_weights"):
        cast(Any, model).tie_weights()   # a transformers model's own method
    return model


def shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, name) slots that hold one parameter object, for each parameter held in more than one (tied
    weights such as `out.weight = emb.weight`)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, name))
    return [group for group in slots.values() if len(group) > 1]


KEPT_WORKLOADS = 8   # reusing_traces keeps the traces of this many workloads (a candidate's, in the planner)


@dataclass
class _Kept:
    """What reusing_traces keeps of one workload (its micro-batch and allocator settings left out)."""

    runs: dict[tuple[int | None, int, int], _Run] = field(default_factory=dict)   # by (depth, rank, micro-batch)
    depth_checked_at: int | None = None   # the micro-batch at which its line in depth was checked on a third trace


_kept: OrderedDict[str, _Kept] | None = None


@contextmanager
def reusing_traces():
    """While open, traced estimates keep their traces: a workload traced at two micro-batches is read at a third off
    them (batch_interpolation.py); once its peak was checked linear in depth at one micro-batch, the others trace the
    shallowest and deepest of the three depths only (the middle one is the check); and a workload that differs only
    in allocator settings (which leave its tensors alone) is not traced again. The planner opens it around a search,
    which sizes each candidate's micro-batches in turn."""
    global _kept
    outer, _kept = _kept, OrderedDict()
    try:
        yield
    finally:
        _kept = outer


def _kept_for(workload: ResolvedWorkload, gpu: GPU | None) -> _Kept | None:
    if _kept is None:
        return None
    plain = workload.to_json()
    plain.pop("batch_size")
    plain["techniques"] = [t for t in plain["techniques"] if "allocator-only" not in parse_technique(t).traits]
    key = json.dumps([plain, gpu.name if gpu else None], sort_keys=True)
    kept = _kept.pop(key, None) or _Kept()
    _kept[key] = kept   # the most recent last
    while len(_kept) > KEPT_WORKLOADS:
        _kept.popitem(last=False)
    return kept


def _trace(workload: ResolvedWorkload, gpu: GPU | None, num_layers: int | None, rank: int = 0,
           kept: _Kept | None = None) -> _Run:
    """The step's trace at this depth and rank: traced, or read off what `kept` holds (reusing_traces)."""
    if kept is None:
        return _trace_once(workload, gpu, num_layers, rank)
    key = (num_layers, rank, workload.batch_size)
    if key not in kept.runs:
        kept.runs[key] = _read_off(kept.runs, *key) or _trace_once(workload, gpu, num_layers, rank)
    return kept.runs[key]


def _read_off(runs: dict[tuple[int | None, int, int], _Run], num_layers: int | None, rank: int,
              batch: int) -> _Run | None:
    """The run at `batch` read off the first two traced at this depth and rank, or None when they cannot be."""
    traced = sorted(m for (n, r, m), run in runs.items() if (n, r) == (num_layers, rank) and run.read_off is None)
    if len(traced) < 2:
        return None
    a, b = (runs[num_layers, rank, m] for m in traced[:2])
    try:
        trace = interpolate(a.trace, traced[0], b.trace, traced[1], batch)
    except NotInterpolable:
        return None
    return replace(b, trace=trace, read_off=(traced[0], traced[1]))


def _trace_once(workload: ResolvedWorkload, gpu: GPU | None, num_layers: int | None, rank: int = 0) -> _Run:
    if workload.layout:
        with fake_process_group(workload.world_size, rank):
            return _trace_rank(workload, gpu, num_layers)
    return _trace_rank(workload, gpu, num_layers)


@contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """Rank `rank` of `world_size` ranks, in this process: collectives return fake tensors of the right shape."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise MemfitError("a traced estimate of a distributed workload starts its own fake process group; "
                          "run it outside torchrun.")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trace_rank(workload: ResolvedWorkload, gpu: GPU | None, num_layers: int | None,
                tracker: MemoryTracker | None = None) -> _Run:
    """`tracker`: one that records more (graph_recording.GraphTracker: the autograd graph too), rounding as
    `tracking_granularity(gpu)`."""
    source = workload.source
    precision = get_precision(workload.precision)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake(workload, num_layers, fake_mode)
    with fake_mode:
        batch = source.make_batch(batch_size=workload.batch_size, seq_len=workload.effective_seq_len,
                                  task=workload.task, dtype=precision.param_dtype)
        tracker = tracker or MemoryTracker(round_to=tracking_granularity(gpu))
        tracker.watch_model(model)
        tracker.watch(tensors_in(batch), "inputs")
        # a rank that holds a run of the blocks drops the others: holding the whole stack would keep them alive
        split = workload.with_trait("splits-blocks") is not None
        stacks = [] if split else repeated_stacks(model, num_layers or source.num_layers)
        tracker.watch_stacks(stacks)
        device_kernels = (CudaKernels(gpu.compute_capability, workload.source.attention_kernel) if gpu
                          else KernelScratchProbe())
        with FakeKernelFixes(), tracker, real_data_decisions(), device_kernels:
            setup = prepare_step(model, workload, device_type="cpu", default_impl=device_default_impl(bool(gpu)),
                                 autocast=CudaAutocast if gpu else None)
            run_workload(setup, batch, workload, head=source.head, hooks=tracker,
                         before_measured_step=tracker.begin_measured_step, trace_safe=True)
    return _Run(tracker.trace(), model, stacks, getattr(device_kernels, "probed", set()),
                getattr(device_kernels, "skipped", set()))


def tracking_granularity(gpu: GPU | None) -> int:
    """What a trace rounds each storage up to: the CUDA caching allocator's block on a GPU target."""
    return CUDA_ALLOCATION_ROUND_BYTES if gpu else 1


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@contextmanager
def older_objects_frozen():
    """A trace collects garbage between its warm-up and measured steps (steps/runner.py); objects older than the
    estimate are left out of those collections (gc.freeze), which would otherwise scan every object the process
    holds: a quarter of a trace's time once torch and transformers are imported. They are unfrozen after."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


DECODE_STEPS_TRACED = 4   # a longer generation traces this many decode steps and reads the rest off them


def traced_estimate(workload: Workload, gpu: GPU | None = None, *, full_trace: bool = False,
                    modules: bool = False, timeline: bool = False) -> MemoryEstimate:
    workload = resolve(workload)
    failed = None
    with older_objects_frozen():
        if not (full_trace or timeline) and _decode_steps_linear(workload):
            try:
                return _traced_estimate(workload, gpu, full_trace=False, modules=modules, timeline=False,
                                        decode_steps=DECODE_STEPS_TRACED)
            except NotLinear as exc:
                failed = f"the decode steps' extension failed ({exc}); traced every step instead"
        estimate = _traced_estimate(workload, gpu, full_trace=full_trace, modules=modules, timeline=timeline)
    estimate.notes[:0] = [failed] if failed else []
    return estimate


def _decode_steps_linear(workload: ResolvedWorkload) -> bool:
    """A generation longer than the steps traced whose cache grows by a token every step: none of its sliding windows
    fills up partway through (a window the prompt already fills stays as it is)."""
    source = workload.source
    if workload.task != "inference" or workload.new_tokens <= DECODE_STEPS_TRACED or not source.is_hf or (
            source.head not in ("causal-lm", "seq2seq-lm")):
        return False
    prompt = workload.seq_len or 0
    return not any(w and prompt < w <= prompt + workload.new_tokens for w in source.shape.windows)


def _traced_estimate(workload: ResolvedWorkload, gpu: GPU | None, *, full_trace: bool, modules: bool,
                     timeline: bool, decode_steps: int | None = None) -> MemoryEstimate:
    """`decode_steps`: trace that many of the generation's decode steps and extend them (extrapolate.extend_decode)."""
    requested = workload
    if decode_steps:
        workload = resolve(replace(workload, new_tokens=decode_steps))
    if workload.engine != "pytorch":
        raise MemfitError("--method traced runs PyTorch's own step; --engine deepspeed is modelled by "
                          "--method analytic.")
    started = time.perf_counter()
    source = workload.source
    weights, divisor, notes = state_weights(workload, traced=True)
    if gpu:   # a paged optimizer's states live in unified memory there, outside the allocator (estimate.paged_bytes)
        weights = {**weights, "paged": 0}
    # a step not linear in depth (pipeline stages split the blocks by rank) is traced at full depth
    whole = timeline or full_trace or not all(t.depth_linear for t in workload.technique_configs)
    layers = source.num_layers   # a live custom module counts its blocks on a meta copy: once
    depths = None if whole else extrapolation_depths(layers, source.layer_period)
    regions: dict[tuple[str, int], RegionPeak] | None = None
    run: _Run | None = None
    runs: dict[int, _Run] | list[_Run]   # by depth (extrapolated), else by rank (every layer traced)
    sampled_depth: int | None
    kept = _kept_for(workload, gpu)
    checked_at = kept.depth_checked_at if kept else None
    if depths and checked_at is not None:
        depths = [depths[0], depths[-1]]
    if depths and not source.is_hf:   # a custom module cut to its first blocks may not run (a forward that counts them)
        try:
            runs = {n: _trace(workload, gpu, n, kept=kept) for n in depths}
        except Exception as exc:   # the whole model is traced below, and raises what is really wrong
            notes.append(f"the first {depths[0]} blocks alone did not run ({type(exc).__name__}); traced every "
                         "layer instead")
            depths = None
    elif depths:
        runs = {n: _trace(workload, gpu, n, kept=kept) for n in depths}
    if depths:
        assert layers is not None and isinstance(runs, dict)   # depths come from a layer count, runs by depth
        try:
            samples = {n: region_peaks(r.trace, source.layer_period, weights) for n, r in runs.items()}
            host_bytes = extrapolate_host({n: r.trace.host_peaks() for n, r in runs.items()}, layers)
            paged_bytes = extrapolate_host({n: {"paged": r.trace.paged_bytes()} for n, r in runs.items()},
                                           layers)
            regions = extrapolate(samples, layers)
            sampled_depth = depths[-1]
            check = (f"checked exactly on a third depth at micro-batch {checked_at}" if checked_at is not None
                     else "checked exactly on the middle one")
            notes.append(f"traced {', '.join(map(str, depths))} of {layers} layers and extrapolated (linear in depth, "
                         f"{check})")
            run = runs[depths[-1]]
            if kept and checked_at is None:
                kept.depth_checked_at = workload.batch_size
        except NotLinear as exc:
            notes.append(f"extrapolation check failed ({exc}); traced every layer instead")
    if regions is None:
        runs = [_trace(workload, gpu, None, rank, kept) for rank in ranks_to_estimate(workload, "traced")[0]]
        by_rank = [region_peaks(r.trace, WHOLE_RUN, weights) for r in runs]
        highest = max(range(len(runs)), key=lambda i: peak_of(by_rank[i])[0].total)
        run, regions = runs[highest], by_rank[highest]
        sampled_depth = None
        if len(runs) > 1:
            notes.append(f"traced each of {len(runs)} ranks; rank {highest} has the highest peak")
        host_bytes = max(run.trace.host_peaks().values())
        paged_bytes = run.trace.paged_bytes()
    assert run is not None   # traced above, at one of the depths or at full depth
    if run.read_off:
        notes.append(f"every allocation read off the traces at micro-batches {run.read_off[0]} and {run.read_off[1]} "
                     "(each the same or in proportion to the micro-batch: batch_interpolation.py)")
    if run.probed:
        notes.append("CPU kernel scratch probed on real tensors of the same shapes: " + ", ".join(sorted(run.probed)))
    if run.skipped:
        notes.append("CPU kernel scratch not probed (operands over 1 GiB): " + ", ".join(sorted(run.skipped)))
    if decode_steps:
        regions = extend_decode(regions, decode_steps, requested.new_tokens)
        notes.append(f"traced {decode_steps} of {requested.new_tokens} decode steps and extended the last to the "
                     "longest cache (linear in the step, checked exactly on the middle one)")
    top, components, _ = peak_of(regions)
    at_peak = per_rank(top.at_max, divisor)
    component_peaks = per_rank(components, divisor)
    full_model = source.build(device="meta", dtype=get_precision(workload.precision).param_dtype)
    estimate = MemoryEstimate(
        model=source.name, num_parameters=count_parameters(full_model), workload=requested.to_json(),
        method="traced", device=gpu.name if gpu else "cpu", peak_bytes=sum(at_peak.values()),
        peak_phase=top.phase, at_peak=at_peak, component_peaks=component_peaks,
        model_state_bytes={k: component_peaks[k] for k in MODEL_STATE_CATEGORIES}, host_bytes=host_bytes,
        sources={name: "traced" for name in CATEGORIES}, notes=notes,
    )
    if gpu:
        estimate.paged_bytes = paged_bytes
        start_reserved = None
        if sampled_depth:   # the cache the set-up leaves grows with depth: gpu_overhead.predict_reserve
            assert layers is not None and isinstance(runs, dict)   # extrapolated: from a layer count, runs by depth
            settings = allocator_settings(workload)
            start_reserved = extend_roughly(
                {n: replay(r.trace.allocations(weights, divisor), settings).start_reserved_bytes
                 for n, r in runs.items()}, layers)
        add_gpu_overheads(estimate, gpu, workload, run.trace.allocations(weights, divisor),
                          f"the step at {sampled_depth} layers" if sampled_depth else None, start_reserved)
    if modules:
        estimate.modules = module_rows(run.trace, run.model, run.stacks, layers)
    if timeline:
        estimate.timeline = timeline_of(run.trace)
    estimate.elapsed_s = time.perf_counter() - started
    return estimate
