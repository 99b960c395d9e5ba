"""`memfit plan --instance any`: one request planned on every priced machine of the catalog, the machines that fit
ranked by what a million tokens cost on them (their list price over the best plan's throughput)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

from memfit.planner.planning import plan
from memfit.planner.request import PlanRequest
from memfit.planner.result import SCHEMA, PlanResult
from memfit.specs.instances import Instance


@dataclass
class InstanceRanking:
    results: list[PlanResult]      # one per machine: those that fit, cheapest per token first, then the rest
    unpriced: list[str]            # machines left out: no list price
    elapsed_s: float = 0.0

    @property
    def fitting(self) -> list[PlanResult]:
        return [r for r in self.results if r.feasible]

    def to_json(self) -> dict:
        fitting = self.fitting
        first = self.results[0].request.to_json() if self.results else {}
        request = {**first, "instance": "any", "gpu": None, "num_gpus": None, "host_ram_bytes": None}
        return {"schema": SCHEMA, "feasible": bool(fitting),
                "reason": None if fitting else "no priced instance fits this request (see instances)",
                "plans": [r.plan_json(0) for r in fitting], "suggestions": [], "warnings": [], "request": request,
                "instances": [{"instance": cast(Instance, r.request.instance).name, "gpu": r.request.gpu.name,
                               "gpus": r.request.num_gpus, "fits": r.feasible, "reason": r.reason}
                              for r in self.results],
                "unpriced": self.unpriced,
                "search": {"instances_planned": len(self.results), "elapsed_s": round(self.elapsed_s, 3)}}


def plan_on_instances(request_for: Callable[[Instance], PlanRequest], instances: list[Instance],
                      progress: Callable[[str], None] | None = None) -> InstanceRanking:
    """The best plan of `request_for(instance)` on each priced instance. Machines alike in GPU, count and host RAM
    share one search."""
    started = time.perf_counter()
    priced = [i for i in instances if i.usd_per_hour is not None]
    done: dict[tuple, PlanResult] = {}
    results = []
    for index, instance in enumerate(priced):
        request = replace(request_for(instance), top=1)
        key = (request.gpu.name, request.num_gpus, request.host_ram_bytes)
        if key not in done:
            if progress:
                progress(f"planning on {instance.name} ({index + 1}/{len(priced)}) ...")
            done[key] = plan(request, brief=True)
        results.append(replace(done[key], request=request))
    fitting = sorted((r for r in results if r.feasible), key=lambda r: r.plan_json(0)["usd_per_million_tokens"])
    rest = [r for r in results if not r.feasible]
    return InstanceRanking(fitting + rest, [i.name for i in instances if i.usd_per_hour is None],
                           elapsed_s=time.perf_counter() - started)
