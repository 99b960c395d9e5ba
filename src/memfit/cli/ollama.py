"""`memfit estimate MODEL --task serve --engine ollama`: Ollama's names and defaults by release, and how that release
sizes the load: its own estimate (up to 0.12.x: it chooses num_gpu and the slots), its measured allocations (not
replayed), or llama-server with llama.cpp's --fit (from 0.30)."""
from __future__ import annotations

import argparse
import re
from dataclasses import replace

from memfit.core.errors import MemfitError
from memfit.serving.gguf_file import GGUFModel
from memfit.serving.llamacpp import LlamaCppSettings
from memfit.serving.ollama import (
    OllamaEstimate,
    OllamaGPU,
    OllamaRelease,
    default_num_ctx,
    default_parallel,
    newest_release,
    schedule_ollama,
)

_DATE = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")
LIBRARIES = {"nvidia": "cuda", "amd": "rocm"}   # a catalog GPU's vendor: the library Ollama's log names


def release_of(args: argparse.Namespace) -> OllamaRelease:
    """--engine-version for Ollama: its release (0.5.4), or a date (the release then, and llama.cpp's build then)."""
    text = getattr(args, "engine_version", None)
    if text is None:
        return newest_release()
    return OllamaRelease.at(text) if _DATE.match(text) else OllamaRelease.parse(text)


def llama_version(args: argparse.Namespace, release: OllamaRelease) -> str | None:
    """The llama.cpp build the release runs: the date given, else the release's date (None: the newest rules)."""
    text = getattr(args, "engine_version", None)
    return None if text is None else text if _DATE.match(text) else release.date


def ollama_settings(args: argparse.Namespace, total_vram: int = 0) -> LlamaCppSettings:
    """The settings Ollama's runner loads with: llama-server's (-c num_ctx x slots, -np slots, -b 512) from 0.30,
    before that its llama runner's (one cache of num_ctx x slots cells, a 512-token batch, embeddings in the output
    buffer, flash attention off unless OLLAMA_FLASH_ATTENTION)."""
    release = release_of(args)
    num_ctx = args.num_ctx or default_num_ctx(release, total_vram)
    slots = args.num_parallel or default_parallel(release)
    if slots < 1 or num_ctx < 1:
        raise MemfitError("--num-ctx and --num-parallel take a whole number of 1 or more.")
    layers = -1 if args.num_gpu is None else args.num_gpu
    version = llama_version(args, release)
    if release.sizing == "fit":
        return LlamaCppSettings(ctx_size=num_ctx * slots, parallel=slots, n_batch=512, n_gpu_layers=layers,
                                engine_version=version)
    return LlamaCppSettings(ctx_size=num_ctx * slots, parallel=slots, kv_unified=True, n_batch=512, embeddings=True,
                            flash_attn="off", n_gpu_layers=layers, engine_version=version)


def ollama_gpus(free: list[int], vendor: str | None) -> list[OllamaGPU]:
    library = LIBRARIES.get(vendor or "nvidia")
    if library is None:
        raise MemfitError(f"Ollama's estimate knows CUDA, ROCm and Metal GPUs, not {vendor}'s.")
    return [OllamaGPU(f, library) for f in free]


def scheduled(model: GGUFModel, settings: LlamaCppSettings, args: argparse.Namespace, free: list[int],
              vendor: str | None) -> tuple[LlamaCppSettings, int, OllamaEstimate]:
    """The load Ollama's scheduler and estimate choose (a release up to 0.12.x): the slots (where
    --num-parallel is not given), the GPUs, num_gpu (where --num-gpu is not given) and, on several GPUs, the layers
    each takes (its --tensor-split); the settings llama.cpp then loads with, the GPUs, and the estimate."""
    release = release_of(args)
    num_ctx = (settings.ctx_size or model.n_ctx_train) // settings.parallel
    estimate, slots, chosen = schedule_ollama(model, ollama_gpus(free, vendor), release=release, num_ctx=num_ctx,
                                              parallel=args.num_parallel, num_gpu=settings.n_gpu_layers)
    ctx = min(num_ctx, model.n_ctx_train or num_ctx) * slots
    layers = settings.n_gpu_layers if settings.n_gpu_layers >= 0 else estimate.layers
    if estimate.layers == 0:
        layers, chosen = 0, []   # no layer fits: Ollama runs its CPU runner
    split = tuple(float(n) for n in estimate.split) if len(chosen) > 1 else None
    changed = replace(settings, ctx_size=ctx, parallel=slots, n_gpu_layers=layers, tensor_split=split)
    return changed, len(chosen), estimate
