"""model_type -> the symbolic program that models it."""
from __future__ import annotations

import json
from types import ModuleType

from memfit.core.errors import MemfitError
from memfit.estimators.analytic.families import bert, decoder, derived, gpt2, t5, vit
from memfit.estimators.derived_program import derivable, derived_program, derived_techniques

_FAMILIES: dict[str, tuple[ModuleType, type]] = {
    **{name: (decoder, decoder.DecoderSpec) for name in decoder.FAMILIES},
    **{name: (gpt2, gpt2.GPT2Spec) for name in gpt2.FAMILIES},
    **{name: (bert, bert.BertSpec) for name in bert.FAMILIES},
    **{name: (vit, vit.ViTSpec) for name in vit.FAMILIES},
    **{name: (t5, t5.T5Spec) for name in t5.FAMILIES},
}
_SPECS: dict[str, object] = {}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def has_family(source) -> bool:
    """The analytic estimator has a program for this model source's family."""
    return source.is_hf and source.model_type in _FAMILIES


def family_of(source):
    """(family module, spec) for a model source; a spec is built once per distinct config."""
    entry = _FAMILIES.get(source.model_type)
    if entry is None:
        raise MemfitError(
            f"no written analytic model for model_type {source.model_type!r} (supported: "
            f"{', '.join(supported_model_types())}); a program derived from its trace covers training, with any of "
            f"{', '.join(derived_techniques())}; use --method traced.")
    module, spec_type = entry
    key = json.dumps(source.config_fields, sort_keys=True)
    if key not in _SPECS:
        _SPECS[key] = spec_type.from_config(source.config())
    return module, _SPECS[key]


def has_program(workload) -> bool:
    """A written family models the workload's model, or a program can be derived from its trace (training)."""
    return has_family(workload.source) or derivable(workload)


def written_or_derived(workload, gpu, peak_of):
    """(family module, spec) for a resolved workload on `gpu`'s kernels: the written family's, else the program
    derived from the model's traced block (estimators/derived_program.py), checked with `peak_of` (the symbolic
    engine's peak of a workload: simulate.program_of passes it)."""
    if not takes_derived(workload):
        return family_of(workload.source)
    return derived, derived_program(workload, gpu, peak_of)


def takes_derived(workload) -> bool:
    """No written family models the workload's model, and a program derived from its trace does."""
    return not has_family(workload.source) and derivable(workload)
