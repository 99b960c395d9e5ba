"""What every technique is: a frozen keyword-only config, registered under a name (`@register`), parsed from
`NAME[:key=value,...]`, that changes the real step (`apply_`) and declares everything the rest of memfit needs
to know about it: what it is (`traits`) and its rules, how the analytic estimator accounts for it, what the
planner tries and what its time costs, and the fixes explain-oom offers. Code outside the techniques asks these
declarations and never names a technique (ARCHITECTURE.md; CONTRIBUTING.md has the recipe).

`apply_` works on a `StepSetup` (steps/setup.py): the model, how the optimizer is built, the precision, how a
batch is split and how the loss is computed. Techniques that choose one of the workload's own settings
(precision, optimizer: `workload_field`) are folded into those fields when a workload is resolved
(resolve.py), so there is one source of truth for each setting. The hooks that take a `program`, `compute`,
`step`, `request` or `message`/`snapshot` receive the estimator's, the cost model's, the planner's or
explain-oom's objects (documented where each is defined); this layer never imports them.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from memfit.core.caching_allocator import AllocatorSettings
from memfit.core.errors import MemfitError, closest
from memfit.core.weight_formats import WeightFormat
from memfit.specs.workload import Workload
from memfit.steps.setup import StepSetup
from memfit.techniques.contracts import AnalyticProgram, CostCompute, CostStep, OomMessage, OomSnapshot, PlanQuery
from memfit.techniques.stages import STAGES

RISKS = ("lossless", "numerical", "lossy")
# The planner's search axes a technique can be a value of (`search_axis`), in the order a plan lists them; "allocator"
# values are not searched but added to a plan that fits only with them (planner/search.py)
SEARCH_AXES = ("layout", "precision", "optimizer", "optimizer-step", "weights", "attention", "activations", "loss",
               "offload")
# What a technique changes in training, least first: how a practitioner ranks them. The planner prefers the least
# among plans of about the same speed (planner/planning.py).
CHANGES = {
    "exact": "trains exactly as without it",
    "reduction-order": "sums in another order (different rounding, same arithmetic)",
    "mixed-precision": "computes in half precision over float32 weights",
    "reduced-precision": "keeps weights or optimizer states in fewer bits (no float32 master copy)",
    "adapters": "trains low-rank adapters beside the frozen weights, which stay as they are",
    "lossy": "changes what is trained or how much of it",
}

# What a technique can declare it is (`traits`), so that another can declare a rule against it without naming it:
# a new sharding technique that declares "dtensor" meets every rule written against DTensor parameters.
TRAITS = {
    "layout": "lays the model out over the ranks (one per workload, or two that share a 2-D mesh)",
    "dtensor": "turns the parameters into DTensor shards",
    "shards-weights": "leaves each rank a part of the weights (sharded, split or staged)",
    "splits-linears": "splits every linear over the ranks with plans for nn.Linear (the step mixes DTensors and "
                      "plain tensors)",
    "splits-blocks": "leaves each rank a run of the model's own blocks",
    "own-backward": "runs the step's micro-batches and their backward itself",
    "wraps-forward": "the model runs through its wrapper (calling the base model directly skips it)",
    "reduces-gradients": "reduces each gradient across the ranks as backward produces it",
    "host-optimizer": "moves the optimizer and its states to host RAM",
    "swaps-to-disk": "swaps the optimizer states and gradients to files on a local NVMe drive (the host holds "
                     "buffers)",
    "float32-masters": "keeps float32 master copies of half-precision weights, which its optimizer steps on",
    "steps-in-backward": "steps the optimizer inside backward, each parameter as its gradient is complete (which "
                         "frees it)",
    "shards-on-mesh": "shards over the data-parallel axis of a 2-D device mesh when another technique splits the "
                      "model over the other axis",
    "offloads-shards": "keeps its shards, their gradients and the optimizer states in host RAM when offload is asked "
                       "for (it takes the offload over)",
    "subclass-weights": "turns weights into tensor subclasses (quantized codes)",
    "quantized-linears": "quantizes (or fake-quantizes) the linear layers' weights",
    "adapters": "freezes the base and trains low-rank adapters beside it",
    "replaces-loss": "computes the step's loss itself",
    "shapes-batch": "changes the batch memfit's step feeds the model (truncates it or splits it into windows)",
    "traced-only": "has no analytic model: only a trace (or a run) predicts it (the analytic estimator refuses it)",
    "around-blocks": "changes what runs around the model's blocks (checkpoints, shards or offloads them, steps the "
                     "optimizer otherwise), not what a block runs: a program derived from a block traced without it "
                     "composes it",
    "allocator-only": "changes only how the caching allocator holds memory: the step's tensors, and so its trace, are "
                      "the same without it",
}


SNAPSHOT_RATIO = "snapshot × published ratio (rough)"   # a fix predicted from a snapshot's categories


class OomFix(NamedTuple):
    fix: str              # what to apply: a technique spec, or a plain description
    saved_bytes: int
    basis: str            # where the prediction comes from
    how: str              # how to apply it


class Export(NamedTuple):
    """A technique in a training tool's own terms (`memfit plan --export`, planner/export.py)."""
    settings: dict              # keyword arguments (hf-trainer) or config entries (deepspeed), merged into the rest
    how: str | None = None      # what the settings cannot say, and what to do about it


Examples = tuple[tuple[str, Mapping[str, Any]], ...]   # (spec, the workload fields it applies with), ...


@dataclass(frozen=True, kw_only=True)
class Technique:
    name: ClassVar[str]
    summary: ClassVar[str]
    risk: ClassVar[str]                  # lossless | numerical | lossy
    changes: ClassVar[str | None] = None   # what it changes in training (CHANGES); None: from its risk
    stage: ClassVar[str]                 # its place in the canonical order (stages.ORDER)
    workload_field: ClassVar[str | None] = None   # "precision" / "optimizer": sets that Workload field
    # Step time relative to the same step without the technique: a cost-model figure (`assumed`)
    # until benchmarks/technique_table.py measures it.
    time_factor: ClassVar[float] = 1.0
    # The torch.optim implementation the step must run with it when the workload names none (PyTorch's default
    # would fail), e.g. "for-loop"; None: no constraint
    needs_optimizer_impl: ClassVar[str | None] = None
    # What the technique is (keys of TRAITS), for other techniques' rules and the code that asks
    traits: ClassVar[frozenset[str]] = frozenset()
    # Rules: a technique name or a trait -> (reason, fix) why this technique does not work with it; "{other}" in
    # either is the other technique's name. rules.check_rules applies them before anything runs.
    conflicts_with: ClassVar[Mapping[str, tuple[str, str]]] = {}
    deepspeed_conflict: ClassVar[tuple[str, str] | None] = None   # (reason, fix) DeepSpeed's engine cannot run it
    needs_engine: ClassVar[str | None] = None   # the only --engine that runs it (the planner pairs it with no other)
    # explain-oom: the configurations it tries on the workload that ran out of memory (memfit's estimate of it
    # with each), best saving first; `oom_fix` predicts one from the OOM message or a snapshot alone
    oom_fixes: ClassVar[tuple[str, ...]] = ()
    # The planner: the axis of its search this technique is one value of (SEARCH_AXES, or "allocator":
    # added only to a plan that fits with it alone), None when it is not searched; `search_values` says which
    # configurations to try
    search_axis: ClassVar[str | None] = None
    # Where it applies: configurations (specs), each with the smallest workload it changes something on (Workload
    # fields over tiny-llama training, 4 sequences of 128 tokens). Every technique declares its own (a subclass too):
    # the technique tests, the fuzzed specs and the golden cases run them.
    examples: ClassVar[Examples] = ()

    @classmethod
    def implied_by(cls, workload: Workload, techniques: list[Technique]) -> bool:
        """True when `workload` with `techniques` (those given) runs this technique without being asked."""
        return False

    @classmethod
    def search_values(cls, request: PlanQuery, workload: Workload) -> list[str]:
        """The configurations (specs) the planner tries for `request` (a PlanRequest), `workload` being the request's
        model and task resolved; [] for none. Lossy ones are kept only under --allow lossy."""
        return []

    def allocator_settings(self, settings: AllocatorSettings) -> AllocatorSettings:
        """The CUDA caching allocator's settings with this technique (core/caching_allocator.py simulates
        them); unchanged unless it is an allocator setting."""
        return settings

    def step_time_factor(self) -> float:
        """This configuration's step-time factor (the class's `time_factor` unless a parameter changes it)."""
        return self.time_factor

    # ---- the analytic estimator (estimators/analytic/simulate.py): how one simulated step accounts for it ----
    # the step at depth L is linear in L (estimators may extrapolate from a few depths)
    depth_linear: ClassVar[bool] = True
    # a layout that shards the model states like ZeRO stage N (parameters, gradients, optimizer states)
    zero_stage: ClassVar[int | None] = None

    def analytic_policy(self, workload: Workload) -> dict:
        """Fields of the engine's Policy this technique sets (estimators/analytic/engine.py)."""
        return {}

    def analytic_spec(self, spec, workload: Workload):
        """The family's model spec (its heads, KV heads, MLP channels) as this technique leaves it."""
        return spec

    def analytic_layers(self, num_layers: int, rank: int, workload: Workload) -> int:
        """Blocks rank `rank` holds of `num_layers`."""
        return num_layers

    def analytic_ranks(self, world_size: int, method: str) -> tuple[list[int], str] | None:
        """The ranks whose steps differ, to estimate each ("traced" or "analytic"), and why they bound the
        rest; None when every rank's step is alike (rank 0 stands for all)."""
        return None

    def analytic_model(self, program: AnalyticProgram) -> None:
        """Declare the model itself, when the technique changes what is declared (Program.declare_teacher)."""

    def weight_format(self) -> WeightFormat | None:
        """How the technique stores the linears' weights (core/weight_formats.py: the estimators and the cost model
        read it); None: as they are."""
        return None

    def analytic_weights(self, program: AnalyticProgram) -> None:
        """Change the declared weights (Program: quantize_linears, add_adapters, keep_stage, ...); by default, store
        the linears in the technique's weight format."""
        fmt = self.weight_format()
        if fmt is not None:
            program.quantize_linears(fmt)

    def analytic_windows(self, windows, workload: Workload):
        """What the step's forwards see of each sequence (analytic/program.py `Windows`)."""
        return windows

    def analytic_buffers(self, program: AnalyticProgram) -> None:
        """Allocate what the training step holds throughout (Program.hold_gradient_buckets)."""

    def analytic_train(self, program: AnalyticProgram) -> bool:
        """Run the step's forwards and backwards itself (Program.pipeline_schedule); False: the default loop."""
        return False

    def analytic_states(self, params) -> list[tuple[int, str]]:
        """An optimizer's states for the trainable `params` ((numel, dtype) each, dtypes as the engine names
        them: "float32", "uint8", ...)."""
        raise NotImplementedError(f"{self.name} is not an optimizer")

    def analytic_paged_states(self, params) -> list[tuple[int, str]]:
        """The part of `analytic_states` a paged optimizer keeps in CUDA unified memory on a GPU."""
        return []

    def analytic_step_temporaries(self, params, impl: str) -> list[tuple[int, str]]:
        """An optimizer step's temporaries alive at once over `params` (each rank's shards), run by `impl`
        (foreach, fused or for-loop: the workload's --optimizer-impl, else the device's default)."""
        raise NotImplementedError(f"{self.name} is not an optimizer")

    # ---- the planner's cost model (planner/cost.py) ----
    def cost_compute(self, compute: CostCompute) -> None:
        """Change one micro-step's FLOPs in the planner's cost model (planner/cost.py `Compute`: recompute,
        backward, the ranks they split over, a bubble). By default: multiply the compute by this technique's
        step-time factor, for a technique whose time the model does not derive."""
        compute.factor *= self.step_time_factor()

    def cost_overhead(self, step: CostStep) -> None:
        """Add the seconds this technique spends beside the compute (planner/cost.py `Step`: communication,
        offload copies, a host optimizer step)."""

    @classmethod
    def training_change(cls) -> str:
        """What it changes in training (a key of CHANGES): its own `changes`, else what its risk implies (a
        numerical technique sums in another order)."""
        return cls.changes or {"lossless": "exact", "numerical": "reduction-order", "lossy": "lossy"}[cls.risk]

    def conflicts(self) -> Mapping[str, tuple[str, str]]:
        """This configuration's rules (`conflicts_with`, unless a parameter changes them)."""
        return self.conflicts_with

    def shares_mesh_with(self, other: Technique) -> bool:
        """True when this configuration and `other` lay the model out together on a 2-D device mesh (each over
        one of its axes), so the rules between two layouts do not apply to them."""
        return False

    def mesh_axes(self, world_size: int) -> tuple[tuple[str, int], ...]:
        """The 2-D device mesh this configuration lays the model out on with a sharding layout ((name, size), outer
        first: steps/setup.py `mesh_axes`), decided before any technique applies; () when it uses none."""
        return ()

    def model_ranks(self, world_size: int) -> int:
        """Ranks one copy of the model is split over (tensor or pipeline parallel); 1 when each rank holds the
        whole model or a shard of all of it. The ranks divided by these are the data-parallel copies."""
        return 1

    def oom_fix(self, message: OomMessage | None, snapshot: OomSnapshot | None) -> OomFix | None:
        """A fix read off the OOM message or the memory snapshot alone (no workload given; each may be None), or
        None: the bytes it would free and where that prediction comes from."""
        return None

    def check(self, workload: Workload) -> None:
        """Raise MemfitError when this technique cannot apply to `workload` (its own conditions; the rules
        between techniques are `conflicts_with`)."""

    def export(self, tool: str, workload: Workload) -> Export | None:
        """This technique for `tool` ("hf-trainer": TrainingArguments keyword arguments; "deepspeed": DeepSpeed
        config entries), or None when the tool has no setting for it (the export then says to apply it to the model
        with memfit.apply_)."""
        return None

    def estimate_notes(self, workload: Workload) -> list[str]:
        """What an estimate of `workload` with this technique should say beside its figures (a caveat)."""
        return []

    def config_overrides(self, source) -> dict:
        """Fields this technique changes in a Hugging Face model's config (memfit builds the model with them)."""
        return {}

    def apply_(self, setup: StepSetup) -> None:
        """Change the real model / optimizer / step in `setup`, in place."""

    @property
    def spec(self) -> str:
        """The canonical `name:key=value,...` (defaults omitted)."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return self.name + (":" + ",".join(parts) if parts else "")

    @classmethod
    def parameters(cls) -> str:
        return ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls)) or "-"


REGISTRY: dict[str, type[Technique]] = {}


def register(cls: type[Technique]) -> type[Technique]:
    """Add a technique class to the registry (a decorator): from then on `-t NAME` parses to it, and the rules,
    the planner's search, the cost model and explain-oom's fixes ask it what it declares. Every declaration is
    checked here: a technique that declares something memfit does not know fails at import, naming it."""
    for problem in declaration_problems(cls):
        raise TypeError(f"technique {cls.__name__}: {problem}")
    REGISTRY[cls.name] = cls
    return cls


def declaration_problems(cls: type[Technique]) -> list[str]:
    """What is wrong with the class attributes `cls` declares (empty when nothing is)."""
    name = str(getattr(cls, "name", None))
    checks = [
        (re.fullmatch(r"[a-z0-9][a-z0-9-]*", name) is not None,
         f"name {name!r} must be lower-case words joined by '-'"),
        (name not in REGISTRY, f"name {name!r} is registered already (by {REGISTRY.get(name)})"),
        (isinstance(getattr(cls, "summary", None), str) and bool(cls.summary), "summary must say what it does"),
        (getattr(cls, "risk", None) in RISKS, f"risk {getattr(cls, 'risk', None)!r} is not one of {RISKS}"),
        (cls.changes is None or cls.changes in CHANGES, f"changes {cls.changes!r} is not one of {tuple(CHANGES)}"),
        (getattr(cls, "stage", None) in STAGES, f"stage {getattr(cls, 'stage', None)!r} is not one of {STAGES}"),
        (cls.workload_field in (None, "precision", "optimizer"),
         f"workload_field {cls.workload_field!r} must be None, 'precision' or 'optimizer'"),
        (cls.search_axis in (None, *SEARCH_AXES, "allocator"),
         f"search_axis {cls.search_axis!r} is not one of {SEARCH_AXES + ('allocator',)} (or None)"),
        (cls.needs_engine in (None, "pytorch", "deepspeed"), f"needs_engine {cls.needs_engine!r} is not an engine"),
        (isinstance(cls.time_factor, (int, float)) and cls.time_factor > 0,
         f"time_factor {cls.time_factor!r} must be a positive number"),
        (set(cls.traits) <= set(TRAITS),
         f"unknown traits {sorted(set(cls.traits) - set(TRAITS))}: add them to TRAITS with their meaning"),
        (all(isinstance(fix, tuple) and len(fix) == 2 for fix in cls.conflicts_with.values()),
         "conflicts_with maps a name or a trait to (reason, fix)"),
    ]
    return [problem for ok, problem in checks if not ok]


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _coerce(value: str, kind: type, name: str, key: str):
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return value.lower() in ("true", "1", "yes")
        return kind(value)
    except ValueError:
        raise MemfitError(f"-t {name}: {key}={value!r} is not a valid {kind.__name__}.") from None


def parse_technique(spec: str) -> Technique:
    """`checkpointing:every=2` -> Checkpointing(every=2); unknown names and keys are one-line errors."""
    if not isinstance(spec, str) or not spec.strip():
        raise MemfitError(f"-t needs a technique name, got {spec!r}; see `memfit techniques`.")
    name, _, rest = spec.strip().partition(":")
    cls = REGISTRY.get(name)
    if cls is None:
        raise MemfitError(f"unknown technique {name!r}; see `memfit techniques`.{closest(name, REGISTRY)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq and key in fields:
            raise MemfitError(f"-t {spec}: {key!r} needs a value ({key}=..., default {fields[key].default!r}).")
        if not eq or key not in fields:
            known = ", ".join(fields) or "none"
            raise MemfitError(f"-t {spec}: {item!r} is not a parameter of {name} (parameters: {known}).")
        kwargs[key] = _coerce(value, _TYPES[str(fields[key].type).split("|")[0].strip()], name, key)
    return cls(**kwargs)
