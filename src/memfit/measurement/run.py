"""`measure`: run the workload for real and report its peak beside memfit's estimates.

On CPU the peak is the CPU allocator's own account (via the profiler); on CUDA it is
`max_memory_allocated`, with `max_memory_reserved` and an optional memory snapshot for
PyTorch's memory_viz. Categories come from tracking the same real run's tensor storages; bytes
the allocator saw but no tensor accounts for (kernel scratch) are reported as temporaries.
"""
from __future__ import annotations

import time

import torch

from memfit.core.categories import CATEGORIES
from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision
from memfit.core.units import format_bytes
from memfit.core.versions import version_notes
from memfit.estimators import estimate as run_estimate
from memfit.estimators import methods_for
from memfit.estimators.breakdown import MemoryEstimate
from memfit.estimators.gpu_overhead import CUDA_ALLOCATION_ROUND_BYTES
from memfit.estimators.tracker import MemoryTracker
from memfit.measurement.ranks import measure_ranks_many
from memfit.specs.hardware import gpu_of_device
from memfit.specs.live import is_live
from memfit.specs.workload import Workload
from memfit.steps import profiler
from memfit.steps.deepspeed_loop import folder_bytes
from memfit.steps.hooks import tensors_in
from memfit.steps.runner import run_workload
from memfit.techniques.compose import prepare_step
from memfit.techniques.resolve import resolve


def available_ram_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def best_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _check_room(workload: Workload, expected_bytes: int, device: str) -> None:
    room = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else available_ram_bytes()
    if room is not None and expected_bytes > 0.8 * room:
        raise MemfitError(
            f"measuring {workload.model} would need about {format_bytes(expected_bytes)} on {device}, more than 80 % "
            f"of the {format_bytes(room)} free (the rest is kept for this process and the machine); use `memfit "
            "estimate` for a workload this size.")


class _PhaseMarks:
    """The tracker's hooks, plus a mark in the profiler's clock at every phase change (CPU runs)."""

    def __init__(self, tracker: MemoryTracker, state: dict) -> None:
        self.tracker, self.state = tracker, state

    def phase(self, name: str) -> None:
        self.tracker.phase(name)
        if "profiler" in self.state:
            profiler.mark_phase(name)

    def mark(self, category, tensors) -> None:
        self.tracker.mark(category, tensors)


def measure_run(workload: Workload, *, device: str | None = None, snapshot_path: str | None = None,
                expected_bytes: int = 0, profiler_categories: bool = False) -> MemoryEstimate:
    """One real run of the workload; no estimates (see `measure`). `profiler_categories`: on a CPU, also
    PyTorch's own memory-timeline categories at its peak, beside memfit's (an independent witness; the run
    records shapes and stacks for them, a few times slower)."""
    workload = resolve(workload)
    device = device or best_device()
    _check_room(workload, expected_bytes, device)
    started = time.perf_counter()
    source = workload.source
    precision = get_precision(workload.precision)
    torch.manual_seed(0)
    model = source.build(device=device, dtype=precision.param_dtype)
    batch = source.make_batch(batch_size=workload.batch_size, seq_len=workload.effective_seq_len,
                              task=workload.task, dtype=precision.param_dtype, device=device)
    num_parameters = sum(p.numel() for p in model.parameters())   # before sharding empties them
    on_cuda = device.startswith("cuda")
    tracker = MemoryTracker(round_to=CUDA_ALLOCATION_ROUND_BYTES if on_cuda else 1)
    tracker.watch_model(model)
    tracker.watch(tensors_in(batch), "inputs")
    state: dict = {}

    def before_measured_step() -> None:
        tracker.begin_measured_step()
        state["baseline"] = tracker.live_bytes()
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if snapshot_path:
                # Python stacks only: symbolising every C++ frame can take minutes at the dump
                torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        else:
            state["profiler"] = profiler.start_profiler(categories=profiler_categories)

    hooks = _PhaseMarks(tracker, state) if not on_cuda else tracker
    with tracker:
        setup = prepare_step(model, workload, device_type=device.split(":")[0])
        run_workload(setup, batch, workload, head=source.head, hooks=hooks, before_measured_step=before_measured_step)
    extra: dict = {}
    allocator_phase = None   # CPU: the phase the allocator's peak falls in (kernel scratch can move it)
    if on_cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        extra["max_memory_allocated"] = peak
        extra["max_memory_reserved"] = torch.cuda.max_memory_reserved()
        if snapshot_path:
            torch.cuda.memory._dump_snapshot(snapshot_path)
            torch.cuda.memory._record_memory_history(enabled=None)
            extra["snapshot"] = snapshot_path
    else:
        prof = state["profiler"]
        profiler.stop_profiler(prof)
        delta, allocator_phase, phase_peaks, num_events = profiler.allocation_peak(prof)
        peak = state["baseline"] + delta
        extra["phase_peak_bytes"] = {name: state["baseline"] + value for name, value in phase_peaks.items()}
        if profiler_categories:
            total, by_category = profiler.timeline_categories_at_peak(prof)
            extra["profiler_timeline_peak_bytes"] = total
            extra["profiler_categories_at_peak"] = by_category
        extra["allocator_events"] = num_events

    trace = tracker.trace()
    top, components, _ = trace.summary()
    at_peak = dict(top.at)
    # On CPU host and device share one allocator: the allocator's peak less the tracked peak (host
    # storages included) is the kernel scratch no tensor accounts for.
    tracked = top.total if on_cuda else trace.summary(include_host=True)[0].total
    untracked = max(peak - tracked, 0)
    at_peak["temporaries"] += untracked
    extra["untracked_bytes"] = untracked
    extra["tracked_peak_bytes"] = top.total
    estimate = MemoryEstimate(
        model=source.name, num_parameters=num_parameters,
        workload=workload.to_json(), method="measured", device=device, peak_bytes=sum(at_peak.values()),
        peak_phase=allocator_phase or top.phase, at_peak=at_peak, component_peaks=dict(components),
        model_state_bytes={k: components[k] for k in ("parameters", "gradients", "optimizer_states")},
        host_bytes=max(trace.host_peaks().values()),
        sources={name: "measured" for name in CATEGORIES},
        notes=["peak from the " + ("CUDA caching allocator" if on_cuda else "CPU allocator (profiler events)")
               + "; categories from tracking the same run's tensors", *version_notes("measure")],
        extra=extra,
    )
    if setup.swap_folder:   # NVMe offload: what this process's swap files hold after the step
        estimate.nvme_bytes = folder_bytes(setup.swap_folder)
    estimate.elapsed_s = time.perf_counter() - started
    return estimate


def measure(workload: Workload, *args, device: str | None = None, snapshot_path: str | None = None,
            estimates: tuple[str, ...] | None = None, profiler_categories: bool = False) -> MemoryEstimate:
    """Measure the workload for real and put memfit's estimates of the same run beside it (`measure_run`);
    `estimates`: the methods to run (default: every estimator that models the workload, `methods_for`)."""
    if not isinstance(workload, Workload):
        raise MemfitError(
            f"measure runs a Workload (got {type(workload).__name__}): it builds the model from its source and "
            "trains it, and never runs a live model or optimizer, which it would change. Name the model by "
            "package.module:function or path/file.py:function to measure it; a live model is estimated on a meta "
            "copy with memfit.estimate(model, batch, ...), and inside your trainer the callbacks of "
            "memfit.integrations measure its real steps.")
    if args:
        raise MemfitError("measure takes one Workload; its keywords are device, snapshot_path, estimates.")
    return measure_many([workload], device=device, snapshot_path=snapshot_path, estimates=estimates,
                        profiler_categories=profiler_categories)[0]


def measure_many(workloads: list[Workload], *, device: str | None = None, snapshot_path: str | None = None,
                 estimates: tuple[str, ...] | None = None,
                 profiler_categories: bool = False) -> list[MemoryEstimate]:
    """`measure` for each workload; those that run on ranks share torchrun launches (ranks.measure_ranks_many)."""
    resolved = [resolve(w) for w in workloads]
    if any(is_live(w.model) for w in resolved):
        raise MemfitError("measure builds and runs the model from its source; a live model is only estimated (on a "
                          "meta copy, memfit.estimate(model, batch)): name it by package.module:function or "
                          "path/file.py:function to measure it.")
    device = device or best_device()
    gpu = gpu_of_device(device) if device.startswith("cuda") else None
    predicted = [{method: run_estimate(w, method=method, gpu=gpu) for method in
                  (methods_for(w) if estimates is None else estimates)} for w in resolved]
    expected = [max((e.peak_bytes for e in p.values()), default=0) for p in predicted]
    on_ranks = [i for i, w in enumerate(resolved) if w.runs_on_ranks]
    if on_ranks and device.startswith("cuda"):
        raise MemfitError("measuring several ranks runs on CPU (gloo) here; pass --device cpu.")
    for i in on_ranks:
        _check_room(resolved[i], expected[i] * resolved[i].world_size, device)
    measured = dict(zip(on_ranks, measure_ranks_many([resolved[i] for i in on_ranks])))
    results = []
    for i, workload in enumerate(resolved):
        run = measured[i] if i in measured else measure_run(
            workload, device=device, snapshot_path=snapshot_path, expected_bytes=expected[i],
            profiler_categories=profiler_categories)
        run.extra["estimates"] = {method: e.to_json() for method, e in predicted[i].items()}
        run.extra["ratios"] = {f"measured/{method}": run.peak_bytes / e.peak_bytes
                               for method, e in predicted[i].items() if e.peak_bytes}
        results.append(run)
    return results
