"""Finding a Hugging Face model's config from what the user typed, without torch: a bundled catalog name or its hub id
(a post-trained variant of a bundled model takes the bundled shapes), another hub id (hub.py), or a config.json path
or a folder holding one. `model_source.resolve_source` builds models from what this finds; the serving estimate
(estimators/serving/) reads the config alone, so it answers before torch would have loaded."""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from memfit.core.errors import MemfitError, closest
from memfit.specs.hub import hub_config, looks_like_hub_id


@lru_cache(maxsize=1)
def catalog() -> dict[str, dict]:
    """name -> bundled model document (schema memfit.model/1)."""
    docs = {}
    for entry in resources.files("memfit.specs").joinpath("configs").iterdir():
        if entry.name.endswith(".json"):
            doc = json.loads(entry.read_text())
            docs[doc["name"]] = doc
    return dict(sorted(docs.items()))


@dataclass(frozen=True)
class FoundConfig:
    name: str
    kind: str                         # "catalog" | "hf-config"
    hf_config: dict
    where: str                        # how a message names it
    doc: dict = field(default_factory=dict)   # the catalog document (reference, published counts), {} otherwise
    note: str | None = None
    asked: str = ""                   # what the user typed


# words in a hub id that name a post-trained (or the base) variant of the same shapes: "-Instruct", "-it", "-Base"...
_VARIANT_WORDS = frozenset({"instruct", "it", "pt", "base", "chat"})


def base_id(hub_id: str) -> str:
    """A hub id, lower-cased, without the words that name a post-trained variant (Llama-3.2-1B-Instruct ->
    llama-3.2-1b, gemma-3-1b-it -> gemma-3-1b, Mistral-Small-24B-Instruct-2501 -> mistral-small-24b-2501)."""
    org, _, name = hub_id.lower().rpartition("/")
    return f"{org}/" + "-".join(word for word in name.split("-") if word not in _VARIANT_WORDS)


def is_config_path(spec: str) -> bool:
    """`spec` names a config.json or a folder (not a path/file.py:function factory)."""
    file_factory = spec.partition(":")[0].endswith(".py")
    return (spec.endswith(".json") or os.path.isdir(spec) or os.sep in spec) and not file_factory


def find_config(spec: str) -> FoundConfig | None:
    """The Hugging Face config `spec` names, or None where it names something else (a factory, a live model);
    a one-line MemfitError where it names a config that cannot be read."""
    spec = asked = spec.strip()
    docs = catalog()
    by_hub_id = {doc["reference"].lower(): name for name, doc in docs.items() if doc.get("reference")}
    by_base_id = {base_id(doc["reference"]): name for name, doc in docs.items() if "/" in (doc.get("reference") or "")}
    note = None
    if spec.lower() in by_hub_id:   # a bundled model named by its Hugging Face hub id
        spec = by_hub_id[spec.lower()]
    elif looks_like_hub_id(spec) and base_id(spec) in by_base_id:
        base = by_base_id[base_id(spec)]
        note = (f"{spec} is not bundled: memfit took the shapes of {base} ({docs[base]['reference']}), the same "
                "model before or after post-training")
        spec = base
    if spec in docs:
        doc = docs[spec]
        return FoundConfig(spec, "catalog", copy.deepcopy(doc["hf_config"]), repr(spec), doc, note, asked)
    if looks_like_hub_id(spec):
        try:
            hf_config = hub_config(spec)
        except MemfitError as exc:
            hub_ids = [doc["reference"] for doc in docs.values() if doc.get("reference")]
            raise MemfitError(f"{exc}{closest(spec, hub_ids)}") from None
        return FoundConfig(spec, "hf-config", _checked(hf_config, f"{spec}'s config.json"), f"{spec}'s config.json",
                           asked=asked)
    if is_config_path(spec):
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        try:
            with open(path) as fh:
                hf_config = json.load(fh)
        except FileNotFoundError:
            raise MemfitError(f"no model config at {path!r}; give a catalog name, a config.json path or "
                              "module:function.") from None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise MemfitError(f"cannot read model config {path!r}: {exc}") from None
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
        return FoundConfig(name, "hf-config", _checked(hf_config, repr(path)), repr(path), asked=asked)
    return None


def _checked(hf_config, where: str) -> dict:
    if not isinstance(hf_config, dict) or "model_type" not in hf_config:
        raise MemfitError(f"{where} is not a Hugging Face config.json: it has no 'model_type'.")
    return hf_config
