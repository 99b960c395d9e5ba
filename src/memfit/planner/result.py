"""A plan result and its versioned JSON (schema "memfit.plan/1"), which `estimate --plan` and
`measure --plan` load back: each plan carries the exact workload that reproduces it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.core.errors import MemfitError
from memfit.planner.request import PlanRequest
from memfit.planner.search import Evaluated
from memfit.specs.hardware import GPU, get_gpu
from memfit.specs.workload import Workload

SCHEMA = "memfit.plan/1"


@dataclass
class PlanResult:
    request: PlanRequest
    plans: list[Evaluated]                     # best first
    reason: str | None = None                  # why nothing fits
    suggestions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)          # e.g. more host RAM than the GPU's usual host
    tradeoff: str | None = None       # what the fastest plan would gain, when plan 1 was preferred for changing less
    evaluated: list[Evaluated] = field(default_factory=list)   # every candidate sized (the Pareto plot)
    rejected: dict[str, int] = field(default_factory=dict)     # rule -> candidates it removed
    savings: list[list[dict]] = field(default_factory=list)    # per plan (the best): each technique's saving
    num_estimates: int = 0
    elapsed_s: float = 0.0

    @property
    def feasible(self) -> bool:
        return bool(self.plans)

    @property
    def memory_method(self) -> str:
        """The estimator the search sized plans with: analytic (a transformer config), traced (a custom model or the
        user's own step)."""
        return self.evaluated[0].estimate.method if self.evaluated else "analytic"

    def plan_json(self, index: int) -> dict:
        chosen = self.plans[index]
        estimate, workload = chosen.estimate, chosen.workload(self.request)
        data: dict[str, Any] = {
            "techniques": chosen.techniques, "micro_batch": chosen.micro_batch, "grad_accum": chosen.grad_accum,
            "world_size": chosen.candidate.num_gpus, "gpu": self.request.gpu.name, "peak_bytes": chosen.device_bytes,
            "host_ram_bytes": chosen.host_ram_bytes, "step_time_s": round(chosen.timed.total_s, 6),
            "throughput": round(chosen.throughput, 3), "accuracy_risk": chosen.risk,
            "training_change": chosen.change,
            # beyond the schema's required fields
            "throughput_unit": f"{workload.throughput_per_sample[1]}/s per GPU",
            "tensor_peak_bytes": estimate.peak_bytes, "overhead_bytes": chosen.device_bytes - estimate.peak_bytes,
            "headroom_bytes": self.request.gpu.memory_bytes - chosen.device_bytes,
            "peak_phase": estimate.peak_phase,
            "time_parts_s": {k: round(v, 6) for k, v in chosen.timed.parts.items()},
            "ppl_increase": chosen.ppl_increase,
            **({"ppl_source": chosen.ppl_source} if chosen.ppl_source else {}),
            "sources": {"memory": estimate.method, "time": self.request.cost.source},
            "workload": workload.to_json(),
        }
        if estimate.reserved_bytes is not None:   # a GPU target: what the plan's fit was judged on
            data["reserved_bytes"] = estimate.reserved_bytes
        if estimate.paged_bytes:
            data["paged_bytes"] = estimate.paged_bytes
        if estimate.nvme_bytes:   # per GPU, on the node's local drive
            data["nvme_bytes"] = estimate.nvme_bytes
        if "traced_peak_bytes" in estimate.extra:
            data["traced_peak_bytes"] = estimate.extra["traced_peak_bytes"]
        if self.request.instance is not None:
            data |= instance_price(self.request, chosen.throughput)
        if index < len(self.savings):
            data["savings"] = self.savings[index]
        return data

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "feasible": self.feasible, "reason": self.reason,
                "plans": [self.plan_json(i) for i in range(len(self.plans))],
                "suggestions": self.suggestions, "warnings": self.warnings, "tradeoff": self.tradeoff,
                "request": self.request.to_json(),
                "search": {"candidates_sized": len(self.evaluated), "estimates": self.num_estimates,
                           "estimator": self.memory_method,
                           "rejected_by_rules": sum(self.rejected.values()), "elapsed_s": round(self.elapsed_s, 3)}}


def instance_price(request: PlanRequest, throughput_per_gpu: float) -> dict:
    """The plan's price on its instance: per hour for the machines, per million tokens at its throughput."""
    usd = request.usd_per_hour
    tokens_per_hour = throughput_per_gpu * request.num_gpus * 3600
    instance = request.instance
    assert instance is not None   # priced only for a request on an instance (plan_json)
    return {"instance": instance.name, "usd_per_hour": usd,
            "usd_per_million_tokens": float(f"{usd / tokens_per_hour * 1e6:.4g}") if usd and tokens_per_hour else None,
            "price": instance.price_json()}


def load_plan(path: str, index: int = 0) -> tuple[Workload, GPU]:
    """The workload and target GPU of plan `index` (0: the best) in a saved `memfit plan --save` file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MemfitError(f"--plan {path!r}: no such file; write one with `memfit plan ... --save {path}`.") from None
    except json.JSONDecodeError as exc:
        raise MemfitError(f"--plan {path!r} is not JSON ({exc.msg} at line {exc.lineno}).") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise MemfitError(f"--plan {path!r} is not a {SCHEMA} file (schema "
                          f"{data.get('schema') if isinstance(data, dict) else None!r}).")
    plans = data.get("plans") or []
    if not plans:
        raise MemfitError(f"--plan {path!r} has no plan that fits ({data.get('reason')}).")
    if not 0 <= index < len(plans):
        raise MemfitError(f"--plan-index {index}: {path!r} holds plans 0 to {len(plans) - 1}.")
    gpu = get_gpu(plans[index].get("gpu") or data["request"]["gpu"])
    memory = data["request"].get("gpu_memory_bytes")   # the total planned for (--gpu-memory), where recorded
    return Workload.from_json(plans[index]["workload"]), gpu if memory in (None, gpu.memory_bytes) else \
        gpu.with_memory(memory)
