"""What a plan is asked for: the model and task, the batch the user wants, the hardware and the limits.

Validated at construction: every bad value is a MemfitError naming it, the rule and a way out.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from memfit.core.errors import MemfitError, closest, require_positive_int
from memfit.core.precision import PRECISIONS, get_precision
from memfit.planner.cost import ASSUMED, GPUS_PER_NODE, CostModel
from memfit.specs.hardware import GPU
from memfit.specs.instances import Instance
from memfit.specs.workload import TASKS
from memfit.techniques import REGISTRY
from memfit.techniques.base import parse_technique
from memfit.techniques.resolve import optimizers

OBJECTIVES = ("fastest", "smallest", "balanced")
PLAN_METHODS = ("analytic", "traced")
ALLOW = ("lossless", "lossy")
DEFAULT_MARGIN = 0.05             # headroom kept free beyond the modelled overheads
# Plans this close to the fastest count as fast as it (objective fastest): the one that changes training least
# wins. The step-time model's constants are assumed, not yet compared with a GPU run: differences below this are
# within its error.
DEFAULT_SPEED_MARGIN = 0.10


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str
    gpu: GPU
    inputs: str | None = None   # a custom model's batch: module:function(batch_size, seq_len), as for estimate
    step: str | None = None     # the user's own step: module:function(model, batch, optimizer), as for estimate
    task: str = "train"
    seq_len: int | None = None
    global_batch: int | None = None      # train: sequences per optimizer step over all GPUs (default: one per GPU)
    batch_size: int = 1                  # inference: sequences served together
    new_tokens: int = 0
    num_gpus: int = 1
    host_ram_bytes: int | None = None    # per node; None: not checked (offload plans print what they need)
    allow: str = "lossless"
    max_ppl_increase: float | None = None   # a fraction (0.02 = 2 %); only with allow="lossy"
    objective: str = "fastest"
    margin: float = DEFAULT_MARGIN
    speed_margin: float = DEFAULT_SPEED_MARGIN
    top: int = 5
    cost: CostModel = ASSUMED   # the cost model's constants (planner/cost.py)
    instance: Instance | None = None   # the machine rented (memfit instances): its GPU, host RAM and price
    on_cpu: bool = False    # plan a run on this machine's CPU (`gpu` then describes the CPU): CPU kernels in the
    # estimates and no CUDA overheads (benchmarks/planner_oracle.py)
    # What the user fixed: techniques every plan uses (with their settings), the precision and optimizer (None:
    # searched), techniques (or precisions, optimizers) never used, and the estimator (None: analytic where it
    # models the model, else traced)
    techniques: tuple[str, ...] = ()
    precision: str | None = None
    optimizer: str | None = None
    exclude: tuple[str, ...] = ()
    method: str | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise MemfitError(f"unknown task {self.task!r}; choose train or inference.{closest(self.task, TASKS)}")
        require_positive_int(self.num_gpus, "--gpus")
        require_positive_int(self.batch_size, "--batch-size")
        require_positive_int(self.top, "--top")
        if self.seq_len is not None:
            require_positive_int(self.seq_len, "--seq-len")
        if self.global_batch is not None:
            require_positive_int(self.global_batch, "--global-batch")
            if self.task != "train":
                raise MemfitError("--global-batch is the training batch per optimizer step; for --task inference "
                                  "pass --batch-size.")
        if self.new_tokens and self.task != "inference":
            raise MemfitError(f"--new-tokens {self.new_tokens} only applies to --task inference.")
        if self.allow not in ALLOW:
            raise MemfitError(f"--allow {self.allow!r}: choose lossless (numerics may change, results may not) or "
                              f"lossy.{closest(self.allow, ALLOW)}")
        if self.objective not in OBJECTIVES:
            raise MemfitError(f"--objective {self.objective!r}: choose one of {', '.join(OBJECTIVES)}."
                              f"{closest(self.objective, OBJECTIVES)}")
        if self.max_ppl_increase is not None:
            if self.allow != "lossy":
                raise MemfitError("--max-ppl-increase bounds lossy techniques; add --allow lossy.")
            if not 0 <= self.max_ppl_increase < 10:
                raise MemfitError(f"--max-ppl-increase {self.max_ppl_increase:.0%} is out of range; write e.g. 2%.")
        if not 0 <= self.margin < 0.5:
            raise MemfitError(f"--margin {self.margin:.0%} must be at least 0 % and below 50 %.")
        if not 0 <= self.speed_margin <= 1:
            raise MemfitError(f"--speed-margin {self.speed_margin:.0%} must be between 0 % (always the fastest) and "
                              "100 %.")
        if self.host_ram_bytes is not None and self.host_ram_bytes < 0:
            raise MemfitError("--host-ram must not be negative.")
        self._check_constraints()
        if self.instance is not None:
            self._check_instance(self.instance)
            if self.instance.network_gbps:   # its network between machines, shared by its GPUs (Gbit/s -> GB/s)
                object.__setattr__(self, "cost", replace(
                    self.cost, network_gbps=self.instance.network_gbps / 8 / self.instance.gpus))

    def _check_constraints(self) -> None:
        """The techniques, precision, optimizer and exclusions checked; a technique that sets the precision or the
        optimizer (-t bf16-mixed, -t adamw8bit) is folded into that field."""
        if isinstance(self.techniques, str) or isinstance(self.exclude, str):
            raise MemfitError("techniques and exclude are lists of names, not one string.")
        required = []
        for spec in self.techniques:
            technique = parse_technique(spec)
            field = technique.workload_field
            if field is None:
                required.append(spec)
            elif getattr(self, field) not in (None, technique.name):
                raise MemfitError(f"--{field} {getattr(self, field)} and -t {technique.name} disagree; keep one.")
            else:
                object.__setattr__(self, field, technique.name)
        object.__setattr__(self, "techniques", tuple(required))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        if self.precision is not None:
            get_precision(self.precision)
        if self.optimizer is not None and self.optimizer not in optimizers():
            raise MemfitError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(optimizers())}."
                              f"{closest(str(self.optimizer), optimizers())}")
        known = set(REGISTRY) | set(PRECISIONS) | set(optimizers())
        fixed = {parse_technique(spec).name for spec in self.techniques} | {self.precision, self.optimizer}
        for name in self.exclude:
            if name not in known:
                raise MemfitError(f"--exclude {name!r}: not a technique, precision or optimizer; see `memfit "
                                  f"techniques`.{closest(str(name), known)}")
            if name in fixed:
                raise MemfitError(f"--exclude {name} and a plan that must use it: drop one.")
        if self.method not in (None, *PLAN_METHODS):
            raise MemfitError(f"unknown --method {self.method!r}; choose {' or '.join(PLAN_METHODS)} (default: "
                              "analytic where it models the model, else traced)."
                              f"{closest(str(self.method), PLAN_METHODS)}")

    def _check_instance(self, instance: Instance) -> None:
        if self.gpu.name != instance.gpu.name:
            raise MemfitError(f"--instance {instance.name} holds {instance.gpu.name} GPUs, not {self.gpu.name}; drop "
                              "--gpu (the instance implies it).")
        whole_nodes = instance.gpus == GPUS_PER_NODE and self.num_gpus % GPUS_PER_NODE == 0
        if self.num_gpus > instance.gpus and not whole_nodes:
            raise MemfitError(f"--gpus {self.num_gpus}: one {instance.name} holds {instance.gpus}; plan more GPUs "
                              f"as whole machines of {GPUS_PER_NODE} GPUs.")

    @property
    def sequences(self) -> int:
        """Sequences per step: the global batch (train) or the served batch (inference)."""
        if self.task == "inference":
            return self.batch_size
        return self.global_batch if self.global_batch is not None else self.num_gpus

    @property
    def budget_bytes(self) -> int:
        """Device bytes a plan may use per GPU, tensors and overheads together."""
        return int(self.gpu.memory_bytes * (1 - self.margin))

    @property
    def nodes(self) -> int:
        return -(-self.num_gpus // GPUS_PER_NODE)

    @property
    def usd_per_hour(self) -> float | None:
        """What the machines the plan runs on cost per hour (whole machines: a plan on fewer GPUs pays for all)."""
        if self.instance is None or self.instance.usd_per_hour is None:
            return None
        return self.instance.usd_per_hour * -(-self.num_gpus // self.instance.gpus)

    def to_json(self) -> dict:
        return {"model": self.model, "inputs": self.inputs, "step": self.step, "gpu": self.gpu.name,
                "gpu_memory_bytes": self.gpu.memory_bytes, "task": self.task, "seq_len": self.seq_len,
                "instance": self.instance.name if self.instance else None,
                "global_batch": self.sequences if self.task == "train" else None, "batch_size": self.batch_size,
                "new_tokens": self.new_tokens, "num_gpus": self.num_gpus, "host_ram_bytes": self.host_ram_bytes,
                "allow": self.allow, "max_ppl_increase": self.max_ppl_increase, "objective": self.objective,
                "speed_margin": self.speed_margin,
                "margin": self.margin, "techniques": list(self.techniques), "precision": self.precision,
                "optimizer": self.optimizer, "exclude": list(self.exclude), "method": self.method}

    def constraints(self) -> list[str]:
        """What the user fixed, as the plan's title says it."""
        fixed = [value for value in (self.precision, self.optimizer) if value] + list(self.techniques)
        return ((["must use " + " + ".join(fixed)] if fixed else []) +
                (["never " + ", ".join(self.exclude)] if self.exclude else []) +
                ([f"{self.method} estimates"] if self.method else []))


def parse_fraction(text: str, flag: str) -> float:
    """'2%' or '0.02' -> 0.02."""
    raw = str(text).strip()
    try:
        return float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise MemfitError(f"{flag} {text!r}: write a percentage such as 2% (or a fraction such as 0.02).") from None
