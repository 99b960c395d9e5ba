"""The engine releases memfit models, and where their accounting changed. A version is any release in the range
memfit models (an unknown one is one line); what decides the rules is the era it falls in.

vLLM (its sources and changelogs; ../shared/data/published_serving.md's rows are the checks):
  <= 0.6.4   V0, global budget: the cache gets total x utilization less everything the device holds after the profile
             run — the weights, the profile's peak, the CUDA context and any other process's memory.
  0.6.5      per-instance budget (PR #10511): what this instance added since its start snapshot; V0's profile.
  0.8.0      the V1 engine by default: the profile is one flattened batch, the sampler runs on max_num_seqs rows;
             its budget is global again until 0.9.1.
  0.20.0     gpu_memory_utilization 0.92 by default; from 0.20.1 the token figure is concurrency x max_model_len.
  0.21.0     CUDA-graph memory is estimated and subtracted before the cache is sized (before, graphs were captured
             after it, on top of the budget).
SGLang and TGI: one era each (their rules have not changed in the releases memfit checks against).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from memfit.core.errors import MemfitError

ENGINES = ("vllm", "sglang", "tgi")
LOCAL_ENGINES = ("llama.cpp", "ollama")   # GGUF engines: their own settings (serving/llamacpp.py)
NEWEST = {"vllm": "0.32.0", "sglang": "0.5.9", "tgi": "3.3.6"}
OLDEST = {"vllm": "0.4.0", "sglang": "0.4.0", "tgi": "1.0.0"}


@dataclass(frozen=True)
class Release:
    engine: str
    version: str

    @property
    def key(self) -> tuple[int, ...]:
        return version_key(self.version)

    def at_least(self, version: str) -> bool:
        return self.key >= version_key(version)

    # vLLM's eras
    @property
    def global_budget(self) -> bool:
        """The budget counts everything the device holds (other processes, the CUDA context): V0 to 0.6.4, and V1
        from its first default release (0.8.0) to 0.9.0; per instance in V0 from 0.6.5 and in V1 from 0.9.1."""
        if self.engine != "vllm":
            return False
        return not self.at_least("0.6.5") or (self.at_least("0.8.0") and not self.at_least("0.9.1"))

    @property
    def v1(self) -> bool:
        return self.engine == "vllm" and self.at_least("0.8.0")

    @property
    def graphs_in_budget(self) -> bool:
        return self.engine == "vllm" and self.at_least("0.21.0")

    @property
    def default_utilization(self) -> float:
        return 0.92 if self.engine == "vllm" and self.at_least("0.20.0") else 0.9


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def release_of(engine: str, version: str | None) -> Release:
    """The release `version` of `engine` (None: the newest memfit models), or a one-line MemfitError."""
    if version is None:
        return Release(engine, NEWEST[engine])
    text = str(version).strip().lstrip("v")
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?([.+-]?\w+)*", text):
        raise MemfitError(f"--engine-version {version!r} is not a version number like {NEWEST[engine]}.")
    key = version_key(text)
    if not version_key(OLDEST[engine]) <= key <= version_key(NEWEST[engine]):
        raise MemfitError(f"{engine} {text} is outside the releases memfit models ({OLDEST[engine]} to "
                          f"{NEWEST[engine]}); give one in that range.")
    return Release(engine, text)
