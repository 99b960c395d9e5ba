"""Resolving a workload: its techniques parsed, folded, completed and checked, its model source built.

`resolve(workload)` turns the plain data of a `Workload` (specs/workload.py) into a `ResolvedWorkload`:
the same fields, with
- each `-t` spec parsed into its technique config; one that sets a workload field (a precision, an
  optimizer) folded into that field, so there is one source of truth for each setting;
- techniques a workload implies added (a technique declares when: `implied_by`), all in the canonical
  order (stages.ORDER);
- the model source resolved, with the changes techniques make to a Hugging Face config;
- every technique's own check and every rule between techniques applied (rules.check_rules).
A bad value raises a MemfitError before anything runs. `dataclasses.replace` on a resolved workload
resolves the changed one again.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from memfit.core.errors import MemfitError, closest
from memfit.core.precision import get_precision, precision_names
from memfit.specs.model_source import ModelSource, resolve_source
from memfit.specs.workload import DEFAULT_SEQ_LEN, Workload
from memfit.steps.optim import TORCH_OPTIMIZER_IMPLS, TORCH_OPTIMIZERS, device_default_impl
from memfit.steps.user_step import check_user_step
from memfit.techniques.base import REGISTRY, Technique, parse_technique
from memfit.techniques.rules import check_rules, ordered, parse_all

if TYPE_CHECKING:
    from memfit.core.weight_formats import WeightFormat
    from memfit.techniques.optimizer_states import _Optimizer


@dataclass(frozen=True, kw_only=True)
class ResolvedWorkload(Workload):
    source: ModelSource = field(init=False, repr=False, compare=False)
    technique_configs: tuple[Technique, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        configs = parse_all(self.techniques)
        for name, value in _folded_fields(self, configs).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "techniques", tuple(t.spec for t in configs if t.workload_field is None))
        _check_settings(self)
        explicit = [t for t in configs if t.workload_field is None]
        implied = [cls() for cls in REGISTRY.values() if cls.implied_by(self, explicit)]
        object.__setattr__(self, "technique_configs", tuple(ordered(explicit + implied)))
        object.__setattr__(self, "source", _source_of(self))
        self._check_seq_len()
        for technique in self.hooked_techniques:
            technique.check(self)
        check_rules(list(self.technique_configs), self)
        if self.step is not None:
            check_user_step(self)

    @property
    def field_techniques(self) -> list[Technique]:
        """The workload's precision and optimizer as technique configs, where they are techniques."""
        return [REGISTRY[value]() for value in (self.precision, self.optimizer) if value in REGISTRY]

    @functools.cached_property
    def hooked_techniques(self) -> tuple[Technique, ...]:
        """The precision and optimizer techniques, then the others: every technique whose analytic hooks and
        step-time overhead apply (the cost model derives a precision's and an optimizer's compute itself). Built
        once: the analytic engine reads it several times in every simulated step."""
        return (*self.field_techniques, *self.technique_configs)

    @property
    def required_optimizer_impl(self) -> str | None:
        """The torch.optim implementation given, else the one a technique needs; None: PyTorch's default."""
        needed = (t.needs_optimizer_impl for t in self.technique_configs if t.needs_optimizer_impl)
        return self.optimizer_impl or next(needed, None)

    def optimizer_impl_on(self, on_cuda: bool) -> str:
        """The implementation the step runs: the required one, else PyTorch's default on the device (foreach on
        CUDA, the for-loop elsewhere)."""
        return self.required_optimizer_impl or device_default_impl(on_cuda)

    @property
    def weight_format(self) -> WeightFormat | None:
        """How the linears' weights are stored (the technique that quantizes them says: core/weight_formats.py);
        None: as the precision leaves them."""
        return next((fmt for t in self.technique_configs if (fmt := t.weight_format()) is not None), None)

    def with_trait(self, trait: str) -> Technique | None:
        """The first technique (in the canonical order) that declares `trait`, or None."""
        return next((t for t in self.technique_configs if trait in t.traits), None)

    @property
    def layout(self) -> Technique | None:
        """The technique that lays the model out over the ranks (data parallel, sharded, split), if any. On a 2-D
        mesh, the one across the data-parallel axis (the other splits each copy of the model over part of the
        ranks)."""
        return next((t for t in self.technique_configs if "layout" in t.traits
                     and t.model_ranks(self.world_size) in (1, self.world_size)), None)

    @property
    def data_parallel_size(self) -> int:
        """Copies of the model the ranks hold, each training its own share of the batch: the ranks over those one
        copy is split over (a tensor-parallel group, the pipeline's stages). Sharded states are split this many
        ways."""
        split = 1
        for technique in self.technique_configs:
            split *= technique.model_ranks(self.world_size)
        return max(1, self.world_size // split)

    @property
    def runs_on_ranks(self) -> bool:
        """Measured with torchrun: a layout over ranks, or DeepSpeed's engine."""
        return self.layout is not None or self.engine == "deepspeed"

    @property
    def effective_seq_len(self) -> int:
        return effective_seq_len(self, self.source)

    @property
    def throughput_per_sample(self) -> tuple[int, str]:
        """What one sequence of the batch adds to throughput, and its unit: the tokens it generates (decoding) or
        runs (a text model's step); one sample otherwise: an image, or a custom module's batch, whose second
        dimension need not be a sequence (a 64 x 512 batch of features is 64 samples, not 32,768 tokens)."""
        if self.new_tokens:
            return self.new_tokens, "generated tokens"
        if self.source.is_hf and self.source.head != "image-classification":
            return self.effective_seq_len, "tokens"
        return 1, "samples"

    @property
    def total_tokens(self) -> int:
        """Sequence length the model sees at the end of decoding."""
        return self.effective_seq_len + self.new_tokens

    def _check_seq_len(self) -> None:
        source = self.source
        seq = self.effective_seq_len
        if source.head == "image-classification":
            assert source.hf_config is not None   # a Hugging Face head
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
        return {**super().to_json(), "seq_len": self.effective_seq_len}


def resolve(workload: Workload) -> ResolvedWorkload:
    """`workload` resolved (itself when it already is)."""
    if isinstance(workload, ResolvedWorkload):
        return workload
    if not isinstance(workload, Workload):
        raise MemfitError(f"expected a memfit Workload, got {type(workload).__name__}.")
    return ResolvedWorkload(**workload.plain())


def effective_seq_len(workload: Workload, source: ModelSource) -> int:
    """The sequence length the step runs: the given one, else the image size or 512 tokens (at most the
    model's maximum)."""
    if workload.seq_len is not None:
        return workload.seq_len
    if source.head == "image-classification":
        return cast(int, source.image_size)   # None when the config has no image_size
    return min(DEFAULT_SEQ_LEN, source.max_seq_len or DEFAULT_SEQ_LEN)


def _folded_fields(workload: Workload, configs: list[Technique]) -> dict[str, str]:
    """The fields that field-setting techniques (a precision, an optimizer) set, checked against the fields
    given explicitly."""
    folded = {}
    for technique in configs:
        name = technique.workload_field
        if name is None:
            continue
        current, default = getattr(workload, name), Workload.__dataclass_fields__[name].default
        if current not in (default, technique.name):
            raise MemfitError(f"--{name} {current} and -t {technique.name} disagree; keep one.")
        folded[name] = technique.name
    return folded


def optimizers() -> tuple[str, ...]:
    """Every optimizer name: torch.optim's that memfit runs, and those the optimizer techniques add."""
    return TORCH_OPTIMIZERS + tuple(name for name, cls in REGISTRY.items() if cls.workload_field == "optimizer")


def implementations(optimizer: str) -> tuple[str, ...]:
    """The --optimizer-impl values `optimizer` runs with: torch.optim's all three; an optimizer technique declares
    its own (none for those with their own kernels)."""
    # an optimizer name that is not torch.optim's is an optimizer technique's (optimizer_states._Optimizer)
    return TORCH_OPTIMIZER_IMPLS if optimizer in TORCH_OPTIMIZERS else cast(
        "type[_Optimizer]", REGISTRY[optimizer]).implementations


def _check_settings(workload: Workload) -> None:
    known = optimizers()
    if workload.optimizer not in known:
        raise MemfitError(f"unknown optimizer {workload.optimizer!r}; choose one of {', '.join(known)}."
                          f"{closest(workload.optimizer, known)}")
    impls = implementations(workload.optimizer)
    if workload.optimizer_impl is not None and workload.optimizer_impl not in impls:
        raise MemfitError(f"--optimizer-impl {workload.optimizer_impl}: {workload.optimizer} runs "
                          + (f"as {' or '.join(impls)} only." if impls else "its own kernels (no torch.optim "
                             "implementation to choose); drop --optimizer-impl."))
    if workload.optimizer_impl is not None and workload.engine == "deepspeed":
        raise MemfitError("--optimizer-impl chooses torch.optim's implementation; --engine deepspeed runs DeepSpeed's "
                          "own AdamW: drop --optimizer-impl.")
    if workload.engine == "deepspeed" and get_precision(workload.precision).autocast_dtype is None:
        raise MemfitError(
            f"--engine deepspeed models half-precision training with fp32 master weights; use --precision "
            f"{precision_names(autocast=True)}, not {workload.precision}.")


def _source_of(workload: ResolvedWorkload) -> ModelSource:
    source = resolve_source(workload.model, workload.inputs)
    overrides = {k: v for t in workload.technique_configs for k, v in t.config_overrides(source).items()}
    if overrides:
        source = replace(source, overrides={**source.overrides, **overrides})
    tokens = effective_seq_len(workload, source) + workload.new_tokens
    if workload.allow_long_seq and source.max_seq_len and tokens > source.max_seq_len:
        assert source.hf_config is not None   # only a Hugging Face config has a maximum length
        key = "n_positions" if "n_positions" in source.hf_config else "max_position_embeddings"
        source = replace(source, overrides={**source.overrides, key: tokens})
    return source


def with_technique(workload: Workload, technique: Technique) -> ResolvedWorkload:
    """`workload` with `technique` added (a precision or optimizer technique replaces that field)."""
    if technique.workload_field:
        # the field is a str one (precision, optimizer): a dict[str, str] would be checked against every field
        return resolve(replace(workload, **cast("dict[str, Any]", {technique.workload_field: technique.name})))
    return resolve(replace(workload, techniques=tuple(workload.techniques) + (technique.spec,)))


def without_technique(workload: Workload, technique: Technique) -> ResolvedWorkload:
    """`workload` without `technique` (a precision or optimizer technique: that field back to its default)."""
    if technique.workload_field:
        default: Any = Workload.__dataclass_fields__[technique.workload_field].default   # the field has one
        return resolve(replace(workload, **{technique.workload_field: default}))
    kept = tuple(s for s in workload.techniques if parse_technique(s).name != technique.name)
    return resolve(replace(workload, techniques=kept))


def all_techniques(workload: ResolvedWorkload) -> list[Technique]:
    """Every technique the workload uses, its precision and optimizer included (when they are techniques), as
    their savings are reported: DeepSpeed's engine needs its half precision, so it has no "without"."""
    fields = [t for t in workload.field_techniques
              if not (workload.engine == "deepspeed" and t.workload_field == "precision")]
    return fields + list(workload.technique_configs)
