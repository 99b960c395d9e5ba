"""The search space: every combination of techniques the planner may propose for a request.

A technique takes part by declaring the axis it is one value of (`search_axis`) and the configurations to try
(`search_values`); the space is the product of the axes (each may also stay empty), so a new technique joins it
without an edit here. One candidate is one way to run the step (precision, optimizer, techniques, how the GPUs
are used); the micro-batch is chosen later, per candidate, by the search. A combination the composition rules
or a technique's own check refuse never becomes a candidate: building its workload raises, and the search
records why. A lossy technique is tried only under `--allow lossy`, and at most one per candidate.

Left out on purpose (they declare no values): techniques that change what is computed rather than how
(truncate, sequence-chunks, sliding-window change the sequence the model sees; distillation trains another
model), and unstructured pruning (it saves no memory, measured).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

from memfit.core.precision import get_precision
from memfit.estimators import count_parameters, methods_for
from memfit.estimators.analytic.families.registry import has_family
from memfit.planner.request import PlanRequest
from memfit.specs.workload import Workload
from memfit.techniques import REGISTRY
from memfit.techniques.base import SEARCH_AXES, Technique, parse_technique
from memfit.techniques.resolve import ResolvedWorkload, resolve
from memfit.techniques.rules import ordered

if TYPE_CHECKING:
    from memfit.techniques.distributed import LayoutTechnique

FLOAT32_ROOM = 4   # float32 is searched on a GPU with bf16 when its model states fit this many times over
DEFAULTS = Workload.__dataclass_fields__


@dataclass(frozen=True)
class Candidate:
    precision: str
    optimizer: str = cast(str, DEFAULTS["optimizer"].default)
    techniques: tuple[str, ...] = ()
    world_size: int = 1          # ranks one step runs over (the Workload's)
    zero_stage: int = 0
    engine: str = "pytorch"
    data_parallel: int = 1       # copies of the model the batch is split over
    batch_multiple: int = 1      # the micro-batch must be a multiple of this (pipeline micro-batches)
    implied: tuple[str, ...] = field(default=(), compare=False)   # techniques the workload adds by itself

    def workload(self, request: PlanRequest, micro_batch: int) -> ResolvedWorkload:
        return resolve(Workload(model=request.model, inputs=request.inputs, step=request.step, task=request.task,
                                batch_size=micro_batch, seq_len=request.seq_len, new_tokens=request.new_tokens,
                                precision=self.precision,
                                optimizer=self.optimizer, world_size=self.world_size, zero_stage=self.zero_stage,
                                engine=self.engine, techniques=self.techniques))

    @property
    def num_gpus(self) -> int:
        return max(self.world_size, self.data_parallel)

    def labels(self) -> list[str]:
        """The plan's techniques as a user reads them: precision, optimizer and parallelism included."""
        names = [self.precision] + ([self.optimizer] if self.optimizer != DEFAULTS["optimizer"].default else [])
        if self.engine == "deepspeed":
            names.append(f"deepspeed-zero{self.zero_stage}")
        elif self.implied:
            names.append("+".join(self.implied) + ("+zero1" if self.zero_stage == 1 else ""))
        elif self.data_parallel > 1 and self.world_size == 1:
            names.append(f"{self.data_parallel} replicas")
        return names + list(self.techniques)


def searched(request: PlanRequest, base: ResolvedWorkload) -> dict[str, list[str]]:
    """Each axis's values: the configurations the registered techniques declare for this request (lossy ones only
    under --allow lossy, none the request excludes), in the canonical order; an axis of a technique the request
    requires holds that configuration alone."""
    values: dict[str, list[str]] = {axis: [] for axis in SEARCH_AXES + ("allocator",)}
    for technique in ordered(cls() for cls in REGISTRY.values()):
        if technique.search_axis is None or technique.name in request.exclude:
            continue
        for spec in technique.search_values(request, base):
            if request.allow == "lossy" or parse_technique(spec).risk != "lossy":
                values[technique.search_axis].append(spec)
    values.update(required(request)[0])
    return values


def required(request: PlanRequest) -> tuple[dict[str, list[str]], tuple[str, ...]]:
    """The request's required techniques: by the axis each is a value of (`-t lora:rank=8` replaces the searched
    LoRA configurations, and a plan without LoRA), and those the planner does not search (no axis), which every
    candidate gets."""
    axes: dict[str, list[str]] = {}
    unsearched = []
    for spec in request.techniques:
        axis = parse_technique(spec).search_axis
        if axis is None:
            unsearched.append(spec)
        else:
            axes.setdefault(axis, []).append(spec)
    return axes, tuple(unsearched)


def _precisions(request: PlanRequest, values: list[str], base: ResolvedWorkload) -> list[str]:
    """The precision techniques' values, and the default (fp32) where half precision has no bf16 (on GPUs without
    it, and on CPUs, which run float32 fastest more often than not), or where float32's weights (and, training,
    gradients and AdamW's states: 16 bytes a parameter) fit the GPUs several times over: a step that small is bound
    by launching its kernels and runs as fast in float32, which changes nothing."""
    if request.precision is not None:
        return [request.precision]
    values = [v for v in values if v not in request.exclude]
    default = cast(str, DEFAULTS["precision"].default)
    if default in request.exclude:
        return values
    per_parameter = 16 if request.task == "train" else 4
    small = FLOAT32_ROOM * per_parameter * count_parameters(base) <= request.gpu.memory_bytes * request.num_gpus
    return values + ([default] if request.on_cpu or not request.gpu.bf16_tflops or small else [])


def _layouts(request: PlanRequest, techniques: list[str]) -> list[Candidate]:
    """How the GPUs are used, each a partial candidate (precision filled in later): one device; or over N, the
    workload's own data parallel (with ZeRO-1), DeepSpeed's ZeRO stages, replicas serving apart, the layout
    techniques' values, and the pairs of them that share a 2-D mesh (tensor parallel within groups of GPUs, a
    sharding layout across the groups)."""
    n = request.num_gpus
    if n == 1:   # DeepSpeed's ZeRO-3 on one GPU, for the techniques only its engine runs (candidates())
        return [Candidate("fp32")] + ([Candidate("fp32", zero_stage=3, engine="deepspeed")]
                                      if request.task == "train" else [])
    layouts = []
    if request.task == "inference":
        layouts.append(Candidate("fp32", data_parallel=n))
    else:
        layouts += [Candidate("fp32", world_size=n, zero_stage=stage, data_parallel=n) for stage in (0, 1)]
        layouts += [Candidate("fp32", world_size=n, zero_stage=stage, engine="deepspeed", data_parallel=n)
                    for stage in (1, 2, 3)]
    parsed = {spec: cast("LayoutTechnique", parse_technique(spec)) for spec in techniques}   # the layout axis
    for spec, technique in parsed.items():
        if 1 < technique.model_ranks(n) < n:
            continue   # splits each copy of the model over part of the GPUs: paired below with a layout across them
        world_size, data_parallel, batch_multiple = technique.layout_shape(n)
        layouts.append(Candidate("fp32", techniques=(spec,), world_size=world_size, data_parallel=data_parallel,
                                 batch_multiple=batch_multiple))
    for (split, splitting), (across, technique) in itertools.permutations(parsed.items(), 2):
        if splitting.shares_mesh_with(technique):   # a 2-D mesh: one splits within groups, the other spans them
            world_size, data_parallel, batch_multiple = splitting.layout_shape(n)
            layouts.append(Candidate("fp32", techniques=(split, across), world_size=world_size,
                                     data_parallel=data_parallel, batch_multiple=batch_multiple))
    return layouts


def candidates(request: PlanRequest, base: ResolvedWorkload) -> list[Candidate]:
    """Every combination to consider, before the rules are checked (the search builds each Workload)."""
    values = searched(request, base)
    required_on, extra = required(request)
    default_optimizer = cast(str, DEFAULTS["optimizer"].default)
    if request.optimizer is not None:
        optimizers = [request.optimizer]
    else:
        optimizers = [o for o in [default_optimizer] + values["optimizer"] if o not in request.exclude]
    rest = [values[axis] if axis in required_on else [None] + values[axis] for axis in SEARCH_AXES[3:]]
    required_lossy = any(parse_technique(spec).risk == "lossy" for spec in request.techniques) or (
        request.optimizer is not None and _lossy(request.optimizer))
    layouts = _layouts(request, values["layout"])
    if "layout" in required_on:   # only the layouts that use the required one
        layouts = [layout for layout in layouts if set(required_on["layout"]) <= set(layout.techniques)]
    out = []
    # the only estimator of DeepSpeed's engine: a written family's program (a derived one runs PyTorch's step)
    analytic = "analytic" in methods_for(base) and has_family(base.source)
    for layout, precision in itertools.product(layouts, _precisions(request, values["precision"], base)):
        if layout.engine == "deepspeed" and (get_precision(precision).autocast_dtype is None or not analytic):
            continue   # DeepSpeed's engine trains in mixed precision, and only the analytic model predicts it
        for optimizer, *parts in itertools.product(optimizers, *rest):
            assert optimizer is not None   # one of `optimizers` (the product's type joins it with the parts')
            chosen = [p for p in parts if p]
            parsed = [parse_technique(p) for p in chosen]
            engines = {t.needs_engine for t in parsed} - {None}
            if engines - {layout.engine} or (layout.num_gpus == 1 and layout.engine != "pytorch" and not engines):
                continue   # a technique another engine runs; DeepSpeed on one GPU without one that needs it
            lossy = (_lossy(optimizer) and optimizer != request.optimizer) + sum(
                t.risk == "lossy" for t, spec in zip(parsed, chosen) if spec not in request.techniques)
            if lossy > 1 - required_lossy:
                continue   # one lossy change at a time keeps the space small (a required one is that change)
            out.append(replace(layout, precision=precision, optimizer=optimizer,
                               techniques=layout.techniques + tuple(chosen) + extra))
    return out


def _lossy(optimizer: str) -> bool:
    return optimizer in REGISTRY and REGISTRY[optimizer].risk == "lossy"


def allocator_options(request: PlanRequest, base: ResolvedWorkload) -> list[Technique]:
    """Techniques a plan gets only when it needs them to fit (they change what the allocator reserves, not the
    tensors: search.py sizes a candidate that does not fit without them once more with each)."""
    return [parse_technique(spec) for spec in searched(request, base)["allocator"]]
