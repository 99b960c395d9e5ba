"""`memfit estimate MODEL --task serve --engine vllm|sglang`: what a serving engine sets aside on each GPU, whether
it starts, and how many requests fit at what context. Read from the model's config alone: no torch is imported, so
the answer comes at once (`memfit estimate --task serve --help` lists these flags; `memfit estimate --help` the
training and inference ones)."""
from __future__ import annotations

import argparse
import math
from typing import Any

from memfit.cli.console import output_console, print_json
from memfit.core.errors import MemfitError
from memfit.core.units import GiB, parse_bytes
from memfit.report.serving_report import print_serving
from memfit.report.serving_timeline import write_serving_timeline
from memfit.report.timeline_plot import check_timeline_path
from memfit.serving import estimate
from memfit.serving.checkpoints import QUANTIZATIONS
from memfit.serving.load import DATASETS, SHAREGPT_MEANS, Load
from memfit.serving.releases import ENGINES, NEWEST
from memfit.serving.settings import ENTRYPOINTS, KV_CACHE_DTYPES, ServeSettings
from memfit.specs.hardware import GPU, get_gpu

MODEL_HELP = "catalog name (memfit models), a Hugging Face config.json, folder or hub id"
# (flag, ServeSettings field, argparse options, help)
SERVE_FLAGS: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("--engine-version", "engine_version", {"metavar": "V"},
     f"the engine's release (default: the newest memfit models: vllm {NEWEST['vllm']}, sglang {NEWEST['sglang']})"),
    ("--tensor-parallel", "tensor_parallel", {"type": int, "metavar": "N"}, "tensor-parallel GPUs (default 1)"),
    ("--pipeline-parallel", "pipeline_parallel", {"type": int, "metavar": "N"}, "pipeline stages (default 1)"),
    ("--data-parallel", "data_parallel", {"type": int, "metavar": "N"}, "replicas (default 1)"),
    ("--enable-expert-parallel", "expert_parallel", {"action": "store_const", "const": True},
     "a mixture's experts split whole over the tensor x data parallel GPUs"),
    ("--max-model-len", "max_model_len", {"type": int, "metavar": "L"},
     "context per request (default: the model's; -1: the longest that fits)"),
    ("--allow-long-max-model-len", "allow_long_max_model_len", {"action": "store_const", "const": True},
     "a context beyond the model's positions (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", {"type": float, "metavar": "U"},
     "vLLM: the fraction of the GPU's total it may use (default 0.92 from 0.20, 0.9 before)"),
    ("--max-num-seqs", "max_num_seqs", {"type": int, "metavar": "S"},
     "requests per step (default: by release and GPU)"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", {"type": int, "metavar": "T"},
     "tokens per step, the profile run's size (default: by release, GPU and entry point)"),
    ("--entrypoint", "entrypoint", {"choices": ENTRYPOINTS}, "vllm serve (server, default) or the offline LLM class"),
    ("--enforce-eager", "enforce_eager", {"action": "store_const", "const": True}, "no CUDA graphs"),
    ("--kv-cache-dtype", "kv_cache_dtype", {"metavar": "|".join(KV_CACHE_DTYPES)}, "default auto (the served dtype)"),
    ("--block-size", "block_size", {"type": int}, "tokens per KV block (default 16; 64 for MLA)"),
    ("--quantization", "quantization", {"metavar": "METHOD"},
     f"{', '.join(QUANTIZATIONS)} (default: the checkpoint's quantization_config)"),
    ("--dtype", "dtype", {}, "auto (default: the checkpoint's), bfloat16, float16 or float32"),
    ("--cpu-offload-gb", "cpu_offload_gb", {"type": float, "metavar": "GB"}, "vLLM: weights kept in CPU memory"),
    ("--no-enable-prefix-caching", "enable_prefix_caching", {"action": "store_const", "const": False},
     "vLLM: no prefix cache (V1's is on: a shared prompt prefix is computed once)"),
    ("--speculative-config", "speculative_config", {"metavar": "JSON"},
     "vLLM: speculative decoding (refused: not modelled, with the reason)"),
    ("--mem-fraction-static", "mem_fraction_static", {"type": float, "metavar": "F"},
     "SGLang: the fraction of free memory for weights and the KV pool"),
    ("--chunked-prefill-size", "chunked_prefill_size", {"type": int}, "SGLang"),
    ("--cuda-graph-max-bs", "cuda_graph_max_bs", {"type": int}, "SGLang"),
    ("--cuda-memory-fraction", "cuda_memory_fraction", {"type": float, "metavar": "F"},
     "TGI: the fraction of the GPU it may use (default 1.0)"),
    ("--max-batch-prefill-tokens", "max_batch_prefill_tokens", {"type": int, "metavar": "T"},
     "TGI: the warm-up prefill's size (default: by release)"),
)


def add_arguments(parser: argparse.ArgumentParser, *, model_flag: bool = False) -> None:
    """The serving flags; the model as the positional (or --model where the command's positional is a log)."""
    if model_flag:
        parser.add_argument("--model", help=MODEL_HELP)
    else:
        parser.description = ("What an LLM serving engine sets aside on each GPU, whether it starts, how many requests "
                              "fit at what context, and, with a load, how fast it serves it (simulated).")
        parser.add_argument("model", nargs="?", help=MODEL_HELP)
    parser.add_argument("--task", choices=("serve",), required=True, help="serve: an LLM serving engine's start-up")
    parser.add_argument("--engine", required=True, help=f"one of {', '.join(ENGINES)}")
    parser.add_argument("--gpu", default="h100", help="the GPU each rank runs on (memfit gpus; default h100)")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="the total CUDA reports, e.g. 23.58GiB (default: the "
                                                             "catalog's)")
    parser.add_argument("--kv-cache-memory", metavar="SIZE", help="vLLM: KV cache bytes per GPU, no profiling")
    parser.add_argument("--other-memory", metavar="SIZE", help="memory other processes hold on the GPU at start")
    group = parser.add_argument_group("engine settings (the engine's own names)")
    for flag, field, options, text in SERVE_FLAGS:
        group.add_argument(flag, dest=field, default=None, help=text, **options)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    if not model_flag:
        client = parser.add_argument_group("a load to serve (vLLM's benchmark client's names): how fast, simulated")
        client.add_argument("--input-len", type=float, metavar="I", help="prompt tokens (sharegpt: the mean, "
                                                                          f"default {SHAREGPT_MEANS[0]})")
        client.add_argument("--output-len", type=float, metavar="O", help="answer tokens (sharegpt: the mean, "
                                                                           f"default {SHAREGPT_MEANS[1]})")
        client.add_argument("--num-prompts", type=int, default=1000, metavar="N", help="requests (default 1000)")
        client.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                            help="requests per second, Poisson arrivals (default inf: all at once)")
        client.add_argument("--max-concurrency", type=int, metavar="C", help="at most C requests outstanding")
        client.add_argument("--dataset", choices=DATASETS, help="random (fixed lengths, the default with --input-len)"
                                                                " or sharegpt (its length distribution, assumed)")
        client.add_argument("--random-prefix-len", type=int, default=0, metavar="P",
                            help="random dataset: tokens every prompt starts with (a shared system prompt)")
        client.add_argument("--seed", type=int, default=0, help="arrivals' and ShareGPT lengths' seed (default 0)")
        client.add_argument("--timeline", metavar="FILE", help="plot the run (.png/.svg/.pdf) or write its series "
                                                               "(.json)")
        parser.set_defaults(run=run)


def settings_from(args: argparse.Namespace) -> ServeSettings:
    given = {field: getattr(args, field) for _, field, _, _ in SERVE_FLAGS if getattr(args, field) is not None}
    if args.kv_cache_memory:
        given["kv_cache_memory"] = parse_bytes(args.kv_cache_memory, "--kv-cache-memory")
    if args.other_memory:
        given["other_process_bytes"] = parse_bytes(args.other_memory, "--other-memory")
    return ServeSettings(engine=args.engine, **given)


def gpu_of(args: argparse.Namespace) -> GPU:
    gpu = get_gpu(args.gpu)
    if args.gpu_memory:
        gpu = gpu.with_memory(parse_bytes(args.gpu_memory, "--gpu-memory"))
        if gpu.memory_bytes < GiB // 4:
            raise MemfitError(f"--gpu-memory {args.gpu_memory}: a GPU that small cannot hold an engine.")
    return gpu


def load_from(args: argparse.Namespace) -> Load | None:
    """The load the client flags describe, or None when no length or dataset is given."""
    given = args.input_len is not None or args.output_len is not None or args.dataset is not None
    if not given:
        if args.timeline or args.max_concurrency is not None or args.random_prefix_len:
            raise MemfitError("--timeline and --max-concurrency describe a load: give --input-len and --output-len "
                              "(or --dataset sharegpt).")
        return None
    dataset = args.dataset or "random"
    prompt, answer = args.input_len, args.output_len
    if dataset == "sharegpt":
        prompt, answer = prompt or SHAREGPT_MEANS[0], answer or SHAREGPT_MEANS[1]
    elif prompt is None or answer is None:
        raise MemfitError("a random load takes both --input-len and --output-len (tokens per prompt and answer).")
    return Load(prompt, answer, args.num_prompts, args.request_rate, args.max_concurrency, dataset, args.seed,
                args.random_prefix_len)


def run(args: argparse.Namespace) -> int:
    if not args.model:
        raise MemfitError("name a model (memfit models lists them), a config.json or a hub id.")
    load = load_from(args)
    if args.timeline:
        check_timeline_path(args.timeline)   # before the run, not after it
    result = estimate(args.model, gpu_of(args), settings_from(args), load)
    if args.timeline and result.speed is not None:
        write_serving_timeline(result.speed.timeline, result.speed.kv_blocks, args.timeline,
                               f"{result.model} on {result.engine} {result.engine_version}, {result.gpu}")
    if args.json:
        print_json(result.to_json())
    else:
        print_serving(result, output_console())
        if args.timeline:
            output_console().print(f"timeline written to {args.timeline}")
    return 0
