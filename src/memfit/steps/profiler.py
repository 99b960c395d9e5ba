"""PyTorch's profiler as the independent witness of a CPU run: allocator events and its own categories.

The CPU allocator reports every allocation and free made while the profiler records memory; the
running sum of those events over the step, on top of what was alive before it, is the measured
peak. PyTorch's memory timeline (torch.profiler._memory_profiler, private API pinned to torch 2.13)
also assigns its own categories; memfit reports them beside its own so that the two can be compared.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

# PyTorch's memory-timeline categories, in memfit's vocabulary.
PROFILER_CATEGORY = {
    "PARAMETER": "parameters", "OPTIMIZER_STATE": "optimizer_states", "INPUT": "inputs",
    "TEMPORARY": "temporaries", "ACTIVATION": "activations", "GRADIENT": "gradients",
    "AUTOGRAD_DETAIL": "temporaries", None: "unknown",
}


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence what the profiler's native code prints on start and stop (it writes to fd 2 directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def start_profiler(*, categories: bool = False) -> profile:
    """Record the CPU allocator's events; with `categories`, also the shapes and stacks PyTorch's memory timeline
    needs to categorise them (`timeline_categories_at_peak`: a few times slower)."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=categories,
                   with_stack=categories)
    with quiet_native_stderr():
        prof.start()
    return prof


def stop_profiler(prof: profile) -> None:
    with quiet_native_stderr():
        prof.stop()


PHASE_MARK = "memfit.phase."


def mark_phase(name: str) -> None:
    """An instant in the profiler's clock where a phase starts (read back by allocation_peak)."""
    with torch.profiler.record_function(PHASE_MARK + name):
        pass


def allocator_events(prof: profile) -> tuple[list[tuple[int, int]], list[tuple[int, str]]]:
    """The CPU allocator's (time, +bytes | -bytes) events and the phase marks, each in time order."""
    from torch.profiler._memory_profiler import OpTree, _EventType

    events, marks = [], []
    assert prof.profiler is not None and prof.profiler.kineto_results is not None   # the profiler ran and stopped
    for e in OpTree(prof.profiler.kineto_results).dfs():   # the raw event tree: no data-flow analysis needed
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
            events.append((e.start_time_ns, e.typed[1].alloc_size))
        elif e.typed[0] == _EventType.TorchOp and e.name.startswith(PHASE_MARK):   # other names may not decode
            marks.append((e.start_time_ns, e.name[len(PHASE_MARK):]))
    return sorted(events), sorted(marks)


def allocation_peak(prof: profile) -> tuple[int, str | None, dict[str, int], int]:
    """(highest running sum of allocator events, the phase it falls in, each phase's highest running sum,
    number of events). Phases come from the marks left by `mark_phase`."""
    events, marks = allocator_events(prof)
    running = peak = 0
    peak_phase, phase, next_mark = None, None, 0
    phase_peaks: dict[str, int] = {}
    for time_ns, delta in events:
        while next_mark < len(marks) and marks[next_mark][0] <= time_ns:
            phase = marks[next_mark][1]
            next_mark += 1
        running += delta
        if phase is not None:
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), running)
        if running > peak:
            peak, peak_phase = running, phase
    return peak, peak_phase, phase_peaks, len(events)


def timeline_categories_at_peak(prof: profile) -> tuple[int, dict[str, int]]:
    """The profiler's memory timeline at its own peak: (total, bytes per memfit category)."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    try:
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    except AssertionError:   # its data-flow analysis rejects some in-place storage tricks (FSDP2's resize_)
        return 0, {}
    if not sizes:
        return 0, {}
    row = max(sizes, key=lambda r: sum(r[1:]))
    by_category: dict[str, int] = {}
    for category, index in _CATEGORY_TO_INDEX.items():
        name = PROFILER_CATEGORY[category.name if category is not None else None]
        by_category[name] = by_category.get(name, 0) + int(row[index + 1])
    return sum(by_category.values()), by_category
