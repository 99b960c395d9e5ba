"""A workload as plain, validated data: which model, which task, which batch shape, precision, optimizer,
ranks and techniques (as `NAME[:key=value,...]` specs).

Only what can be checked from the values themselves is checked here. What the techniques mean (their
parameters, the precision or optimizer they set, the rules between them) and where the model comes from
are resolved one layer up, by `memfit.techniques.resolve`: every estimate, measurement and plan resolves
the workload it is given, before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from memfit.core.errors import MemfitError, closest, require_positive_int
from memfit.core.precision import get_precision

TASKS = ("train", "inference")
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")   # torch.optim's implementations of a step
ENGINES = ("pytorch", "deepspeed")
DEEPSPEED_REDUCE_BUCKET = 500_000_000   # elements: DeepSpeed's default reduce_bucket_size (1 GB in half precision)
DEFAULT_SEQ_LEN = 512


@dataclass(frozen=True, kw_only=True)
class Workload:
    model: str                          # catalog name, config.json path or folder, or module:function
    inputs: str | None = None           # module:function(batch_size, seq_len) returning a custom model's batch
    step: str | None = None             # module:function(model, batch, optimizer): the user's own step
    task: str = "train"
    batch_size: int = 1
    seq_len: int | None = None          # tokens; image side in pixels for vision models
    new_tokens: int = 0                 # decode steps after the prefill (inference)
    precision: str = "fp32"
    optimizer: str = "adamw"
    optimizer_impl: str | None = None   # foreach | fused | for-loop; None: PyTorch's default on the device
    world_size: int = 1
    zero_stage: int = 0
    engine: str = "pytorch"
    reduce_bucket: int = DEEPSPEED_REDUCE_BUCKET   # --engine deepspeed: ZeRO's gradient reduction bucket, elements
    allow_long_seq: bool = False
    techniques: tuple[str, ...] = ()    # NAME[:key=value,...] (memfit techniques); see techniques/resolve.py

    def __post_init__(self) -> None:
        if isinstance(self.techniques, str):
            raise MemfitError(f"techniques must be a list of names, got the string {self.techniques!r}.")
        object.__setattr__(self, "techniques", tuple(self.techniques))
        if not isinstance(self.model, str) or not self.model.strip():
            raise MemfitError(f"name a model (memfit models lists them), got {self.model!r}.")
        if self.task not in TASKS:
            raise MemfitError(f"unknown task {self.task!r}; choose train or inference.{closest(str(self.task), TASKS)}")
        if self.step is not None and (not isinstance(self.step, str) or ":" not in self.step):
            raise MemfitError(f"--step {self.step!r} must look like package.module:function or path/file.py:function.")
        require_positive_int(self.batch_size, "--batch-size")
        if self.seq_len is not None:
            require_positive_int(self.seq_len, "--seq-len")
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 0:
            raise MemfitError(f"--new-tokens must be a non-negative integer, got {self.new_tokens!r}.")
        if self.new_tokens and self.task != "inference":
            raise MemfitError(f"--new-tokens {self.new_tokens} only applies to --task inference.")
        get_precision(self.precision)
        if not isinstance(self.optimizer, str) or not self.optimizer:
            raise MemfitError(f"--optimizer must name an optimizer, got {self.optimizer!r}.")
        if self.optimizer_impl is not None and self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise MemfitError(f"unknown --optimizer-impl {self.optimizer_impl!r}; choose {', '.join(OPTIMIZER_IMPLS)}."
                              f"{closest(str(self.optimizer_impl), OPTIMIZER_IMPLS)}")
        if self.optimizer_impl is not None and self.task != "train":
            raise MemfitError("--optimizer-impl describes the training step's optimizer; drop it for --task inference.")
        if self.engine not in ENGINES:
            raise MemfitError(f"unknown engine {self.engine!r}; choose pytorch or deepspeed."
                              f"{closest(str(self.engine), ENGINES)}")
        require_positive_int(self.world_size, "--world-size")
        if self.zero_stage not in (0, 1, 2, 3):
            raise MemfitError(f"--zero must be 0, 1, 2 or 3, got {self.zero_stage!r}.")
        if self.zero_stage and self.world_size == 1 and self.engine != "deepspeed":   # DeepSpeed: ZeRO on one GPU
            raise MemfitError(
                f"--zero {self.zero_stage} shards model states over data-parallel ranks, but --world-size is 1; "
                "pass --world-size N (N > 1), --engine deepspeed (its ZeRO optimizer on one GPU), or drop --zero.")
        if self.task == "inference" and (self.zero_stage or self.engine != "pytorch"):
            raise MemfitError("--zero and --engine describe training; drop them for --task inference.")
        require_positive_int(self.reduce_bucket, "--reduce-bucket")
        if self.engine != "deepspeed" and self.reduce_bucket != DEEPSPEED_REDUCE_BUCKET:
            raise MemfitError("--reduce-bucket sizes DeepSpeed's gradient bucket; pass --engine deepspeed or drop it.")
        if self.engine == "deepspeed" and not self.zero_stage:
            raise MemfitError("--engine deepspeed runs a ZeRO optimizer: pass --zero 1, 2 or 3 with --world-size N.")

    def plain(self) -> dict:
        """The workload's fields as given (a subclass's resolved state left out)."""
        return {f.name: getattr(self, f.name) for f in fields(Workload)}

    def to_json(self) -> dict:
        return {**self.plain(), "techniques": list(self.techniques)}

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        if not isinstance(data, dict):
            raise MemfitError(f"a workload is a JSON object, got {type(data).__name__}.")
        known = {f.name for f in fields(Workload)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MemfitError(f"unknown workload field(s) {', '.join(unknown)}.")
        return Workload(**{**data, "techniques": tuple(data.get("techniques", ()))})
