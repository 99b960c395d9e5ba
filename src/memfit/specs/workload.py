"""A workload: which model, which task, which batch shape, precision, optimizer and data parallelism."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cached_property

from memfit.core.errors import MemfitError, closest, require_positive_int
from memfit.core.precision import get_precision
from memfit.specs.model_source import ModelSource, resolve_source

TASKS = ("train", "inference")
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "adamw8bit", "adamw4bit")
ENGINES = ("pytorch", "deepspeed")
DEEPSPEED_REDUCE_BUCKET = 500_000_000   # elements: DeepSpeed's default reduce_bucket_size (1 GB in half precision)
DEFAULT_SEQ_LEN = 512
DISTRIBUTED_TECHNIQUES = ("fsdp2", "ddp", "tensor-parallel", "pipeline-parallel")


@dataclass(frozen=True, kw_only=True)
class Workload:
    model: str
    inputs: str | None = None
    task: str = "train"
    batch_size: int = 1
    seq_len: int | None = None          # tokens; image side in pixels for vision models
    new_tokens: int = 0                 # decode steps after the prefill (inference)
    precision: str = "fp32"
    optimizer: str = "adamw"
    world_size: int = 1
    zero_stage: int = 0
    engine: str = "pytorch"
    reduce_bucket: int = DEEPSPEED_REDUCE_BUCKET   # --engine deepspeed: ZeRO's gradient reduction bucket, elements
    allow_long_seq: bool = False
    techniques: tuple[str, ...] = ()    # NAME[:key=value,...] (memfit techniques); see techniques/compose.py

    def __post_init__(self) -> None:
        from memfit.techniques.compose import fold_into

        if isinstance(self.techniques, str):
            raise MemfitError(f"techniques must be a list of names, got the string {self.techniques!r}.")
        fields, specs = fold_into(self, self.techniques)
        for name, value in {**fields, "techniques": specs}.items():
            object.__setattr__(self, name, value)
        if self.task not in TASKS:
            raise MemfitError(f"unknown task {self.task!r}; choose train or inference.{closest(self.task, TASKS)}")
        require_positive_int(self.batch_size, "--batch-size")
        if self.seq_len is not None:
            require_positive_int(self.seq_len, "--seq-len")
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 0:
            raise MemfitError(f"--new-tokens must be a non-negative integer, got {self.new_tokens!r}.")
        if self.new_tokens and self.task != "inference":
            raise MemfitError(f"--new-tokens {self.new_tokens} only applies to --task inference.")
        get_precision(self.precision)
        if self.optimizer not in OPTIMIZERS:
            raise MemfitError(
                f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}."
                f"{closest(self.optimizer, OPTIMIZERS)}")
        if self.engine not in ENGINES:
            raise MemfitError(f"unknown engine {self.engine!r}; choose pytorch or deepspeed.{closest(self.engine, ENGINES)}")
        require_positive_int(self.world_size, "--world-size")
        if self.zero_stage not in (0, 1, 2, 3):
            raise MemfitError(f"--zero must be 0, 1, 2 or 3, got {self.zero_stage!r}.")
        if self.zero_stage and self.world_size == 1:
            raise MemfitError(
                f"--zero {self.zero_stage} shards model states over data-parallel ranks, but --world-size is 1; "
                "pass --world-size N (N > 1) or drop --zero.")
        if self.engine == "deepspeed" and self.precision in ("fp32", "bf16"):
            raise MemfitError(
                f"--engine deepspeed models half-precision training with fp32 master weights; use --precision "
                f"bf16-mixed or fp16-mixed, not {self.precision}.")
        if self.task == "inference" and (self.zero_stage or self.engine != "pytorch"):
            raise MemfitError("--zero and --engine describe training; drop them for --task inference.")
        require_positive_int(self.reduce_bucket, "--reduce-bucket")
        if self.engine != "deepspeed" and self.reduce_bucket != DEEPSPEED_REDUCE_BUCKET:
            raise MemfitError("--reduce-bucket sizes DeepSpeed's gradient bucket; pass --engine deepspeed or drop it.")
        if self.engine == "deepspeed" and not self.zero_stage:
            raise MemfitError("--engine deepspeed runs a ZeRO optimizer: pass --zero 1, 2 or 3 with --world-size N.")
        self._check_seq_len()
        from memfit.techniques.compose import check_workload

        check_workload(self)

    @cached_property
    def technique_configs(self) -> list:
        """The techniques (beyond precision and optimizer) as configs, in the canonical order; `--world-size N`
        training with no data-parallel technique and --zero 0 or 1 is DDP (the `ddp` technique, implied; with
        --zero 1 its optimizer is ZeroRedundancyOptimizer)."""
        from memfit.techniques.base import parse_technique
        from memfit.techniques.compose import ordered

        configs = [parse_technique(spec) for spec in self.techniques]
        if (self.task == "train" and self.world_size > 1 and self.zero_stage <= 1 and self.engine == "pytorch"
                and not {c.name for c in configs} & set(DISTRIBUTED_TECHNIQUES)):
            configs = ordered(configs + [parse_technique("ddp")])
        return configs

    @property
    def distributed_technique(self):
        """The ddp, fsdp2, tensor-parallel or pipeline-parallel config when the workload runs over a process
        group, else None."""
        return next((t for t in self.technique_configs if t.name in DISTRIBUTED_TECHNIQUES), None)

    @property
    def runs_on_ranks(self) -> bool:
        """Measured with torchrun: a distributed technique or DeepSpeed's engine."""
        return bool(self.distributed_technique) or self.engine == "deepspeed"

    def technique(self, name: str):
        """The config of technique `name`, or None."""
        return next((t for t in self.technique_configs if t.name == name), None)

    # The source is resolved once per workload; resolving validates model and inputs specs.
    @cached_property
    def source(self) -> ModelSource:
        source = resolve_source(self.model, self.inputs)
        overrides = {k: v for t in self.technique_configs for k, v in t.config_overrides(source).items()}
        if overrides:
            source = replace(source, overrides={**source.overrides, **overrides})
        tokens = self.effective_seq_len_of(source) + self.new_tokens
        if self.allow_long_seq and source.max_seq_len and tokens > source.max_seq_len:
            key = "n_positions" if "n_positions" in source.hf_config else "max_position_embeddings"
            source = replace(source, overrides={**source.overrides, key: tokens})
        return source

    def effective_seq_len_of(self, source: ModelSource) -> int:
        if self.seq_len is not None:
            return self.seq_len
        if source.head == "image-classification":
            return source.image_size
        return min(DEFAULT_SEQ_LEN, source.max_seq_len or DEFAULT_SEQ_LEN)

    @property
    def effective_seq_len(self) -> int:
        return self.effective_seq_len_of(self.source)

    @property
    def total_tokens(self) -> int:
        """Sequence length the model sees at the end of decoding."""
        return self.effective_seq_len + self.new_tokens

    def _check_seq_len(self) -> None:
        source = self.source
        seq = self.effective_seq_len_of(source)
        if source.head == "image-classification":
            patch = source.hf_config.get("patch_size", 1)
            if seq % patch:
                raise MemfitError(f"image size {seq} is not a multiple of the patch size {patch}.")
            return
        limit = source.max_seq_len
        total = seq + self.new_tokens
        if limit and total > limit and not self.allow_long_seq:
            raise MemfitError(
                f"sequence of {total} tokens is longer than {source.name}'s maximum of {limit}; "
                "shorten it or pass --allow-long-seq to estimate with longer positions anyway.")

    def to_json(self) -> dict:
        data = asdict(self)
        data["seq_len"] = self.effective_seq_len
        data["techniques"] = list(self.techniques)
        return data

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        return cls(**{**data, "techniques": tuple(data.get("techniques", ()))})
