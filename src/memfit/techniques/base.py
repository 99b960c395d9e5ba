"""What every technique is: a frozen keyword-only config, registered under a name, parsed from
`NAME[:key=value,...]`, that changes the real step (`apply_`) and says what that costs (`effect`).

A technique's `apply_` works on a `StepSetup` (setup.py): the model, how the optimizer is built, the
precision, how a batch is split and how the loss is computed. Techniques that choose one of the
workload's own settings (precision, optimizer) are folded into those fields when a Workload is built
(`workload_field`), so there is one source of truth for each setting.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from memfit.core.errors import MemfitError, closest

if TYPE_CHECKING:
    from memfit.specs.workload import Workload
    from memfit.techniques.setup import StepSetup

RISKS = ("lossless", "numerical", "lossy")


@dataclass(frozen=True, kw_only=True)
class Technique:
    name: ClassVar[str]
    summary: ClassVar[str]
    risk: ClassVar[str]                  # lossless | numerical | lossy
    stage: ClassVar[str]                 # its place in the canonical order (compose.ORDER)
    workload_field: ClassVar[str | None] = None   # "precision" / "optimizer": sets that Workload field
    # Step time relative to the same step without the technique: a cost-model figure (`assumed`)
    # until benchmarks/technique_table.py measures it.
    time_factor: ClassVar[float] = 1.0

    def step_time_factor(self) -> float:
        """This configuration's step-time factor (the class's `time_factor` unless a parameter changes it)."""
        return self.time_factor

    def check(self, workload: Workload) -> None:
        """Raise MemfitError when this technique cannot apply to `workload`."""

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
    assert cls.risk in RISKS and cls.name not in REGISTRY, cls
    REGISTRY[cls.name] = cls
    return cls


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
    from memfit.techniques import catalog  # noqa: F401  (registers every technique)

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
        if not eq or key not in fields:
            known = ", ".join(fields) or "none"
            raise MemfitError(f"-t {spec}: {item!r} is not a parameter of {name} (parameters: {known}).")
        kwargs[key] = _coerce(value, _TYPES[str(fields[key].type).split("|")[0].strip()], name, key)
    return cls(**kwargs)
