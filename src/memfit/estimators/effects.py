"""What a technique does to an estimate: `effect` (the estimate with the technique added) and the
leave-one-out savings that `memfit estimate -t ...` prints for each technique it was given.

Memory comes from the estimator (analytic by default: milliseconds, what the planner calls); the
step-time factor is the step-time model's (the step with it over the step without it) where the caller times
both (a plan's savings), else the technique's own figure, labelled `assumed`. A lossy technique's accuracy cost is what
benchmarks/accuracy_costs.py and technique_table.py --part 2 measured, with its model and data named.
"""
from __future__ import annotations

import functools
import json
from importlib import resources

from memfit.core.errors import MemfitError
from memfit.estimators import estimate as run_estimate
from memfit.estimators.breakdown import MemoryEstimate
from memfit.specs.workload import Workload
from memfit.techniques.base import Technique, parse_technique
from memfit.techniques.resolve import all_techniques, resolve, with_technique, without_technique


def effect(technique: Technique | str, estimate: MemoryEstimate, workload: Workload, *, gpu=None,
           method: str = "analytic") -> MemoryEstimate:
    """The estimate of `workload` with `technique` added (`estimate` is the one without it): bytes per
    category, and in `extra["effect"]` the bytes saved, the host RAM added, the step-time factor and
    the accuracy-risk label."""
    technique = parse_technique(technique) if isinstance(technique, str) else technique
    changed = run_estimate(with_technique(workload, technique), method=method, gpu=gpu)
    changed.extra["effect"] = describe(technique, without=estimate, with_it=changed)
    return changed


def describe(technique: Technique, *, without: MemoryEstimate, with_it: MemoryEstimate,
             time_factor: float | None = None) -> dict:
    """Device bytes saved, host RAM added (offload), the step-time factor and the risk label. `time_factor`: the
    step-time model's (planner/cost.py: the step with the technique over the step without it), where the caller
    timed both; else the technique's own assumed factor."""
    return {"technique": technique.spec, "risk": technique.risk,
            "saved_bytes": int(without.peak_bytes - with_it.peak_bytes),
            "host_bytes": int(with_it.host_bytes - without.host_bytes),
            "time_factor": technique.step_time_factor() if time_factor is None else time_factor,
            "time_factor_source": "assumed" if time_factor is None else "modelled",
            "accuracy": measured_accuracy(technique)}


def measured_accuracy(technique: Technique) -> list[dict] | None:
    """The technique's measured accuracy costs, one per subject, each with its source (model, data, command;
    benchmarks/accuracy_costs.py and technique_table.py --part 2 write them), or None where none was measured."""
    return _accuracy_costs().get(technique.spec)


@functools.cache
def _accuracy_costs() -> dict[str, list[dict]]:
    """memfit's data file of measured accuracy costs, read once per process (`describe` runs per estimate)."""
    return json.loads(resources.files("memfit.data").joinpath("accuracy.json").read_text())


def leave_one_out(workload: Workload, full: MemoryEstimate, *, gpu=None, method: str = "analytic") -> list[dict]:
    """For each technique in the workload: the peak without it, minus the peak with everything. A technique
    the others need (removing it breaks a rule) has no row."""
    workload = resolve(workload)
    rows = []
    for technique in all_techniques(workload):
        try:
            without = run_estimate(without_technique(workload, technique), method=method, gpu=gpu)
        except MemfitError:   # e.g. fsdp2 under cpu-offload: without it, offload would meet DDP's rule
            continue
        rows.append(describe(technique, without=without, with_it=full) | {"method": method})
    return rows
