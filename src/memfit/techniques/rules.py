"""How techniques combine: one canonical order, and the rules the techniques declare between them.

Everything here runs before the model is touched: a bad combination or an unknown technique is a
MemfitError and nothing has been changed.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from memfit.core.errors import MemfitError
from memfit.techniques.base import REGISTRY, Technique, parse_technique
from memfit.techniques.stages import ORDER

if TYPE_CHECKING:
    from memfit.techniques.resolve import ResolvedWorkload

_STAGE_INDEX = {stage: i for i, (stage, _) in enumerate(ORDER)}


def ordered(techniques: Iterable[Technique]) -> list[Technique]:
    return sorted(techniques, key=lambda t: (_STAGE_INDEX[t.stage], t.name))


def parse_all(specs: Iterable[str | Technique]) -> list[Technique]:
    """Parsed technique configs in the canonical order; a technique given twice, or two that set the same
    workload field, are refused."""
    parsed = [s if isinstance(s, Technique) else parse_technique(s) for s in specs]
    seen: dict[str, Technique] = {}
    for technique in parsed:
        if technique.name in seen:
            raise MemfitError(f"-t {technique.name} is given twice ({seen[technique.name].spec}, {technique.spec}); "
                              "keep one.")
        seen[technique.name] = technique
    fields: dict[str, Technique] = {}
    for technique in parsed:
        field = technique.workload_field
        if field and field in fields:
            raise MemfitError(f"-t {fields[field].name} and -t {technique.name} both set the {field}; keep one.")
        if field:
            fields[field] = technique
    return ordered(parsed)


def check_rules(techniques: list[Technique], workload: ResolvedWorkload | None) -> None:
    """Refuse the first combination that a technique's declared rules forbid (`conflicts`: with another technique
    by name or by trait; `deepspeed_conflict`: under DeepSpeed's engine), with its reason and fix."""
    if workload is not None:
        techniques = workload.field_techniques + [t for t in techniques if t.workload_field is None]
    for technique in techniques:
        for key, (reason, fix) in technique.conflicts().items():
            for other in techniques:
                if (other is not technique and (other.name == key or key in other.traits)
                        and not technique.shares_mesh_with(other) and not other.shares_mesh_with(technique)):
                    names = " + ".join(sorted((technique.name, other.name)))
                    raise MemfitError(f"{names}: {reason.format(other=other.name)}; {fix.format(other=other.name)}.")
        if workload is not None and workload.engine == "deepspeed" and technique.deepspeed_conflict:
            reason, fix = technique.deepspeed_conflict
            raise MemfitError(f"{technique.name}: --engine deepspeed {reason}; {fix.format(other=technique.name)}.")


def declared_rules() -> list[dict]:
    """Every rule the registered techniques declare (`memfit techniques --json`)."""
    rules = []
    for cls in sorted(REGISTRY.values(), key=lambda c: (_STAGE_INDEX[c.stage], c.name)):
        for key, (reason, fix) in cls.conflicts_with.items():
            rules.append({"technique": cls.name, "with": key, "reason": reason, "fix": fix})
        if cls.deepspeed_conflict:
            rules.append({"technique": cls.name, "with": "--engine deepspeed", "reason": cls.deepspeed_conflict[0],
                          "fix": cls.deepspeed_conflict[1]})
    return rules
