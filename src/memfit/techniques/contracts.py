"""What a technique's hooks may use of the objects higher layers hand them: each is a `typing.Protocol` naming the
members a hook reads or calls, so that the type checker holds both sides (a hook reaching for anything else, or a
higher layer's object missing a member, is an error in `scripts/test.sh`'s mypy run).

  AnalyticProgram   the analytic estimator's step being built (estimators/analytic/program.py `Program`):
                    `analytic_model`, `analytic_weights`, `analytic_buffers`, `analytic_train`
  CostCompute       one micro-step's work in the step-time model (planner/cost.py `Compute`): `cost_compute`
  CostStep          the step being timed (planner/cost.py `Step`): `cost_overhead`
  PlanQuery         what the planner is asked (planner/request.py `PlanRequest`): `search_values`
  OomMessage, OomSnapshot
                    what an OOM message and a memory snapshot say (measurement/oom.py): `oom_fix`

A new need of one technique is a member added here, with the consumer that provides it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from memfit.core.weight_formats import WeightFormat
    from memfit.specs.hardware import GPU
    from memfit.techniques.resolve import ResolvedWorkload


class AnalyticProgram(Protocol):
    workload: ResolvedWorkload
    num_layers: int
    rank: int

    def declare_teacher(self, student_layers: int, *, int8: bool = False) -> None: ...
    def quantize_linears(self, fmt: WeightFormat) -> None: ...
    def fake_quantize_linears(self) -> None: ...
    def add_adapters(self, rank: int, targets: tuple[str, ...]) -> None: ...
    def keep_stage(self, *, first: bool, last: bool) -> None: ...
    def hold_gradient_buckets(self, copies: int) -> None: ...
    def hold_master_weights(self) -> None: ...
    def pipeline_schedule(self, schedule: str, microbatches: int, stage: int, stages: int) -> None: ...


class CostCompute(Protocol):
    forward: float
    backward: float
    shape: Any               # planner/cost.py StepShape: layers, hidden, vocab
    tokens: int
    world_size: int
    recompute: float
    recompute_cheap: float
    split: int
    factor: float
    bubble: float
    fused: bool
    graphs: bool


class CostStep(Protocol):
    workload: ResolvedWorkload
    estimate: Any            # estimators/breakdown.py MemoryEstimate: host_bytes, nvme_bytes, paged_out_bytes
    cost: Any                # planner/cost.py CostModel: its constants
    @property
    def compute(self) -> CostCompute: ...
    accum: int
    num_gpus: int
    parameter_tensors: int
    work_s: float
    parts: dict[str, float]

    def add(self, part: str, seconds: float) -> None: ...
    def group_link_bytes_per_s(self, ranks: int) -> float: ...
    @property
    def pcie_bytes_per_s(self) -> float: ...
    @property
    def host_step_bytes_per_s(self) -> float: ...
    @property
    def nvme_bytes_per_s(self) -> float: ...
    @property
    def hbm_bytes_per_s(self) -> float: ...
    @property
    def activation_bytes(self) -> int: ...
    @property
    def gradient_bytes(self) -> int: ...
    def state_bytes(self, category: str) -> int: ...
    def optimizer_s(self, gradient_bytes: float, state_bytes: float) -> float: ...
    def backward_share(self, compute_s: float) -> float: ...
    def sharded_gathers_s(self, gathers: int) -> float: ...
    def gradient_all_reduce_s(self, gradient_bytes: float) -> float: ...
    def activation_host_bytes(self) -> int: ...


class PlanQuery(Protocol):
    @property
    def gpu(self) -> GPU: ...
    @property
    def num_gpus(self) -> int: ...
    @property
    def on_cpu(self) -> bool: ...
    @property
    def task(self) -> str: ...


class OomMessage(Protocol):
    @property
    def reserved_unallocated_bytes(self) -> int | None: ...


class OomSnapshot(Protocol):
    @property
    def by_category(self) -> dict[str, int]: ...
    @property
    def fragmentation_bytes(self) -> int: ...
