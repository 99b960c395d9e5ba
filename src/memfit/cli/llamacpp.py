"""`memfit estimate MODEL.gguf --task serve --engine llama.cpp`: each buffer llama.cpp allocates when it loads a GGUF
model with these settings (llama.cpp's flag names), read from the file's header alone."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from memfit.cli.console import output_console, print_json
from memfit.cli.ollama import (
    add_ollama_settings,
    ollama_json,
    ollama_lines,
    ollama_load,
    ollama_settings,
    release_of,
)
from memfit.core.errors import MemfitError
from memfit.core.units import MiB, format_bytes, parse_bytes
from memfit.serving.gguf_recipe import FILE_TYPES
from memfit.serving.llamacpp import (
    CACHE_TYPES,
    FLASH_ATTN,
    LlamaCppEstimate,
    LlamaCppSettings,
    estimate_llamacpp,
    gguf_model,
)
from memfit.serving.llamacpp_fit import FIT_CTX, FIT_TARGET, FitResult, backend_name, fit_llamacpp, parse_overrides
from memfit.serving.llamacpp_oom import gpu_budget
from memfit.specs.hardware import get_gpu


def _split(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: numbers separated by commas, e.g. 3,1") from None


def _overrides(text: str) -> tuple[tuple[str, str], ...]:
    try:
        return parse_overrides(text)
    except MemfitError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r}: on or off")
    return text == "on"


# (flags, LlamaCppSettings field, argparse options, help): llama-server's own names and short forms
FLAGS = (
    (("-c", "--ctx-size"), "ctx_size", {"type": int, "metavar": "N"},
     "context size (default: the model's training context, llama.cpp's 0)"),
    (("-ngl", "--n-gpu-layers"), "n_gpu_layers", {"type": int, "metavar": "N"},
     "layers on the GPU (default -1: all; with --gpus 0, none)"),
    (("-b", "--batch-size"), "n_batch", {"type": int, "metavar": "N"}, "logical batch (default 2048)"),
    (("-ub", "--ubatch-size"), "n_ubatch", {"type": int, "metavar": "N"}, "physical batch (default 512)"),
    (("-ctk", "--cache-type-k"), "cache_type_k", {"choices": CACHE_TYPES, "metavar": "TYPE"}, "default f16"),
    (("-ctv", "--cache-type-v"), "cache_type_v", {"choices": CACHE_TYPES, "metavar": "TYPE"},
     "default f16 (a quantized V needs flash attention)"),
    (("-fa", "--flash-attn"), "flash_attn", {"choices": FLASH_ATTN}, "default auto (on)"),
    (("-np", "--parallel"), "parallel", {"type": int, "metavar": "N"}, "sequence slots (default 1)"),
    (("-kvu", "--kv-unified"), "kv_unified", {"action": "store_const", "const": True},
     "one KV cache shared by the slots"),
    (("-nkvo", "--no-kv-offload"), "no_kv_offload", {"action": "store_const", "const": True},
     "keep the KV cache in host memory"),
    (("--no-op-offload",), "no_op_offload", {"action": "store_const", "const": True},
     "a GPU does not copy the CPU's weights to run a prompt's products"),
    (("-ncmoe", "--n-cpu-moe"), "n_cpu_moe", {"type": int, "metavar": "N"},
     "a mixture of experts: keep the experts of the first N layers on the CPU"),
    (("-cmoe", "--cpu-moe"), "n_cpu_moe", {"action": "store_const", "const": -1},
     "keep every layer's experts on the CPU"),
    (("--swa-full",), "swa_full", {"action": "store_const", "const": True},
     "a windowed model's window cache as large as the context"),
    (("-ts", "--tensor-split"), "tensor_split", {"type": _split, "metavar": "N0,N1,..."},
     "each GPU's share of the layers, e.g. 3,1 (default: equal)"),
    (("-ot", "--override-tensor"), "override_tensor",
     {"type": _overrides, "action": "append", "metavar": "PATTERN=BUFFER,..."},
     "the weights whose names contain PATTERN (a regular expression) on BUFFER: CPU, CUDA0, ... (e.g. exps=CPU)"),
)



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Each buffer llama.cpp allocates when it loads a GGUF model: the weights on each device, the "
                          "KV cache, the compute and output buffers (read from the file's header; no weight is read).")
    parser.add_argument("model", nargs="?", help="a .gguf file, or a Hugging Face model (catalog name, config.json, "
                                                 "folder or hub id) with --quant")
    parser.add_argument("--quant", type=str.upper, metavar="TYPE",
                        help=f"the GGUF llama.cpp's quantizer would write: {', '.join(FILE_TYPES)}")
    parser.add_argument("--task", choices=("serve",), required=True, help="serve: load the model to serve it")
    parser.add_argument("--engine", choices=("llama.cpp", "ollama"), required=True,
                        help="llama.cpp, or Ollama's llama runner (its names below)")
    parser.add_argument("--engine-version", metavar="YYYY-MM", help="the llama.cpp build's date, where its rules "
                        "changed (default: the newest modelled); for Ollama its release (e.g. 0.5.4) or a date: its "
                        "defaults, how it sizes the load (its own estimate up to 0.12), the llama.cpp it ran")
    parser.add_argument("--gpus", type=int, metavar="N",
                        help="GPUs the layers go to (default: 0, the CPU alone; with --gpu, 1; with --gpu-free, one "
                             "per figure)")
    parser.add_argument("--gpu", help="the GPU (memfit gpus): its memory less the CUDA context is what llama.cpp "
                                      "finds free, for --fit and whether it fits")
    parser.add_argument("--gpu-free", type=_split, metavar="MiB,...", help="each GPU's free memory as llama.cpp's "
                        "log prints it (\"using device CUDA0 ... - N MiB free\"), instead of --gpu")
    parser.add_argument("--host-ram", metavar="SIZE", help="the machine's RAM, e.g. 32GiB (the CPU alone: --fit "
                        "weighs it; else: whether the host's buffers fit)")
    fit = parser.add_argument_group("llama.cpp's --fit (on by default: it shrinks an unset context, then moves "
                                    "layers off the GPUs, until each keeps --fit-target free)")
    fit.add_argument("-fit", "--fit", type=_on_off, default=True, metavar="on|off", help="default on")
    fit.add_argument("-fitt", "--fit-target", type=_split, metavar="MiB,...",
                     help=f"kept free on each GPU (default {FIT_TARGET // MiB})")
    fit.add_argument("-fitc", "--fit-ctx", type=int, metavar="N", default=FIT_CTX,
                     help=f"the least context --fit sets (default {FIT_CTX})")
    add_settings(parser.add_argument_group("llama.cpp settings (its own names)"))
    add_ollama_settings(parser.add_argument_group("Ollama's settings (--engine ollama; before 0.30 its llama runner: "
                                                  "one cache of num_ctx x num_parallel cells)"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.set_defaults(run=run)


def add_settings(group) -> None:
    """llama.cpp's settings (FLAGS), under its own names, to a parser or argument group."""
    for flags, field, options, text in FLAGS:
        group.add_argument(*flags, dest=field, default=None, help=text, **options)


def settings_from(args: argparse.Namespace, total_vram: int = 0) -> LlamaCppSettings:
    """The settings given (for Ollama, its runner's at its release; total_vram: the GPUs' memory, which sets the
    newest releases' default num_ctx)."""
    given = {field: getattr(args, field) for _, field, _, _ in FLAGS if getattr(args, field) is not None}
    if given.get("ctx_size") == 0:   # llama.cpp's -c 0: the training context
        del given["ctx_size"]
    if "override_tensor" in given:
        given["override_tensor"] = tuple(pair for pairs in given["override_tensor"] for pair in pairs)
    ollama = {name: getattr(args, name, None) for name in ("num_ctx", "num_parallel", "num_gpu", "flash_attention",
                                                           "kv_cache_type")}
    if getattr(args, "engine", "llama.cpp") != "ollama":
        if any(value is not None for value in ollama.values()):
            raise MemfitError("--num-ctx, --num-parallel, --num-gpu, --flash-attention and --kv-cache-type are "
                              "Ollama's: give --engine ollama (or llama.cpp's -c, -np, -ngl, -fa, -ctk/-ctv).")
        return LlamaCppSettings(engine_version=args.engine_version, **given)
    if given:
        names = sorted(flags[-1] for flags, field, _, _ in FLAGS if field in given)
        raise MemfitError(f"--engine ollama takes Ollama's names (--num-ctx, --num-parallel, --num-gpu), not "
                          f"llama.cpp's ({', '.join(names)}).")
    return ollama_settings(args, total_vram)


@dataclass
class Machine:
    """What the command line says of the machine: each GPU's free memory (None: not said), the CUDA context the
    catalog assumes beside it, the host's RAM."""
    free: list[int] | None = None
    context: int = 0
    host_ram: int | None = None
    vendor: str | None = None   # the catalog GPU's (None: --gpu-free's, taken as NVIDIA's)

    @property
    def total_vram(self) -> int:
        return sum(self.free or []) + self.context * len(self.free or [])

    def fits(self, result: LlamaCppEstimate) -> bool | None:
        """Each GPU's buffers within what it has free, and the host's within its RAM (None: neither said)."""
        gpus = [b for name, b in result.buffers.items() if name != "CPU"]
        checks = [b.total <= free for b, free in zip(gpus, self.free or [])]
        if self.host_ram is not None:
            checks.append(result.buffers["CPU"].total <= self.host_ram)
        return all(checks) if checks else None


def to_json(result: LlamaCppEstimate, machine: Machine | None = None, fit: FitResult | None = None,
            given: LlamaCppSettings | None = None) -> dict:
    machine = machine or Machine()
    cpu, gpus = result.buffers["CPU"], [b for name, b in result.buffers.items() if name != "CPU"]
    source = "llama.cpp's allocation rules (checked to the byte on CPU loads here)"
    return {
        "schema": "memfit.llamacpp/1", "model": result.model, "engine": result.engine, "n_ctx": result.n_ctx,
        "kv_cells": result.kv.cells, "kv_swa_cells": result.kv.swa_cells, "kv_streams": result.kv.streams,
        "layers_on_gpu": result.layers_on_gpu,
        "cpu_model_bytes": cpu.model, "gpu_model_bytes": sum(b.model for b in gpus),
        "cpu_kv_bytes": cpu.kv, "gpu_kv_bytes": sum(b.kv for b in gpus),
        "cpu_compute_bytes": cpu.compute, "gpu_compute_bytes": sum(b.compute for b in gpus),
        "output_bytes": cpu.output, "cpu_repack_bytes": cpu.repack, "host_bytes": cpu.total,
        "gpu_buffers_bytes": sum(b.total for b in gpus),
        "gpu_total_bytes": max(b.total for b in gpus) + machine.context if gpus and machine.context else None,
        "gpu_free_bytes": machine.free, "fits": machine.fits(result),
        "fit": None if fit is None else {"status": fit.status, "arguments": fit.arguments(), "steps": fit.steps,
                                         "reason": fit.reason},
        "gpus": [{"device": b.device, "model_bytes": b.model, "kv_bytes": b.kv, "compute_bytes": b.compute,
                  "buffers_bytes": b.total} for b in gpus],
        "weights_bytes": result.weights_bytes,
        "sources": {"weights": "the GGUF header's tensor types and shapes" if result.source.endswith(".gguf") else
                    "llama.cpp's converter and quantizer rules (checked per tensor on files it wrote here)",
                    "kv": source, "compute": source,
                    "gpu": "the same rules on a GPU: not yet checked against a GPU's log",
                    "fit": "llama.cpp's common/fit.cpp replayed on these estimates (checked on published fit logs)",
                    "gpu_total": "the buffers and the catalog's CUDA context (assumed)"},
        "command": command_line(result, given), "notes": result.notes,
    }


def command_line(result: LlamaCppEstimate, settings: LlamaCppSettings | None = None) -> str:
    """llama-server's command line for `settings` (the estimate's; with --fit, the ones given: llama.cpp fits the
    rest itself), or for Ollama the Modelfile's parameters."""
    s, default = settings or result.settings, LlamaCppSettings()
    if result.engine == "ollama":
        layers = "" if s.n_gpu_layers < 0 else f"\nPARAMETER num_gpu {s.n_gpu_layers}"
        return (f"FROM ./{result.model if result.source.endswith('.gguf') else 'MODEL.gguf'}\nPARAMETER num_ctx "
                f"{(s.ctx_size or 0) // s.parallel}{layers}\n(OLLAMA_NUM_PARALLEL={s.parallel})")
    words = ["llama-server", "-m", result.model if result.source.endswith(".gguf") else "MODEL.gguf"]
    if s.ctx_size:   # unset: llama.cpp's default (-c 0 would also stop --fit from shrinking it)
        words += ["-c", str(s.ctx_size)]
    switched = {(field, options["const"]) for _, field, options, _ in FLAGS if "const" in options}
    for flags, field, options, _ in FLAGS[1:]:
        value = getattr(s, field)
        if value == getattr(default, field) or ("const" in options) != ((field, value) in switched):
            continue   # unchanged, or said by the other flag of the setting (--cpu-moe is --n-cpu-moe -1)
        if field == "override_tensor":
            text = '"' + ",".join(f"{pattern}={backend_name(device)}" for pattern, device in value) + '"'
        elif isinstance(value, tuple):
            text = ",".join(f"{share:g}" for share in value)
        else:
            text = str(value)
        words += [flags[-1]] if "const" in options else [flags[-1], text]
    return " ".join(words)


def machine_from(args: argparse.Namespace) -> tuple[Machine, int]:
    """The machine the command line describes, and how many GPUs."""
    if args.gpu and args.gpu_free:
        raise MemfitError("--gpu or --gpu-free: the catalog's GPU, or the free memory llama.cpp's log prints.")
    machine = Machine(host_ram=parse_bytes(args.host_ram, "--host-ram") if args.host_ram else None)
    gpus = args.gpus if args.gpus is not None else (len(args.gpu_free) if args.gpu_free else int(bool(args.gpu)))
    if gpus < 0:
        raise MemfitError(f"--gpus {gpus}: 0 (the CPU alone) or more.")
    if args.gpu:
        gpu = get_gpu(args.gpu)
        machine.free, machine.context, machine.vendor = [gpu_budget(gpu)] * gpus, gpu.context_bytes, gpu.vendor
    elif args.gpu_free:
        if len(args.gpu_free) not in (1, gpus) or min(args.gpu_free) <= 0:
            raise MemfitError(f"--gpu-free: one figure in MiB, more than 0, or one per GPU ({gpus}).")
        machine.free = [int(mib * MiB) for mib in args.gpu_free] * (gpus if len(args.gpu_free) == 1 else 1)
    if (args.gpu or args.gpu_free) and not gpus:
        raise MemfitError("--gpus 0 is the CPU alone: drop --gpu/--gpu-free, or give --gpus 1 or more.")
    return machine, gpus


def fitted(model, settings: LlamaCppSettings, args: argparse.Namespace, machine: Machine, gpus: int
           ) -> tuple[LlamaCppSettings, FitResult | None, str]:
    """The settings llama.cpp loads with after its --fit, the fit, and a note where it could not be replayed."""
    if not args.fit:
        return settings, None, ""
    if args.engine == "ollama" and release_of(args).sizing != "fit":
        return settings, None, ""   # Ollama's estimate or layout (ollama_load)
    if not gpus and settings.ctx_size is not None:
        return settings, None, ""   # the CPU alone: --fit changes only an unset context
    if (gpus and machine.free is None) or (not gpus and machine.host_ram is None):
        what = "--gpu NAME or --gpu-free MiB" if gpus else "--host-ram"
        return settings, None, (f"llama.cpp's --fit (on by default) shrinks an unset context and moves layers to "
                                f"fit the free memory: give {what} to see its choice (shown: the settings as given)")
    margins = [int(mib * MiB) for mib in args.fit_target] if args.fit_target else None
    if args.fit_ctx < 1:
        raise MemfitError(f"--fit-ctx {args.fit_ctx}: the least context, 1 or more.")
    fit = fit_llamacpp(model, settings, free=machine.free or [], host_total=machine.host_ram, margins=margins,
                       n_ctx_min=None if args.ctx_size == 0 else args.fit_ctx)
    return fit.settings, fit, ""


def run(args: argparse.Namespace) -> int:
    if not args.model:
        raise MemfitError("name a .gguf file, or a Hugging Face model with --quant Q4_K_M (or another type).")
    machine, gpus = machine_from(args)
    model = gguf_model(args.model, args.quant)
    given = settings_from(args, machine.total_vram)
    settings, gpus, ollama, ollama_note = ollama_load(model, given, args, machine.free, machine.vendor, gpus)
    if ollama is not None:   # the slots its scheduler chose
        given = replace(given, ctx_size=settings.ctx_size, parallel=settings.parallel)
    settings, fit, fit_note = fitted(model, settings, args, machine, gpus)
    result = estimate_llamacpp(model, settings, engine=args.engine, gpus=gpus)
    result.notes += [note for note in (ollama_note, fit_note) if note]
    if args.json:
        print_json({**to_json(result, machine, fit, given), "ollama": ollama_json(ollama, args)})
        return 0
    console = output_console()
    for line in ollama_lines(ollama) if ollama is not None else []:
        console.print(line)
    if fit is not None:
        console.print(f"llama.cpp's --fit: {'; '.join(fit.steps)}")
        if fit.status == "fitted":
            overrides = len(fit.settings.override_tensor)
            shown = fit.arguments() if overrides <= 3 else (fit.arguments().split(" -ot ")[0]
                                                            + f" -ot ({overrides} tensor overrides: --json lists them)")
            console.print(f"  it loads with: {shown}")
    slots = result.layers_on_gpu
    window = f", the window layers' {result.kv.swa_cells}" if result.kv.swa_cells else ""
    console.print(f"{result.model} on {result.engine}: n_ctx {result.n_ctx} ({result.kv.cells} cells{window} x "
                  f"{result.kv.streams} stream(s)); {slots} of the {result.n_layer + 1} layer slots (the layers, then "
                  "the output head) on the GPU")
    for name, buffers in result.buffers.items():
        repack = f"  repack {format_bytes(buffers.repack):>11}" if buffers.repack else ""
        console.print(f"  {name:<5} model {format_bytes(buffers.model):>11}  KV {format_bytes(buffers.kv):>11}  "
                      f"compute {format_bytes(buffers.compute):>11}  output {format_bytes(buffers.output):>10}"
                      f"{repack}  total {format_bytes(buffers.total):>11}")
    if machine.free:
        free = ", ".join(format_bytes(f) for f in machine.free)
        verdict = {True: "fits", False: "does NOT fit", None: ""}[machine.fits(result)]
        console.print(f"  {verdict}: free on the GPU(s) {free}"
                      + (f"; host RAM {format_bytes(machine.host_ram)}" if machine.host_ram else ""))
    if result.buffers["CPU"].repack:
        console.print("note: repack: of the CPU's model bytes, the Q4_0/Q4_K/IQ4_NL/MXFP4 weights it multiplies, "
                      "copied into its own layout (llama.cpp's CPU_REPACK buffer on an x86 CPU with AVX2); "
                      "their mapped pages stay as page cache, which the resident size shows until the system needs "
                      "the memory: the total counts them once")
    for note in result.notes:
        console.print(f"note: {note}")
    console.print(command_line(result, given))
    return 0
