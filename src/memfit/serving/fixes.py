"""A serving engine's start-up failure, read from its log, and the fixes computed for the model that failed: each a
change of one setting, estimated as the engine would size it, kept where it starts, with what it buys (requests at
the context, cache tokens) and what it costs.

The failures (vLLM's and SGLang's words): no memory left for the cache blocks; a context longer than the cache holds
(V0: "larger than the maximum number of tokens that can be stored in KV cache", V1: "... KV cache is needed, which
is larger than the available KV cache memory"); less free memory at start than the utilization asks; a CUDA
out-of-memory error while capturing CUDA graphs or warming up the sampler. What the log states (the context, the
device's total, the utilization) is taken as the setting unless the user gave it.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from memfit.core.errors import MemfitError
from memfit.core.units import GiB
from memfit.serving.estimate import ServingEstimate, estimate_serving
from memfit.serving.served_model import ServedModel
from memfit.serving.settings import ServeSettings
from memfit.specs.hardware import GPU

_NUMBER = r"([\d.]+)"
PATTERNS = (
    ("no-cache-memory", re.compile(r"No available memory for the cache blocks|Not enough memory\. Please try to "
                                   r"increase --mem-fraction-static")),
    ("context-too-long", re.compile(r"max seq len \((\d+)\) is larger than the maximum number of tokens that can be "
                                    r"stored in KV cache \((\d+)\)")),
    ("context-too-long", re.compile(r"the model's max seq len \((\d+)\), \(" + _NUMBER + r" GiB KV cache is needed")),
    ("free-memory", re.compile(r"Free memory on device \(" + _NUMBER + "/" + _NUMBER + r" GiB\) on startup is less "
                               r"than desired GPU memory utilization \(" + _NUMBER)),
    ("oom", re.compile(r"CUDA out of memory|OutOfMemoryError")),
)
SUMMARIES = {
    "no-cache-memory": "the weights, the profile run and the memory outside torch left no room for the KV cache",
    "context-too-long": "the KV cache cannot hold one request at max_model_len",
    "free-memory": "other processes hold memory the utilization budget counts on",
    "oom": "a CUDA out-of-memory error during start-up (CUDA graphs or the sampler's warm-up, above the budget)",
}


@dataclass(frozen=True)
class ServingFailure:
    kind: str
    message: str
    max_model_len: int | None = None
    total_bytes: int | None = None
    utilization: float | None = None

    @property
    def summary(self) -> str:
        return SUMMARIES[self.kind]


def parse_failure(text: str) -> ServingFailure:
    """The start-up failure in `text` (a log or a traceback), or a one-line MemfitError."""
    for kind, pattern in PATTERNS:
        match = pattern.search(text)
        if not match:
            continue
        line = next((ln.strip() for ln in text.splitlines() if match.group(0) in ln), match.group(0))[:400]
        if kind == "context-too-long":
            return ServingFailure(kind, line, max_model_len=int(match.group(1)))
        if kind == "free-memory":
            try:
                return ServingFailure(kind, line, total_bytes=round(float(match.group(2)) * GiB),
                                      utilization=float(match.group(3)))
            except ValueError:
                return ServingFailure(kind, line)
        return ServingFailure(kind, line)
    raise MemfitError("no serving start-up failure found in the text (vLLM's 'No available memory for the cache "
                      "blocks', '... larger than the maximum number of tokens that can be stored in KV cache', "
                      "'Free memory on device ...', a CUDA out-of-memory error); paste the end of the engine's log.")


@dataclass
class Fix:
    change: str                   # the flags that change, as the engine spells them
    cost: str
    estimate: ServingEstimate


def serving_fixes(model: ServedModel, gpu: GPU, settings: ServeSettings) -> list[Fix]:
    """Each single change that makes the engine start, estimated; the order: what costs nothing first."""
    base = estimate_serving(model, gpu, settings)
    util = base.settings.get("gpu_memory_utilization") or base.settings.get("mem_fraction_static") or 0.9
    candidates: list[tuple[str, str, dict[str, Any]]] = []
    if base.max_model_len_fits and base.max_model_len_fits < base.max_model_len:
        candidates.append((f"--max-model-len {base.max_model_len_fits}", "shorter requests", {
            "max_model_len": base.max_model_len_fits}))
    field = "gpu_memory_utilization" if settings.engine == "vllm" else "mem_fraction_static"
    for higher in (0.92, 0.95, 0.98):
        if higher > util:
            candidates.append((f"--{field.replace('_', '-')} {higher}", "less headroom for other processes and "
                               "spikes", {field: higher}))
    if settings.kv_cache_dtype == "auto":
        candidates.append(("--kv-cache-dtype fp8", "lossy: keys and values in 8 bits (small accuracy cost)",
                           {"kv_cache_dtype": "fp8"}))
    if settings.engine == "vllm" and not settings.enforce_eager:
        candidates.append(("--enforce-eager", "slower decoding (no CUDA graphs)", {"enforce_eager": True}))
    if settings.engine == "vllm" and (settings.max_num_seqs or base.settings.get("max_num_seqs", 0)) > 64:
        candidates.append(("--max-num-seqs 64", "fewer requests per step", {"max_num_seqs": 64}))
    for tp in (2, 4, 8):
        if tp > settings.tensor_parallel and model.heads % tp == 0:
            candidates.append((f"--tensor-parallel {tp}", f"{tp} GPUs per replica", {"tensor_parallel": tp}))
            break
    if model.quantization is None and settings.quantization is None:
        candidates.append(("a fp8 checkpoint (--quantization fp8)", "lossy: 8-bit weights", {"quantization": "fp8"}))
        candidates.append(("an AWQ int4 checkpoint (--quantization awq)", "lossy: 4-bit weights",
                           {"quantization": "awq"}))
    fixes = []
    for change, cost, values in candidates:
        try:
            estimate = estimate_serving(model, gpu, dataclasses.replace(settings, **values))
        except MemfitError:
            continue
        if estimate.starts:
            fixes.append(Fix(change, cost, estimate))
    return fixes


def with_log_settings(settings: ServeSettings, failure: ServingFailure, given: set[str]) -> ServeSettings:
    """The settings the log states, where the user did not give them."""
    values: dict[str, Any] = {}
    if failure.max_model_len and "max_model_len" not in given:
        values["max_model_len"] = failure.max_model_len
    if failure.utilization and "gpu_memory_utilization" not in given and settings.engine == "vllm":
        values["gpu_memory_utilization"] = failure.utilization
    return dataclasses.replace(settings, **values) if values else settings
