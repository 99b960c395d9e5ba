"""What an Ollama release loads: its llama.cpp runner's settings, and where its own sizing (the estimate up to 0.12.10,
the layout to 0.2x) puts the layers; from 0.30 llama.cpp's --fit does (serving/llamacpp_fit.py)."""
from __future__ import annotations

from dataclasses import replace

from memfit.core.errors import MemfitError
from memfit.serving.gguf_file import GGUFModel
from memfit.serving.llamacpp import LlamaCppEstimate, LlamaCppSettings
from memfit.serving.ollama import OllamaEstimate, OllamaGPU, ollama_gpus, schedule_ollama
from memfit.serving.ollama_layout import OllamaLayout, layout_ollama
from memfit.serving.ollama_releases import OllamaRelease, default_num_ctx, default_parallel

OLLAMA_NAMES = ("num_ctx", "num_parallel", "num_gpu", "flash_attention", "kv_cache_type")   # what a notebook gives


def runner_settings(release: OllamaRelease, *, num_ctx: int, parallel: int, num_gpu: int = -1,
                    flash: str | None = None, cache: str = "f16", engine_version: str | None = None
                    ) -> LlamaCppSettings:
    """The llama.cpp settings Ollama's runner loads with: llama-server's (-c num_ctx x slots, -np slots, -b 512,
    --flash-attn auto unless OLLAMA_FLASH_ATTENTION sets it) from 0.30; before that its llama runner's (one cache of
    num_ctx x slots cells, a 512-token batch, embeddings in the output buffer, flash attention off unless
    OLLAMA_FLASH_ATTENTION, OLLAMA_KV_CACHE_TYPE only with it)."""
    if parallel < 1 or num_ctx < 1:
        raise MemfitError("--num-ctx and --num-parallel take a whole number of 1 or more.")
    if release.sizing == "fit":
        return LlamaCppSettings(ctx_size=num_ctx * parallel, parallel=parallel, n_batch=512, n_gpu_layers=num_gpu,
                                flash_attn=flash or "auto", cache_type_k=cache, cache_type_v=cache,
                                engine_version=engine_version)
    if flash != "on":
        cache = "f16"
    return LlamaCppSettings(ctx_size=num_ctx * parallel, parallel=parallel, kv_unified=True, n_batch=512,
                            embeddings=True, flash_attn=flash or "off", n_gpu_layers=num_gpu, cache_type_k=cache,
                            cache_type_v=cache, engine_version=engine_version)


def place(model: GGUFModel, settings: LlamaCppSettings, release: OllamaRelease, gpus: list[OllamaGPU], *,
          parallel: int | None = None) -> tuple[LlamaCppSettings, int, OllamaEstimate | OllamaLayout]:
    """Where a release up to 0.2x puts the layers (its estimate and scheduler, or its layout) and the settings its
    runner then gives llama.cpp: -ngl (num_gpu where set), the GPUs' shares, the slots its scheduler chose (where
    `parallel`, OLLAMA_NUM_PARALLEL, is not set), the context capped by the training one. Returns those settings,
    the GPUs llama.cpp uses and Ollama's estimate or layout."""
    num_ctx = (settings.ctx_size or model.n_ctx_train) // settings.parallel
    num_ctx = min(num_ctx, model.n_ctx_train or num_ctx)
    placed: OllamaEstimate | OllamaLayout
    if release.sizing == "estimate":
        placed, slots, _ = schedule_ollama(model, gpus, release=release, num_ctx=num_ctx, parallel=parallel,
                                           num_gpu=settings.n_gpu_layers, kv_type=settings.cache_type_k)
        counts = placed.split if placed.layers else []
    else:
        slots = settings.parallel
        placed = layout_ollama(model, gpus, release=release, num_ctx=num_ctx, parallel=slots,
                               num_gpu=settings.n_gpu_layers, kv_type=settings.cache_type_k)
        counts = placed.per_gpu(len(gpus)) if placed.layers else []
    layers = settings.n_gpu_layers if settings.n_gpu_layers >= 0 and counts else sum(counts)
    split = tuple(float(n) for n in counts) if len(counts) > 1 else None
    return (replace(settings, ctx_size=num_ctx * slots, parallel=slots, n_gpu_layers=layers, tensor_split=split),
            len(counts), placed)


def placement_notes(model: GGUFModel, settings: LlamaCppSettings, placed: OllamaEstimate | OllamaLayout, *,
                    asked_cache: str | None = None) -> list[str]:
    """What to say of a placement beside llama.cpp's buffers: an OLLAMA_KV_CACHE_TYPE the runner ignored (no flash
    attention), and a layout that left the output layer off while llama.cpp, given -ngl N, loads the last N slots."""
    notes = []
    if asked_cache not in (None, "f16") and settings.cache_type_k == "f16":
        notes.append("Ollama's runner ignores OLLAMA_KV_CACHE_TYPE without flash attention (--flash-attention on)")
    if isinstance(placed, OllamaLayout) and placed.layers \
            and all(model.n_layer not in slots for _, slots in placed.gpu_layers):
        notes.append(f"Ollama's layout leaves the output layer off the GPUs, but its runner passes llama.cpp -ngl "
                     f"{settings.n_gpu_layers}, the last {settings.n_gpu_layers} layer slots, the output layer among "
                     "them: the buffers shown are llama.cpp's")
    return notes


def ollama_gguf(gguf: GGUFModel, release: OllamaRelease, *, engine_version: str | None, free: list[int] | None,
                vendor: str | None = None, num_ctx: int | None = None, num_parallel: int | None = None,
                num_gpu: int | None = None, flash_attention: str | None = None, kv_cache_type: str | None = None
                ) -> LlamaCppEstimate:
    """llama.cpp's buffers as Ollama `release` loads `gguf` on GPUs with `free` bytes each (None: the CPU alone):
    its defaults where a setting is not given, its own choice of the slots and layers (its estimate or layout, their
    log lines first in the notes), or from 0.30 llama.cpp's --fit."""
    from memfit.serving.llamacpp import estimate_llamacpp
    from memfit.serving.llamacpp_fit import fit_llamacpp

    total = sum(free or [])
    settings = runner_settings(release, num_ctx=num_ctx or default_num_ctx(release, total),
                               parallel=num_parallel or default_parallel(release),
                               num_gpu=-1 if num_gpu is None else num_gpu, flash=flash_attention,
                               cache=kv_cache_type or "f16", engine_version=engine_version)
    notes, gpus = [], len(free or [])
    if free and release.sizing == "fit":
        fit = fit_llamacpp(gguf, settings, free=free)
        settings, notes = fit.settings, [f"llama.cpp's --fit: {'; '.join(fit.steps)}"]
    elif free:
        settings, gpus, placed = place(gguf, settings, release, ollama_gpus(free, vendor), parallel=num_parallel)
        notes = [f"Ollama {release.name}'s estimate: {placed.log_line()}"] if isinstance(placed, OllamaEstimate) \
            else [f"Ollama {release.name}'s layout: " + "; ".join(placed.log_lines())]
        notes += placement_notes(gguf, settings, placed, asked_cache=kv_cache_type)
    result = estimate_llamacpp(gguf, settings, engine="ollama", gpus=gpus)
    result.notes[:0] = notes
    return result
