"""Trace a few layers, predict many: the peak of a stack of identical layers is linear in depth.

A step's timeline is cut into regions per phase: the stretch before the first repeated layer,
the first `period` layers, the last `period` layers, the stretch after (and the same for every
further run of the stack, e.g. each decode step). Layers in the middle are never the maximum:
layer j's memory is c + s*j, so its maximum over j sits at the first or last layer. Every region's
maximum (the total and each category) is then a linear function of the number of layers n, and
three traces at n = 2p, 3p, 4p both fit the line and check it exactly before it is used (from 2p:
a first layer may differ from the rest, e.g. T5's, which computes the position bias). A planner that
checked a step's line at one micro-batch traces only 2p and 4p at its others (traced.reusing_traces).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from memfit.core.categories import CATEGORIES, zero_categories
from memfit.estimators.tracker import Trace


@dataclass
class RegionPeak:
    phase: str
    at_max: dict[str, int]       # categories at the region's highest total
    category_max: dict[str, int]  # each category's own maximum in the region

    @property
    def total(self) -> int:
        return sum(self.at_max.values())


def extrapolation_depths(layers: int | None, period: int, first: int = 2) -> list[int] | None:
    """The three depths to trace or simulate (`first`, `first` + 1 and `first` + 2 periods), or None when
    the whole stack is short enough to run."""
    if not layers or layers <= (first + 2) * period or layers % period:
        return None
    return [first * period, (first + 1) * period, (first + 2) * period]


class NotLinear(Exception):
    """The three short traces do not lie on a line; a full trace is needed."""


def _runs(starts: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Group (event, stack, layer) starts into runs: same stack, layers stepping by one."""
    runs: list[list[tuple[int, int, int]]] = []
    for item in starts:
        if runs:
            last = runs[-1][-1]
            same = item[1] == last[1] and abs(item[2] - last[2]) == 1
            direction_ok = len(runs[-1]) < 2 or (item[2] - last[2]) == (last[2] - runs[-1][-2][2])
            if same and direction_ok:
                runs[-1].append(item)
                continue
        runs.append([item])
    return runs


def region_bounds(trace: Trace, period: int) -> list[tuple[tuple[str, int], int, int]]:
    """[(key, first event, end event)], key = (phase, ordinal), in time order."""
    regions = []
    ordinals: dict[str, int] = {}   # a phase that recurs (each decode step) numbers its regions on
    for phase, begin, end in trace.phase_spans():
        starts = sorted((e, s, layer) for e, p, s, layer, kind in trace.block_marks
                        if kind == "start" and begin <= e < end and p == phase)
        ends = {(s, layer): e for e, p, s, layer, kind in trace.block_marks
                if kind == "end" and begin <= e <= end and p == phase}
        cursor, ordinal = begin, ordinals.get(phase, 0)
        for run in _runs(starts):
            run_end = max(ends.get((run[-1][1], run[-1][2]), run[-1][0]), run[-1][0])
            first_end = run[period][0] if len(run) > period else run_end
            regions.append(((phase, ordinal), cursor, run[0][0]))
            regions.append(((phase, ordinal + 1), run[0][0], first_end))
            regions.append(((phase, ordinal + 2), run[max(len(run) - period, 0)][0], run_end))
            ordinal += 3
            cursor = run_end
        regions.append(((phase, ordinal), cursor, end))
        ordinals[phase] = ordinal + 1
    return regions


def region_peaks(trace: Trace, period: int, weights: dict[str, int] | None = None) -> dict[tuple[str, int], RegionPeak]:
    bounds = region_bounds(trace, period)
    peaks = {key: RegionPeak(key[0], zero_categories(), zero_categories()) for key, _, _ in bounds}
    best = {key: -1 for key in peaks}
    for index, totals in trace.walk(weights):
        point = max(index, trace.start)   # the baseline belongs to the first region
        total = None
        for key, first, last in bounds:
            if not first <= point < last:
                continue
            total = sum(totals.values()) if total is None else total
            peak = peaks[key]
            if total > best[key]:
                best[key] = total
                peak.at_max = dict(totals)
            for name, value in totals.items():
                if value > peak.category_max[name]:
                    peak.category_max[name] = value
    return {key: peak for key, peak in peaks.items() if best[key] >= 0}


Regions = dict[tuple[str, int], RegionPeak]


def _line(samples: dict[int, dict[str, int]], layers: int, what: Callable[[str], str]) -> dict[str, int]:
    """Values at equally spaced depths (three: the middle one checks the line; two: a line already checked at
    another micro-batch, traced.reusing_traces), each extended to `layers` depth; `what(name)` names one in errors."""
    (n1, first), *_, (n3, last) = points = sorted(samples.items())
    intervals = len(points) - 1
    if (n3 - n1) % intervals or (layers - n1) % ((n3 - n1) // intervals):
        raise NotLinear(f"depths {', '.join(str(n) for n, _ in points)} -> {layers} are not on one grid")
    steps = (layers - n1) // ((n3 - n1) // intervals)
    predicted = {}
    for name, value in first.items():
        rise = last[name] - value
        if rise % intervals or any(x[name] != value + rise // intervals * i for i, (_, x) in enumerate(points)):
            raise NotLinear(f"{what(name)}: {', '.join(str(x[name]) for _, x in points)}")
        predicted[name] = value + rise // intervals * steps
    return predicted


def extrapolate(samples: dict[int, Regions], layers: int) -> Regions:
    """From region peaks at equally spaced depths (see _line), the region peaks at `layers` depth."""
    regions = list(samples.values())
    if any(set(r) != set(regions[0]) for r in regions):
        raise NotLinear("the step's structure changes with depth")
    result = {}
    for key, region in regions[0].items():
        vectors = [_line({n: getattr(r[key], attr) for n, r in samples.items()}, layers,
                         cast("Callable[[str], str]", lambda name, attr=attr, key=key: f"{attr}[{name}] in {key}"))
                   for attr in ("at_max", "category_max")]
        result[key] = RegionPeak(region.phase, vectors[0], vectors[1])
    return result


def extend_decode(regions: Regions, traced: int, steps: int) -> Regions:
    """Region peaks of a generation traced for `traced` decode steps (each step its own regions, in order) as if it
    ran `steps`: each region of the last three steps lies on a line in the step, as the cache grows by a token a step
    (the middle step checks it); the last traced step's regions follow their line to step `steps`. The steps before
    stay: on a line the highest is the first or the last."""
    keys = sorted(key for key in regions if key[0] == "decode")
    per_step = len(keys) // traced
    if traced < 3 or per_step * traced != len(keys):
        raise NotLinear("the decode steps differ in structure")
    by_step = [keys[i * per_step:(i + 1) * per_step] for i in range(traced)]
    result = dict(regions)
    for j, last_key in enumerate(by_step[-1]):
        samples = {step: regions[by_step[step - 1][j]] for step in range(traced - 2, traced + 1)}
        vectors = [_line({step: getattr(r, attr) for step, r in samples.items()}, steps,
                         cast("Callable[[str], str]", lambda name, attr=attr: f"{attr}[{name}] in decode step"))
                   for attr in ("at_max", "category_max")]
        result[last_key] = RegionPeak("decode", vectors[0], vectors[1])
    return result


def extrapolate_host(samples: dict[int, dict[str, int]], layers: int) -> int:
    """Host RAM (offload) at `layers` depth: each phase's peak extended as the region peaks are (see _line), then the
    largest (the phase that holds the most changes with depth)."""
    phases = list(samples.values())
    if any(set(p) != set(phases[0]) for p in phases):
        raise NotLinear("the step's phases change with depth")
    return max(_line(samples, layers, lambda phase: f"host RAM in {phase}").values(), default=0)


def extend_roughly(samples: dict[int, int], layers: int) -> int:
    """A figure close to linear in depth but not exactly so (the caching allocator's reserved bytes: segments round
    it) extended to `layers` along the line through the two deepest samples; never below zero."""
    (n1, first), (n2, last) = sorted(samples.items())[-2:]
    return max(0, last + (last - first) * (layers - n2) // (n2 - n1))


def peak_of(regions: dict[tuple[str, int], RegionPeak]) -> tuple[RegionPeak, dict[str, int], dict[str, int]]:
    """(the peak region, component peaks, peak total per phase)."""
    top = max(regions.values(), key=lambda r: r.total)
    components = {name: max(r.category_max[name] for r in regions.values()) for name in CATEGORIES}
    phases: dict[str, int] = {}
    for region in regions.values():
        phases[region.phase] = max(phases.get(region.phase, 0), region.total)
    return top, components, phases
