"""`memfit estimate MODEL --task serve --engine ollama`: Ollama's names and defaults by release, and how that release
sizes the load: its own estimate (up to 0.12.10: it chooses num_gpu and the slots), its layout (0.12.11 to 0.2x),
or llama-server with llama.cpp's --fit (from 0.30)."""
from __future__ import annotations

import argparse

from memfit.serving.gguf_file import GGUFModel
from memfit.serving.llamacpp import LlamaCppSettings
from memfit.serving.ollama import OllamaEstimate, ollama_gpus
from memfit.serving.ollama_layout import OllamaLayout
from memfit.serving.ollama_load import place, placement_notes, runner_settings
from memfit.serving.ollama_releases import OllamaRelease, default_num_ctx, default_parallel, release_named


def add_ollama_settings(group) -> None:
    """Ollama's own names for its settings (a Modelfile's PARAMETERs and the server's environment)."""
    group.add_argument("--num-ctx", type=int, metavar="N", help="context per slot (default: the release's: 2048, "
                       "4096 from 0.6.7, by the GPUs' memory from 0.15.5)")
    group.add_argument("--num-parallel", type=int, metavar="N", help="slots, OLLAMA_NUM_PARALLEL (default: the "
                       "release's: 4 then 1 where 4 do not fit, 2 from 0.6.7, 1 from 0.10)")
    group.add_argument("--num-gpu", type=int, metavar="N",
                       help="layers on the GPU (default: what Ollama's estimate or llama.cpp's --fit chooses)")
    group.add_argument("--flash-attention", choices=("on", "off"), help="OLLAMA_FLASH_ATTENTION (default: off; "
                       "llama-server's auto from 0.30)")
    group.add_argument("--kv-cache-type", choices=("f16", "q8_0", "q4_0"), help="OLLAMA_KV_CACHE_TYPE (before 0.30 "
                       "only with --flash-attention on)")


def release_of(args: argparse.Namespace) -> OllamaRelease:
    """--engine-version for Ollama: its release (0.5.4), or a date (the release then, and llama.cpp's build then)."""
    return release_named(getattr(args, "engine_version", None))[0]


def ollama_settings(args: argparse.Namespace, total_vram: int = 0) -> LlamaCppSettings:
    """The settings Ollama's runner loads with at the release given (runner_settings)."""
    release = release_of(args)
    return runner_settings(release, num_ctx=args.num_ctx or default_num_ctx(release, total_vram),
                           parallel=args.num_parallel or default_parallel(release),
                           num_gpu=-1 if args.num_gpu is None else args.num_gpu,
                           flash=getattr(args, "flash_attention", None),
                           cache=getattr(args, "kv_cache_type", None) or "f16",
                           engine_version=release_named(getattr(args, "engine_version", None))[1])


def ollama_load(model: GGUFModel, settings: LlamaCppSettings, args: argparse.Namespace, free: list[int] | None,
                vendor: str | None, gpus: int
                ) -> tuple[LlamaCppSettings, int, OllamaEstimate | OllamaLayout | None, str]:
    """What Ollama's release loads: up to 0.12 its scheduler and estimate choose the slots (where --num-parallel is
    not given), the GPUs and num_gpu (where --num-gpu is not given); from 0.12.11 its layout places the layers
    GPU by GPU; from 0.30 llama.cpp's --fit does (replayed with llama.cpp's). Returns the settings llama.cpp then
    loads with, the GPUs, Ollama's estimate or layout, and a note where it could not be replayed."""
    release = release_of(args)
    if release.sizing == "fit":
        return settings, gpus, None, ""
    if not free:
        return settings, gpus, None, (f"Ollama {release.name}'s own {release.sizing} chooses num_gpu for the GPUs' "
                                      "free memory: give --gpu NAME or --gpu-free MiB to see its choice")
    changed, used, placed = place(model, settings, release, ollama_gpus(free, vendor), parallel=args.num_parallel)
    notes = placement_notes(model, changed, placed, asked_cache=getattr(args, "kv_cache_type", None))
    return changed, used, placed, "; ".join(notes)


def ollama_json(placed: OllamaEstimate | OllamaLayout | None, args: argparse.Namespace) -> dict | None:
    if args.engine != "ollama":
        return None
    release = release_of(args)
    source = (f"Ollama's llm/memory.go and fs/ggml GraphSize at {release.name}, replayed (checked on the estimates "
              "of five published Ollama logs)") if release.sizing == "estimate" else (
        f"Ollama's llm/server.go layout at {release.name} on GraphSize's memory, replayed (checked on one published "
        "figure)")
    estimate = layout = None
    if isinstance(placed, OllamaEstimate):
        estimate = {**placed.fields(), "layers": placed.layers, "required_full_bytes": placed.required_full,
                    "required_partial_bytes": placed.required_partial, "kv_bytes": placed.kv,
                    "allocations_bytes": placed.allocations, "graph_full_bytes": placed.graph_full,
                    "graph_partial_bytes": placed.graph_partial, "projector_weights_bytes": placed.projector_weights,
                    "projector_graph_bytes": placed.projector_graph}
    elif isinstance(placed, OllamaLayout):
        layout = {"lines": placed.log_lines(), "layers": placed.layers,
                  "per_gpu": [len(slots) for _, slots in placed.gpu_layers], "graph_bytes": placed.graph}
    return {"release": release.name, "sizing": release.sizing, "source": source if placed else None,
            "estimate": estimate, "layout": layout}


def ollama_lines(placed: OllamaEstimate | OllamaLayout) -> list[str]:
    """What Ollama's log prints of its choice."""
    if isinstance(placed, OllamaEstimate):
        return [f"Ollama {placed.release.name}'s estimate, as its log prints it: {placed.log_line()}"]
    return [f"Ollama {placed.release.name}'s layout, as its log prints it:"] + [f"  {line}"
                                                                               for line in placed.log_lines()]
