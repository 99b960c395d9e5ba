"""`memfit plan MODEL --engine llama.cpp --gpu G --host-ram R --ctx-size L`: the GGUF quantization, KV cache type and
layer split that fit one GPU and the host, best quality first, each with its speed; --export writes plan 1's
llama-server command or an Ollama Modelfile."""
from __future__ import annotations

import argparse

from memfit.cli.console import output_console, print_json
from memfit.cli.ollama import release_of
from memfit.core.errors import MemfitError
from memfit.core.units import GiB, parse_bytes
from memfit.serving.llamacpp_plan import (
    HOST_BANDWIDTH_GBPS,
    QUALITY,
    QUALITY_SOURCE,
    SPEED_SOURCE,
    LlamaCppPlan,
    plan_llamacpp,
)
from memfit.serving.ollama_plan import plan_ollama
from memfit.specs.hardware import get_gpu

SIZING = {"estimate": "its estimate", "layout": "its layout", "fit": "llama-server's --fit"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Plan llama.cpp on your machine: the GGUF quantization, KV cache type and layers on the GPU "
                          "(-ngl) that fit its VRAM and your RAM, best quality first, with the speed of each.")
    parser.add_argument("model", nargs="?", help="a Hugging Face model: catalog name, config.json, folder or hub id")
    parser.add_argument("--engine", choices=("llama.cpp", "ollama"), required=True,
                        help="llama.cpp (memfit chooses -ngl), or Ollama (it chooses num_gpu: its choice replayed)")
    parser.add_argument("--engine-version", metavar="X.Y.Z", help="Ollama's release, or a date (default: the newest; "
                        "its defaults and how it places the layers)")
    parser.add_argument("--gpu", required=True, help="the GPU (memfit gpus)")
    parser.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs of that kind (default 1; llama.cpp "
                        "splits the layers over them)")
    parser.add_argument("--host-ram", required=True, metavar="SIZE", help="the machine's RAM, e.g. 32GiB")
    parser.add_argument("-c", "--ctx-size", type=int, metavar="N", help="context (default: the model's)")
    parser.add_argument("-np", "--parallel", type=int, default=1, metavar="N", help="sequence slots (default 1)")
    parser.add_argument("--num-ctx", type=int, metavar="N", help="Ollama: context per slot (default: the release's)")
    parser.add_argument("--num-parallel", type=int, metavar="N",
                        help="Ollama: OLLAMA_NUM_PARALLEL (default: the release's choice)")
    parser.add_argument("--objective", choices=("quality", "fastest"), default="quality",
                        help="quality: the least perplexity first (default); fastest: the most tokens/s first")
    parser.add_argument("--host-bandwidth", type=float, default=HOST_BANDWIDTH_GBPS, metavar="GB/s",
                        help=f"the host RAM's bandwidth (default {HOST_BANDWIDTH_GBPS:g}: dual-channel DDR4-3200)")
    parser.add_argument("--top", type=int, default=5, help="plans shown (default 5)")
    parser.add_argument("--export", choices=("llama-server", "ollama"), help="write plan 1's command or Modelfile")
    parser.add_argument("--out", metavar="FILE", help="where --export writes (default: standard output)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.set_defaults(run=run)


def plan_json(plan: LlamaCppPlan, model: str) -> dict:
    buffers = plan.estimate.buffers
    return {"quant": plan.quant, "n_gpu_layers": plan.estimate.layers_on_gpu, "layer_slots": plan.estimate.n_layer + 1,
            "ctx_size": plan.settings.ctx_size, "cache_type_k": plan.settings.cache_type_k,
            "cache_type_v": plan.settings.cache_type_v, "flash_attn": plan.settings.flash_attn,
            "n_cpu_moe": plan.settings.n_cpu_moe,
            "gpu_bytes": plan.gpu_bytes, "host_bytes": plan.host_bytes,
            "gpu_model_bytes": sum(b.model for name, b in buffers.items() if name != "CPU"),
            "cpu_model_bytes": buffers["CPU"].model, "gpus": len(buffers) - 1,
            "decode_tokens_per_s": plan.decode_tokens_per_s, "prompt_tokens_per_s": plan.prompt_tokens_per_s,
            "ppl_increase": plan.ppl_increase, "command": plan.command(), "modelfile": plan.modelfile(model)}


def run(args: argparse.Namespace) -> int:
    if not args.model:
        raise MemfitError("name a model (memfit models lists them), a config.json or a hub id.")
    if args.model.endswith(".gguf"):
        raise MemfitError(f"{args.model}: a .gguf file has its file type already, and the planner searches file "
                          "types: name the Hugging Face model it was made from (its hub id or config.json); for this "
                          "file's buffers at a given -ngl, memfit estimate FILE.gguf --task serve --engine llama.cpp.")
    if args.parallel < 1 or args.top < 1 or args.gpus < 1 or (args.ctx_size is not None and args.ctx_size < 1):
        raise MemfitError("--ctx-size, --parallel, --gpus and --top take a whole number of 1 or more.")
    if args.host_bandwidth <= 0:
        raise MemfitError(f"--host-bandwidth {args.host_bandwidth:g}: GB/s, more than 0.")
    gpu = get_gpu(args.gpu)
    host_ram = parse_bytes(args.host_ram, "--host-ram")
    if args.engine == "ollama":
        if args.ctx_size is not None or args.parallel != 1:
            raise MemfitError("--engine ollama takes Ollama's names: --num-ctx (per slot) and --num-parallel.")
        if (args.num_ctx is not None and args.num_ctx < 1) or (args.num_parallel is not None and args.num_parallel < 1):
            raise MemfitError("--num-ctx and --num-parallel take a whole number of 1 or more.")
        release = release_of(args)
        result = plan_ollama(args.model, gpu, release, host_ram_bytes=host_ram, num_ctx=args.num_ctx,
                             parallel=args.num_parallel, objective=args.objective, gpus=args.gpus,
                             host_bandwidth_gbps=args.host_bandwidth)
        engine = f"Ollama {release.name} ({SIZING[release.sizing]} choosing the layers)"
    else:
        if args.num_ctx is not None or args.num_parallel is not None or args.engine_version is not None:
            raise MemfitError("--num-ctx, --num-parallel and --engine-version are for --engine ollama (llama.cpp: "
                              "-c and -np).")
        result = plan_llamacpp(args.model, gpu, host_ram_bytes=host_ram, ctx_size=args.ctx_size,
                               parallel=args.parallel, objective=args.objective,
                               host_bandwidth_gbps=args.host_bandwidth, gpus=args.gpus)
        engine = "llama.cpp"
    if args.export:
        if not result.plans:
            raise MemfitError(f"nothing to export: {result.reason}")
        best = result.plans[0]
        text = best.command() + "\n" if args.export == "llama-server" else best.modelfile(args.model)
        if text is None:
            raise MemfitError(f"plan 1 keeps the experts of {best.settings.n_cpu_moe} layers on the CPU (llama.cpp's "
                              "--n-cpu-moe), which a Modelfile cannot say: --export llama-server.")
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text)
        else:
            print(text, end="")
        return 0
    if args.json:
        print_json({"schema": "memfit.llamacpp-plan/1", "model": args.model, "gpu": gpu.name, "engine": engine,
                    "host_ram_bytes": host_ram, "feasible": bool(result.plans), "reason": result.reason,
                    "plans": [plan_json(p, args.model) for p in result.plans[:args.top]],
                    "rejected": result.rejected, "ppl_source": QUALITY_SOURCE,
                    "speed_source": SPEED_SOURCE})
        return 0
    console = output_console()
    if not result.plans:
        console.print(f"{args.model} on {gpu.name} with {host_ram / GiB:.0f} GiB of RAM: {result.reason}")
        return 0
    size = f"{gpu.memory_bytes / GiB:.2f} GiB"
    cards = f"one {gpu.name} ({size})" if args.gpus == 1 else \
        f"{args.gpus} x {gpu.name} ({size} each; the fullest shown)"
    console.print(f"{args.model} in {engine} on {cards} and "
                  f"{host_ram / GiB:.0f} GiB of RAM, {args.objective} first; searched {', '.join(QUALITY)}")
    for i, plan in enumerate(result.plans[:args.top], 1):
        flash = f"FA {plan.settings.flash_attn:<4} " if args.engine == "ollama" else ""
        console.print(f"{i}. {plan.quant:<7} {flash}KV {plan.settings.cache_type_k:<5} {plan.split:<24} GPU "
                      f"{plan.gpu_bytes / GiB:5.2f} GiB  host {plan.host_bytes / GiB:5.2f} GiB  "
                      f"~{plan.decode_tokens_per_s:6.1f} tok/s generating, ~{plan.prompt_tokens_per_s:7.0f} reading  "
                      f"ppl +{plan.ppl_increase:.2%}")
    best = result.plans[0]
    console.print("plan 1: " + (best.modelfile(args.model) or "").replace("\n", "; ").rstrip("; ")
                  if args.engine == "ollama" else f"plan 1: {best.command()}")
    console.print(f"perplexity: {QUALITY_SOURCE}; speed: {SPEED_SOURCE}")
    return 0
