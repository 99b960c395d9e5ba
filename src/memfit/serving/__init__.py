"""What an LLM serving engine (vLLM, SGLang) sets aside on each GPU, read from the model's config alone: its weights
as the engine stores them, the profile run's activations, the memory outside torch, CUDA graphs and the paged KV cache
the rest becomes. No torch: an answer in well under a second.

    from memfit.serving import estimate
    e = estimate("llama-3.1-8b", engine="vllm", gpu="l4", max_model_len=16384)
    print(e.starts, e.kv_cache_tokens, e.max_concurrency, e.refusal)

`memfit.estimate("llama-3.1-8b", task="serve", engine="vllm", gpu="l4", ...)` is the same call.
"""
from __future__ import annotations

from memfit.core.errors import MemfitError
from memfit.serving.estimate import ServingEstimate, estimate_serving
from memfit.serving.served_model import ServedModel, served_model
from memfit.serving.settings import ServeSettings
from memfit.specs.hardware import GPU, get_gpu
from memfit.specs.model_configs import find_config

__all__ = ["ServeSettings", "ServedModel", "ServingEstimate", "estimate", "load_model"]


def load_model(model: str) -> ServedModel:
    """The model a catalog name, a config.json (or its folder) or a hub id names, as a serving engine loads it."""
    if not isinstance(model, str) or not model.strip():
        raise MemfitError(f"name a model (memfit models lists them), a config.json or a hub id, got {model!r}.")
    found = find_config(model)
    if found is None:
        raise MemfitError(f"{model!r}: serving reads a Hugging Face config (a catalog name, a config.json, a folder "
                          "or a hub id), not a Python factory.")
    return served_model(found)


def estimate(model: str | ServedModel, gpu: GPU | str = "h100", settings: ServeSettings | None = None,
             **knobs) -> ServingEstimate:
    """The engine's start-up on `gpu` with `settings` (or the ServeSettings fields as keywords: engine="vllm",
    max_model_len=..., tensor_parallel=..., gpu_memory_utilization=...)."""
    if settings is None:
        settings = ServeSettings(**knobs)
    elif knobs:
        raise MemfitError(f"give the settings once: a ServeSettings or keywords, not both ({', '.join(knobs)}).")
    served = load_model(model) if isinstance(model, str) else model
    return estimate_serving(served, get_gpu(gpu) if isinstance(gpu, str) else gpu, settings)
