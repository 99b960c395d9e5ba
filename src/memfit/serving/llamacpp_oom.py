"""llama.cpp's allocation failures, read from its log, and the fixes computed for the model that failed: which buffer
did not fit (the weights at load, the KV cache, the compute buffer the scheduler reserves, or Ollama's check of the
system's memory), and each single change that makes the GPU's buffers fit, with what it buys.

Its words: "cudaMalloc failed: out of memory", "failed to allocate CUDA0 buffer of size N", "unable to allocate
CUDA0 buffer", "failed to allocate buffer for kv cache", "failed to allocate compute buffers", Ollama's "model
requires more system memory (X GiB) than is available (Y GiB)". What the log states (n_ctx, n_ubatch, the layers
offloaded, flash attention, the cache types) is taken as the setting unless the user gave it.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from memfit.core.errors import MemfitError
from memfit.core.units import GiB, MiB
from memfit.serving.gguf_file import GGUFModel
from memfit.serving.llamacpp import LlamaCppEstimate, LlamaCppSettings, estimate_llamacpp
from memfit.serving.llamacpp_plan import QUALITY
from memfit.specs.hardware import GPU

FAILURES = (   # (buffer, pattern), the first that matches names the buffer
    ("kv", re.compile(r"failed to allocate buffer for kv cache|llama_kv_cache.*failed|KV buffer.*fail", re.I)),
    ("compute", re.compile(r"failed to allocate compute (pp )?buffers|ggml_gallocr_reserve_n: failed|"
                           r"sched_reserve.*fail", re.I)),
    ("weights", re.compile(r"unable to allocate \w+ buffer|failed to load model|load_tensors.*fail|"
                           r"alloc_tensor_range: failed", re.I)),
    ("host", re.compile(r"model requires more system memory \(([\d.]+) (GiB|MiB)\) than is available "
                        r"\(([\d.]+) (GiB|MiB)\)")),
    ("gpu", re.compile(r"cudaMalloc failed|out of memory|ErrorOutOfDeviceMemory", re.I)),
)
SUMMARIES = {
    "weights": "the weights the GPU holds did not fit it at load",
    "kv": "the KV cache did not fit the GPU after the weights",
    "compute": "the compute buffer the scheduler reserves did not fit the GPU after the weights and KV cache",
    "host": "Ollama found less free system memory than the model needs",
    "gpu": "a GPU allocation failed (the buffer it was for is not in the excerpt)",
}
_SIZE = re.compile(r"allocating ([\d.]+) MiB on device|buffer of size (\d+)")
_SETTINGS = {
    "ctx_size": re.compile(r"\bn_ctx\s*=\s*(\d+)"), "n_ubatch": re.compile(r"\bn_ubatch\s*=\s*(\d+)"),
    "n_batch": re.compile(r"\bn_batch\s*=\s*(\d+)"), "n_gpu_layers": re.compile(r"offloaded (\d+)/\d+ layers to GPU"),
    "flash_attn": re.compile(r"\bflash_attn\s*=\s*(\w+)"), "cache_type_k": re.compile(r"type_k = '(\w+)'"),
    "cache_type_v": re.compile(r"type_v = '(\w+)'"),
}


@dataclass
class LlamaCppFailure:
    buffer: str
    summary: str
    line: str
    failed_bytes: int = 0            # the allocation that failed, where the log says
    settings: dict | None = None     # what the log states


@dataclass
class Fix:
    change: str                      # a llama.cpp flag (or the file type)
    estimate: LlamaCppEstimate
    gpu_bytes: int
    buys: str


def parse_failure(text: str) -> LlamaCppFailure:
    for buffer, pattern in FAILURES:
        match = pattern.search(text)
        if match:
            line = next((ln.strip() for ln in text.splitlines() if pattern.search(ln)), match.group(0))
            size = _SIZE.search(text)
            failed = 0
            if size:
                failed = int(float(size.group(1)) * MiB) if size.group(1) else int(size.group(2))
            return LlamaCppFailure(buffer, SUMMARIES[buffer], line[:300], failed, _log_settings(text))
    raise MemfitError("no llama.cpp allocation failure in that text (cudaMalloc failed, failed to allocate ... "
                      "buffer, unable to allocate backend buffer, or Ollama's 'model requires more system memory').")


def _log_settings(text: str) -> dict:
    found: dict = {}
    for field, pattern in _SETTINGS.items():
        match = pattern.search(text)
        if not match:
            continue
        value = match.group(1)
        if field == "flash_attn":
            found[field] = "on" if value.lower() in ("1", "true", "enabled", "on") else "off"
        elif field.startswith("cache_type"):
            found[field] = value.lower()
        else:
            found[field] = int(value)
    return found


def with_log_settings(settings: LlamaCppSettings, failure: LlamaCppFailure, given: set[str]) -> LlamaCppSettings:
    """The settings with what the log states, where the user gave nothing."""
    stated = {k: v for k, v in (failure.settings or {}).items() if k not in given}
    return replace(settings, **stated)


def gpu_budget(gpu: GPU) -> int:
    """What llama.cpp's buffers may take of the GPU: its total less the CUDA context (gpus.json's, assumed)."""
    return gpu.memory_bytes - gpu.context_bytes


def fixes(model: GGUFModel, gpu: GPU, settings: LlamaCppSettings,
          requantize: Callable[[str], GGUFModel] | None = None) -> list[Fix]:
    """Each single change that makes the GPU's buffers fit, the least disruptive first: flash attention, a q8_0 KV
    cache, the longest context, the most layers, and with `requantize` (the model in another file type: a Hugging
    Face model's) a smaller file type."""
    budget = gpu_budget(gpu)

    def gpu_bytes(estimate: LlamaCppEstimate) -> int:
        return estimate.buffers["GPU0"].total

    now = estimate_llamacpp(model, settings, gpus=1)
    out = []

    def consider(change: str, candidate: LlamaCppEstimate) -> None:
        used = gpu_bytes(candidate)
        if used <= budget:
            out.append(Fix(change, candidate, used, f"GPU buffers {used / GiB:.2f} GiB (now "
                                                    f"{gpu_bytes(now) / GiB:.2f}; {budget / GiB:.2f} available)"))

    if settings.flash_attn == "off":
        consider("-fa on", estimate_llamacpp(model, replace(settings, flash_attn="on"), gpus=1))
    if settings.cache_type_k == "f16":
        flash = settings.flash_attn if settings.flash_attn != "off" else "on"
        consider("-fa on -ctk q8_0 -ctv q8_0" if flash != settings.flash_attn else "-ctk q8_0 -ctv q8_0",
                 estimate_llamacpp(model, replace(settings, cache_type_k="q8_0", cache_type_v="q8_0",
                                                  flash_attn=flash), gpus=1))
    ctx = now.n_ctx
    longest = _largest(lambda c: estimate_llamacpp(model, replace(settings, ctx_size=c), gpus=1), 256, ctx - 1,
                       gpu_bytes, budget, step=256)
    if longest:
        consider(f"-c {longest[0]}", longest[1])
    slots = now.layers_on_gpu
    most = _largest(lambda n: estimate_llamacpp(model, replace(settings, n_gpu_layers=n), gpus=1), 0, slots - 1,
                    gpu_bytes, budget)
    if most:
        consider(f"-ngl {most[0]} (of {model.n_layer + 1} layer slots)", most[1])
    if requantize is not None:
        for quant in QUALITY:
            candidate = estimate_llamacpp(requantize(quant), settings, gpus=1)
            if gpu_bytes(candidate) < gpu_bytes(now) and gpu_bytes(candidate) <= budget:
                consider(f"a {quant} file (perplexity +{QUALITY[quant]:.2%})", candidate)
                break
    return out


def _largest(estimate, low: int, high: int, gpu_bytes, budget: int, step: int = 1):
    """The largest value in [low, high] (on `step`) whose estimate fits `budget`, with its estimate; None if none."""
    best = None
    lo, hi = low // step, high // step
    while lo <= hi:
        middle = (lo + hi) // 2
        candidate = estimate(max(middle * step, 1))
        if gpu_bytes(candidate) <= budget:
            best, lo = (max(middle * step, 1), candidate), middle + 1
        else:
            hi = middle - 1
    return best
