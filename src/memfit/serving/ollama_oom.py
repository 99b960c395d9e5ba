"""Ollama's load failures, with its own choice replayed beside llama.cpp's buffers.

On the GPU, an Ollama load fails when llama.cpp's buffers at the layers Ollama chose exceed the card: its estimate
(or layout) is not llama.cpp's allocation. memfit gives both at the log's settings, then the fixes llama.cpp's
buffers allow, in Ollama's words (a Modelfile PARAMETER, the server's environment, another file type).

On the host, "model requires more system memory (X) than is available (Y)" is Ollama's own check before it loads:
X is what its estimate leaves off the GPUs (required.full less required.partial; from 0.12.11 its layout's CPU
layers). memfit replays X, and finds the longest num_ctx and the best file type whose X is within Y.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from memfit.serving.gguf_file import GGUFModel
from memfit.serving.llamacpp import LlamaCppSettings
from memfit.serving.llamacpp_oom import FAILURES, Fix
from memfit.serving.llamacpp_plan import QUALITY
from memfit.serving.ollama import OllamaEstimate, OllamaGPU
from memfit.serving.ollama_layout import OllamaLayout
from memfit.serving.ollama_load import place
from memfit.serving.ollama_releases import OllamaRelease

_HOST = dict(FAILURES)["host"]   # Ollama's refusal, as llama.cpp's failures are read
_OFFLOAD = re.compile(r"layers\.offload=(\d+)")
_AVAILABLE = re.compile(r'memory\.available="?\[([\d.]+) (GiB|MiB)')
_RUNNER = {"parallel": re.compile(r"--parallel (\d+)"), "n_gpu_layers": re.compile(r"--n-gpu-layers (\d+)"),
           "ctx_size": re.compile(r"--ctx-size (\d+)")}
UNITS = {"GiB": 1 << 30, "MiB": 1 << 20}


@dataclass
class HostFix:
    change: str
    system_bytes: int                # what Ollama's check then asks of the host


def runner_settings_in_log(text: str) -> dict:
    """What Ollama's log says it ran its llama runner with (its command line: --ctx-size, --n-gpu-layers, --parallel;
    its estimate's layers.offload)."""
    found = {field: int(m.group(1)) for field, pattern in _RUNNER.items() if (m := pattern.search(text))}
    offload = _OFFLOAD.search(text)
    if offload and "n_gpu_layers" not in found:
        found["n_gpu_layers"] = int(offload.group(1))
    return found


def available_in_log(text: str) -> int | None:
    """The first GPU's free memory as Ollama's log states it (memory.available), rounded as it prints it."""
    match = _AVAILABLE.search(text)
    return int(float(match.group(1)) * UNITS[match.group(2)]) if match else None


def host_failure(text: str) -> tuple[int, int] | None:
    """(required, available) bytes of Ollama's system-memory refusal, as its message rounds them."""
    match = _HOST.search(text)
    if not match:
        return None
    return (int(float(match.group(1)) * UNITS[match.group(2)]), int(float(match.group(3)) * UNITS[match.group(4)]))


def gpu_bytes_expected(placed: OllamaEstimate | OllamaLayout) -> int:
    """What Ollama expects the GPUs to hold: its estimate's required.partial, or its layout's GPU layers and
    graphs."""
    if isinstance(placed, OllamaEstimate):
        return placed.required_partial
    on_gpu = [i for _, slots in placed.gpu_layers for i in slots]
    return sum(placed.layer_weights[i] + placed.layer_cache[i] for i in on_gpu) + placed.graph * len(
        {g for g, _ in placed.gpu_layers})


def system_bytes(placed: OllamaEstimate | OllamaLayout) -> int:
    """What Ollama's check asks of the host: its estimate's required.full less required.partial, or its layout's
    layers left on the CPU."""
    if isinstance(placed, OllamaEstimate):
        return placed.required_full - placed.required_partial
    held = {slot for _, slots in placed.gpu_layers for slot in slots}
    return sum(w + c for i, (w, c) in enumerate(zip(placed.layer_weights, placed.layer_cache)) if i not in held)


def host_fixes(model: GGUFModel, settings: LlamaCppSettings, release: OllamaRelease, gpus: list[OllamaGPU],
               available: int, requantize: Callable[[str], GGUFModel] | None = None, *, parallel: int | None = None
               ) -> list[HostFix]:
    """The longest num_ctx (in 256s) and the best file type with which Ollama's check passes (`parallel`: the
    slots set, None where Ollama's scheduler chooses them)."""
    def needs(gguf: GGUFModel, at: LlamaCppSettings) -> int:
        return system_bytes(place(gguf, at, release, gpus, parallel=parallel)[2])

    out = []
    per_slot = (settings.ctx_size or model.n_ctx_train) // settings.parallel
    best, low, high = None, 1, per_slot // 256 - 1
    while low <= high:
        middle = (low + high) // 2
        used = needs(model, replace(settings, ctx_size=middle * 256 * settings.parallel))
        if used <= available:
            best, low = (middle * 256, used), middle + 1
        else:
            high = middle - 1
    if best:
        out.append(HostFix(f"PARAMETER num_ctx {best[0]}", best[1]))
    if requantize is not None:
        for quant in QUALITY:
            used = needs(requantize(quant), settings)
            if used <= available:
                out.append(HostFix(f"a {quant} file (perplexity +{QUALITY[quant]:.2%})", used))
                break
    return out


def in_ollamas_words(fix: Fix, before: LlamaCppSettings) -> str:
    """A llama.cpp fix as Ollama takes it: a Modelfile PARAMETER or the server's environment (a file type as is)."""
    after, words = fix.estimate.settings, []
    if after.n_gpu_layers != before.n_gpu_layers:
        words.append(f"PARAMETER num_gpu {after.n_gpu_layers}")
    if after.ctx_size != before.ctx_size and after.ctx_size:
        words.append(f"PARAMETER num_ctx {after.ctx_size // after.parallel}")
    if after.flash_attn == "on" and before.flash_attn != "on":
        words.append("OLLAMA_FLASH_ATTENTION=1")
    if after.cache_type_k != before.cache_type_k:
        words.append(f"OLLAMA_KV_CACHE_TYPE={after.cache_type_k}")
    return ", ".join(words) or fix.change
