"""`memfit explain-oom LOG --engine llama.cpp --model MODEL [--quant T] [settings] --gpu G`: which buffer of llama.cpp's
did not fit, and the fixes computed for that model, each with what it buys."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import replace

from memfit.cli.console import output_console, print_json, read_text
from memfit.cli.llamacpp import FLAGS, add_settings, settings_from
from memfit.cli.ollama import add_ollama_settings, ollama_gpus, ollama_settings, release_of
from memfit.core.errors import MemfitError
from memfit.core.units import GiB
from memfit.serving.gguf_recipe import FILE_TYPES
from memfit.serving.llamacpp import estimate_llamacpp, gguf_model
from memfit.serving.llamacpp_oom import LlamaCppFailure, fixes, gpu_budget, parse_failure, with_log_settings
from memfit.serving.ollama_load import place
from memfit.serving.ollama_oom import (
    available_in_log,
    gpu_bytes_expected,
    host_failure,
    host_fixes,
    in_ollamas_words,
    runner_settings_in_log,
    system_bytes,
)
from memfit.specs.hardware import GPU, get_gpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Explain a llama.cpp (or Ollama) allocation failure: which buffer did not fit, and the "
                          "changes that would make it fit, computed for the model.")
    parser.add_argument("source", nargs="?", default="-", help="llama.cpp's log (or - for stdin, the default)")
    parser.add_argument("--engine", choices=("llama.cpp", "ollama"), required=True,
                        help="llama.cpp, or Ollama (its log: its own choice of layers is replayed beside llama.cpp's "
                             "buffers)")
    parser.add_argument("--model", help="the .gguf file, or a Hugging Face model with --quant")
    parser.add_argument("--quant", type=str.upper, metavar="TYPE", help=f"its file type: {', '.join(FILE_TYPES)}")
    parser.add_argument("--gpu", required=True, help="the GPU (memfit gpus)")
    parser.add_argument("--engine-version", metavar="YYYY-MM", help="the llama.cpp build's date (Ollama: its release, "
                        "e.g. 0.5.4, or a date)")
    add_settings(parser.add_argument_group("llama.cpp settings (its own names; the log's where not given)"))
    add_ollama_settings(parser.add_argument_group("Ollama's settings (--engine ollama; the log's where not given)"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    text = read_text(args.source)
    failure = parse_failure(text)
    if not args.model:
        raise MemfitError("name the model that failed (--model FILE.gguf, or a Hugging Face model with --quant): the "
                          "fixes are computed for it.")
    gpu = get_gpu(args.gpu)
    if args.engine == "ollama":
        return explain_ollama(args, text, failure, gpu)
    given = {field for _, field, _, _ in FLAGS if getattr(args, field) is not None}
    settings = with_log_settings(settings_from(args), failure, given)
    model = gguf_model(args.model, args.quant)
    ways_out = fixes(model, gpu, settings,
                     None if args.model.endswith(".gguf") else lambda quant: gguf_model(args.model, quant))
    if args.json:
        print_json({"schema": "memfit.llamacpp-oom/1", "buffer": failure.buffer, "summary": failure.summary,
                    "line": failure.line, "failed_bytes": failure.failed_bytes, "settings_from_log": failure.settings,
                    "gpu_budget_bytes": gpu_budget(gpu),
                    "fixes": [{"change": f.change, "gpu_bytes": f.gpu_bytes, "buys": f.buys} for f in ways_out]})
        return 0
    console = output_console()
    console.print(f"{failure.summary}:\n  {failure.line}")
    console.print(f"{gpu.name}: {gpu_budget(gpu) / GiB:.2f} GiB for llama.cpp's buffers (its total less the CUDA "
                  "context, assumed)")
    if not ways_out:
        console.print("no single change fits it: fewer layers on the GPU and a smaller file type together, or a larger "
                      "GPU (memfit plan --engine llama.cpp searches them)")
    for fix in ways_out:
        console.print(f"  {fix.change:<40} {fix.buys}")
    return 0


# Ollama's names for the settings llama.cpp's log states
OLLAMA_FIELDS = {"num_ctx": ("ctx_size",), "num_gpu": ("n_gpu_layers",), "num_parallel": ("parallel",),
                 "flash_attention": ("flash_attn",), "kv_cache_type": ("cache_type_k", "cache_type_v")}


def explain_ollama(args: argparse.Namespace, text: str, failure: LlamaCppFailure, gpu: GPU) -> int:
    """An Ollama log's failure: Ollama's own choice (its release's estimate or layout) beside llama.cpp's buffers at
    it; on the GPU the fixes in Ollama's words, on the host the num_ctx or file type its check accepts."""
    if any(getattr(args, field) is not None for _, field, _, _ in FLAGS):
        raise MemfitError("--engine ollama takes Ollama's names (--num-ctx, --num-gpu, --num-parallel, "
                          "--flash-attention, --kv-cache-type), not llama.cpp's.")
    release = release_of(args)
    given = {f for name, fields in OLLAMA_FIELDS.items() if getattr(args, name) is not None for f in fields}
    logged = {k: v for k, v in runner_settings_in_log(text).items() if k not in given}
    settings = replace(with_log_settings(ollama_settings(args, gpu.memory_bytes), failure, given), **logged)
    model = gguf_model(args.model, args.quant)
    requantize = None if args.model.endswith(".gguf") else lambda quant: gguf_model(args.model, quant)
    slots = args.num_parallel or logged.get("parallel")   # None: Ollama's scheduler chooses them
    free = available_in_log(text)
    if free is not None:   # what was free when Ollama loaded (other programs may hold the rest of the card)
        gpu = dataclasses.replace(gpu, memory_bytes=free + gpu.context_bytes)
    devices = ollama_gpus([gpu_budget(gpu)], gpu.vendor)
    console = output_console()
    report: dict = {"schema": "memfit.ollama-oom/1", "release": release.name, "sizing": release.sizing,
                    "buffer": failure.buffer, "summary": failure.summary, "line": failure.line,
                    "settings": {"num_ctx": (settings.ctx_size or 0) // settings.parallel,
                                 "num_parallel": settings.parallel, "num_gpu": settings.n_gpu_layers,
                                 "flash_attention": settings.flash_attn, "kv_cache_type": settings.cache_type_k}}
    if release.sizing == "fit":
        raise MemfitError(f"Ollama {release.name} runs llama-server with --fit: explain its log with --engine "
                          "llama.cpp (its settings: -c num_ctx x slots, -np slots).")
    lines = [f"{failure.summary}:\n  {failure.line}"]
    host = host_failure(text)
    if host is not None:
        chooses = settings if args.num_gpu is not None else replace(settings, n_gpu_layers=-1)
        placed = place(model, chooses, release, devices, parallel=slots)[2]
        needed, available = host
        replayed = system_bytes(placed)
        ways = [] if replayed <= available else host_fixes(model, chooses, release, devices, available, requantize,
                                                              parallel=slots)
        lines.append(f"Ollama {release.name}'s check: the {placed.layers} layer slots it puts on {gpu.name} leave "
                     f"{replayed / GiB:.1f} GiB for the host (its log: {needed / GiB:.1f} GiB; available "
                     f"{available / GiB:.1f} GiB)")
        if replayed <= available:
            lines.append("  (at these settings the check passes: the log's settings are not these; give its num_ctx, "
                         "num_parallel and num_gpu)")
        lines += [f"  {fix.change:<40} the host then needs {fix.system_bytes / GiB:.1f} GiB" for fix in ways]
        report.update(system_bytes=replayed, logged_system_bytes=needed, available_bytes=available,
                      fixes=[{"change": f.change, "system_bytes": f.system_bytes} for f in ways])
    else:
        if "n_gpu_layers" not in logged and "n_gpu_layers" not in (failure.settings or {}) and args.num_gpu is None:
            settings = place(model, replace(settings, n_gpu_layers=-1), release, devices, parallel=slots)[0]
        estimate = estimate_llamacpp(model, settings, engine="ollama", gpus=1)
        used = estimate.buffers["GPU0"].total if "GPU0" in estimate.buffers else 0
        gpu_ways = fixes(model, gpu, settings, requantize)
        room = "free, as Ollama's log says" if free is not None else "it has (its total less the CUDA context, assumed)"
        lines.append(f"llama.cpp's buffers with {estimate.layers_on_gpu} of {model.n_layer + 1} layer slots on "
                     f"{gpu.name}: {used / GiB:.2f} GiB of the {gpu_budget(gpu) / GiB:.2f} GiB {room}")
        ollamas = place(model, settings, release, devices, parallel=settings.parallel)[2]   # at llama.cpp's load
        expected = gpu_bytes_expected(ollamas)
        if ollamas.layers != estimate.layers_on_gpu:   # another count: no like-for-like shortfall to give
            gap = (f" (not the {estimate.layers_on_gpu} the log loaded: num_gpu was set, or the free memory it found "
                   "was another)")
        else:
            gap = f": {(used - expected) / GiB:.2f} GiB short of llama.cpp's buffers" if used > expected else ""
        lines.append(f"Ollama {release.name}'s own {release.sizing} at these settings: {ollamas.layers} layer slots, "
                     f"{expected / GiB:.2f} GiB on the GPU{gap}")
        report.update(ollama_expected_gpu_bytes=expected)
        if used <= gpu_budget(gpu):
            lines.append("  (they fit: what failed is outside them, e.g. another program's memory or the CUDA "
                         "context's, or settings other than the log's)")
        lines += [f"  {in_ollamas_words(fix, settings):<40} {fix.buys}" for fix in gpu_ways]
        report.update(gpu_bytes=used, gpu_budget_bytes=gpu_budget(gpu), fixes=[
            {"change": in_ollamas_words(f, settings), "gpu_bytes": f.gpu_bytes, "buys": f.buys} for f in gpu_ways])
    if not report["fixes"] and (host is None or replayed > available):
        lines.append("no single change fits it: memfit plan --engine ollama searches file types and settings together")
    if args.json:
        print_json(report)
        return 0
    for line in lines:
        console.print(line)
    return 0
