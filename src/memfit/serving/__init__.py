"""What an LLM serving engine (vLLM, SGLang) sets aside on each GPU, read from the model's config alone: its weights
as the engine stores them, the profile run's activations, the memory outside torch, CUDA graphs and the paged KV cache
the rest becomes. No torch: an answer in well under a second.

    from memfit.serving import estimate
    e = estimate("llama-3.1-8b", engine="vllm", gpu="l4", max_model_len=16384)
    print(e.starts, e.kv_cache_tokens, e.max_concurrency, e.refusal)

`memfit.estimate("llama-3.1-8b", task="serve", engine="vllm", gpu="l4", ...)` is the same call. llama.cpp's
buffers for a .gguf file, or a Hugging Face model with quant="Q4_K_M": estimate_gguf(model, ...), or
memfit.estimate(model, task="serve", engine="llama.cpp", quant=..., ...).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from memfit.core.errors import MemfitError, closest
from memfit.serving.estimate import ServingEstimate, estimate_serving
from memfit.serving.load import Load
from memfit.serving.releases import LOCAL_ENGINES
from memfit.serving.served_model import ServedModel, served_model
from memfit.serving.settings import ServeSettings
from memfit.specs.hardware import GPU, get_gpu
from memfit.specs.model_configs import FoundConfig, find_config

if TYPE_CHECKING:
    from memfit.serving.llamacpp import LlamaCppEstimate

__all__ = ["Load", "ServeSettings", "ServedModel", "ServingEstimate", "estimate", "estimate_gguf", "load_model"]
_FIELDS = [f.name for f in dataclasses.fields(ServeSettings)]


def load_model(model) -> ServedModel:
    """The model a catalog name, a config.json (or its folder) or a hub id names, or a notebook's config (a
    transformers config object, or its dict), as a serving engine loads it."""
    if hasattr(model, "to_dict"):   # a transformers config (model.config in a notebook)
        model = model.to_dict()
    if isinstance(model, dict):
        if "model_type" not in model:
            raise MemfitError("the config given has no 'model_type': pass a transformers config or its dict.")
        name = str(model.get("_name_or_path") or model["model_type"])
        return served_model(FoundConfig(name, "hf-config", model, "the config given", asked=name))
    if not isinstance(model, str) or not model.strip():
        raise MemfitError(f"name a model (memfit models lists them), a config.json or a hub id, got {model!r}.")
    found = find_config(model)
    if found is None:
        raise MemfitError(f"{model!r}: serving reads a Hugging Face config (a catalog name, a config.json, a folder "
                          "or a hub id), not a Python factory.")
    return served_model(found)


def estimate_gguf(model, *, engine: str = "llama.cpp", quant: str | None = None, gpu: GPU | str | None = None,
                  gpus: int = 1, fit: bool = True, version: str | None = None, **settings) -> LlamaCppEstimate:
    """llama.cpp's buffers (a LlamaCppEstimate) for `model`: a .gguf file, or a Hugging Face model (name, config.json,
    hub id, a transformers config or its dict) written as `quant`; with a `gpu`, the layers -ngl puts on `gpus` such
    GPUs (with `fit`, llama.cpp's default --fit first: the context and layers it chooses for the GPUs' memory less the
    CUDA context; its steps in the notes), else the CPU alone; `settings`: LlamaCppSettings' fields (ctx_size=...,
    n_gpu_layers=..., flash_attn=..., n_cpu_moe=..., tensor_split=(3, 1), override_tensor=(("exps", "CPU"),)).
    engine="ollama": `version` its release (0.5.4, or a date; None: the newest) and `settings` Ollama's names
    (num_ctx, num_parallel, num_gpu, flash_attention, kv_cache_type): its own choice of layers, its log lines in the
    notes."""
    from memfit.serving.llamacpp import LlamaCppSettings, estimate_llamacpp, gguf_model
    from memfit.serving.llamacpp_fit import fit_llamacpp
    from memfit.serving.llamacpp_oom import gpu_budget

    if isinstance(gpu, str):
        gpu = get_gpu(gpu)   # an unknown name: one line
    if gpus < 1:
        raise MemfitError(f"gpus={gpus}: 1 or more (gpu=None: the CPU alone).")
    if engine not in LOCAL_ENGINES:
        raise MemfitError(f"engine={engine!r}: a GGUF model runs in {' or '.join(LOCAL_ENGINES)}."
                          f"{closest(str(engine), LOCAL_ENGINES)}")
    if engine == "ollama":
        from memfit.serving.ollama_load import OLLAMA_NAMES, ollama_gguf
        from memfit.serving.ollama_releases import release_named

        unknown = sorted(set(settings) - set(OLLAMA_NAMES))
        if unknown:
            raise MemfitError(f"unknown Ollama setting(s) {', '.join(unknown)}; it takes {', '.join(OLLAMA_NAMES)}."
                              f"{closest(unknown[0], OLLAMA_NAMES)}")
        release, engine_version = release_named(version)
        return ollama_gguf(gguf_model(model, quant), release, engine_version=engine_version,
                           free=None if gpu is None else [gpu_budget(gpu)] * gpus,
                           vendor=gpu.vendor if gpu else None, **settings)
    if version is not None:
        settings["engine_version"] = version
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(LlamaCppSettings)})
    if unknown:
        names = [f.name for f in dataclasses.fields(LlamaCppSettings)]
        raise MemfitError(f"unknown llama.cpp setting(s) {', '.join(unknown)}; it takes {', '.join(names)}."
                          f"{closest(unknown[0], names)}")
    gguf, chosen = gguf_model(model, quant), LlamaCppSettings(**settings)
    steps = []
    if gpu is not None and fit:
        fitted = fit_llamacpp(gguf, chosen, free=[gpu_budget(gpu)] * gpus)
        chosen, steps = fitted.settings, [f"llama.cpp's --fit: {'; '.join(fitted.steps)}"]
    result = estimate_llamacpp(gguf, chosen, engine=engine, gpus=0 if gpu is None else gpus)
    result.notes[:0] = steps
    return result


def estimate(model, gpu: GPU | str = "h100", settings: ServeSettings | None = None, load: Load | dict | None = None,
             **knobs) -> ServingEstimate:
    """The engine's start-up on `gpu` with `settings` (or the ServeSettings fields as keywords: engine="vllm",
    max_model_len=..., tensor_parallel=..., gpu_memory_utilization=...); with a `load` (a Load, or its fields:
    {"input_len": 1024, "output_len": 256, "num_prompts": 200, "max_concurrency": 16}), how fast it serves it.
    llama.cpp and Ollama: estimate_gguf."""
    if settings is None:
        unknown = sorted(set(knobs) - {f.name for f in dataclasses.fields(ServeSettings)})
        if unknown:
            raise MemfitError(f"unknown serving setting(s) {', '.join(unknown)}.{closest(unknown[0], _FIELDS)}")
        settings = ServeSettings(**knobs)
    elif knobs:
        raise MemfitError(f"give the settings once: a ServeSettings or keywords, not both ({', '.join(knobs)}).")
    if isinstance(load, dict):
        unknown = sorted(set(load) - {f.name for f in dataclasses.fields(Load)})
        if unknown:
            raise MemfitError(f"unknown load field(s) {', '.join(unknown)}; a load takes "
                              f"{', '.join(f.name for f in dataclasses.fields(Load))}.")
        load = Load(**load)
    served = model if isinstance(model, ServedModel) else load_model(model)
    return estimate_serving(served, get_gpu(gpu) if isinstance(gpu, str) else gpu, settings, load)
