"""`memfit plan MODEL --engine ollama --gpu G --host-ram R`: the GGUF quantization, flash attention and KV cache type
(OLLAMA_FLASH_ATTENTION, OLLAMA_KV_CACHE_TYPE) with which Ollama's release, left to choose num_gpu itself, loads the
most and the best: Ollama's own choice of layers replayed (its estimate up to 0.12.10, its layout to 0.2x, llama.cpp's
--fit from 0.30), llama.cpp's buffers at that choice checked against the GPU and the host, ranked by quality (or
speed) as the llama.cpp planner ranks.

A setup is refused where Ollama would choose layers whose llama.cpp buffers then overflow the GPU (its estimate is
not llama.cpp's allocation: without flash attention a long context's compute buffer is larger than its graph
formula says), or where the host cannot hold the rest.
"""
from __future__ import annotations

from memfit.core.units import GiB
from memfit.serving.llamacpp import estimate_llamacpp, gguf_model
from memfit.serving.llamacpp_fit import fit_llamacpp
from memfit.serving.llamacpp_oom import gpu_budget
from memfit.serving.llamacpp_plan import HOST_RESERVE, KV_Q8_COST, QUALITY, LlamaCppPlan, LlamaCppPlanResult
from memfit.serving.llamacpp_speed import HOST_BANDWIDTH_GBPS, speed
from memfit.serving.ollama import ollama_gpus
from memfit.serving.ollama_load import place, runner_settings
from memfit.serving.ollama_releases import OllamaRelease, default_num_ctx, default_parallel
from memfit.specs.hardware import GPU


def environments(release: OllamaRelease) -> list[tuple[str | None, str]]:
    """The (OLLAMA_FLASH_ATTENTION, OLLAMA_KV_CACHE_TYPE) searched: unset (its default), and flash attention with an
    f16 and a q8_0 cache (from 0.30 llama-server's auto turns flash attention on where the GPU has it)."""
    if release.sizing == "fit":
        return [(None, "f16"), (None, "q8_0")]
    return [(None, "f16"), ("on", "f16"), ("on", "q8_0")]


def plan_ollama(model: str, gpu: GPU, release: OllamaRelease, *, host_ram_bytes: int, num_ctx: int | None = None,
                parallel: int | None = None, objective: str = "quality", gpus: int = 1,
                host_bandwidth_gbps: float = HOST_BANDWIDTH_GBPS, quants: tuple[str, ...] = tuple(QUALITY)
                ) -> LlamaCppPlanResult:
    """Every searched quantization and environment, at the layers Ollama `release` chooses on `gpus` GPUs of `gpu`
    (their memory less the CUDA context free), where llama.cpp's buffers then fit, ranked."""
    free = [gpu_budget(gpu)] * gpus
    devices = ollama_gpus(free, gpu.vendor)
    num_ctx = num_ctx or default_num_ctx(release, gpu.memory_bytes * gpus)
    plans, rejected, least_host = [], [], 0
    for quant in quants:
        gguf = gguf_model(model, quant)
        for flash, cache in environments(release):
            settings = runner_settings(release, num_ctx=num_ctx, parallel=parallel or default_parallel(release),
                                       flash=flash, cache=cache, engine_version=release.date)
            if release.sizing == "fit":
                fit = fit_llamacpp(gguf, settings, free=free)
                settings, used = fit.settings, gpus
            else:
                settings, used, _ = place(gguf, settings, release, devices, parallel=parallel)
            what = f"{quant}, flash attention {flash or 'default'}, KV {cache}"
            if not settings.n_gpu_layers or not used:
                rejected.append(f"{what}: Ollama puts no layer on the GPU")
                continue
            estimate = estimate_llamacpp(gguf, settings, engine="ollama", gpus=used)
            gpu_bytes = max(b.total for name, b in estimate.buffers.items() if name != "CPU") + gpu.context_bytes
            host_bytes = estimate.buffers["CPU"].total
            if gpu_bytes > gpu.memory_bytes:
                rejected.append(f"{what}: Ollama would put {estimate.layers_on_gpu} layer slots on the GPU, whose "
                                f"llama.cpp buffers then need {gpu_bytes / GiB:.2f} GiB of its "
                                f"{gpu.memory_bytes / GiB:.2f}: it would fail to load")
                continue
            if host_bytes > host_ram_bytes - HOST_RESERVE:
                least_host = min(least_host or host_bytes, host_bytes)
                rejected.append(f"{what}: the host needs {host_bytes / GiB:.1f} GiB")
                continue
            decode, prompt = speed(estimate, gguf, gpu, host_bandwidth_gbps)
            plans.append(LlamaCppPlan(quant, settings, estimate, gpu_bytes, host_bytes, decode, prompt,
                                      QUALITY[quant] + (KV_Q8_COST if settings.cache_type_k == "q8_0" else 0.0)))
    key = (lambda p: (p.ppl_increase, -p.decode_tokens_per_s)) if objective == "quality" else (
        lambda p: (-p.decode_tokens_per_s, p.ppl_increase))
    return LlamaCppPlanResult(model, sorted(plans, key=key), rejected, least_host)
