"""`memfit plan MODEL --task serve --engine vllm|sglang --max-model-len L --concurrency C`: the engine setups that
serve C users at L tokens on the GPUs given (or on every priced machine with --instance any), cheapest per million
output tokens first, with their speed simulated; the launch command (or a Kubernetes Deployment) with --export.
Read from the model's config alone: no torch is imported."""
from __future__ import annotations

import argparse
import time

from memfit.cli.console import output_console, print_json
from memfit.core.errors import MemfitError
from memfit.report.serving_plan_report import deployment_yaml, print_serve_plans
from memfit.serving import load_model
from memfit.serving.command import command_line
from memfit.serving.planner import OBJECTIVES, Machine, ServeRequest, plan_serving
from memfit.serving.releases import ENGINES
from memfit.specs.hardware import get_gpu
from memfit.specs.instances import get_instance, instance_catalog, parse_price, priced

EXPORTS = ("vllm", "sglang", "kubernetes")
DEFAULT_GPUS = (1, 2, 4, 8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Plan an LLM serving engine: the GPUs, parallelism and checkpoint that serve --concurrency "
                          "users at --max-model-len tokens, cheapest first, with their speed simulated.")
    parser.add_argument("model", nargs="?", help="catalog name (memfit models), a Hugging Face config.json, folder "
                                                 "or hub id")
    parser.add_argument("--task", choices=("serve",), required=True, help="serve: plan an LLM serving engine")
    parser.add_argument("--engine", required=True, help=f"one of {', '.join(e for e in ENGINES if e != 'tgi')}")
    parser.add_argument("--engine-version", metavar="V", help="the engine's release (default: the newest modelled)")
    parser.add_argument("--max-model-len", type=int, required=True, metavar="L", help="context per request")
    parser.add_argument("--concurrency", type=int, required=True, metavar="C", help="users served at once")
    parser.add_argument("--input-len", type=int, metavar="I", help="prompt tokens (default: L less the answer)")
    parser.add_argument("--output-len", type=int, metavar="O", help="answer tokens (default 256)")
    parser.add_argument("--max-ttft-ms", type=float, help="service level: mean time to first token")
    parser.add_argument("--max-tpot-ms", type=float, help="service level: mean time per output token")
    parser.add_argument("--min-output-tokens-per-s", type=float, help="service level: output throughput, all GPUs")
    parser.add_argument("--gpu", help="the GPU (memfit gpus; default h100 without --instance)")
    parser.add_argument("--gpus", type=int, metavar="N", help=f"GPUs to use (default: the fewest of "
                                                              f"{', '.join(map(str, DEFAULT_GPUS))} that serve it)")
    parser.add_argument("--instance", help="a machine from `memfit instances`, or any: every priced machine")
    parser.add_argument("--price", action="append", default=[], metavar="NAME=USD",
                        help="an instance's hourly price instead of its list price (repeatable)")
    parser.add_argument("--allow", default="lossless", choices=("lossless", "lossy"),
                        help="lossy: fp8 or AWQ int4 checkpoints and an fp8 KV cache, with their accuracy costs")
    parser.add_argument("--objective", default="cheapest", choices=OBJECTIVES,
                        help="cheapest per million output tokens (unpriced: fewest GPUs; default) or fastest")
    parser.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    parser.add_argument("--export", choices=EXPORTS, help="plan 1's launch command, or a Kubernetes Deployment")
    parser.add_argument("--out", metavar="FILE", help="with --export: write it to FILE instead of printing it")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.set_defaults(run=run)


def machines_from(args: argparse.Namespace) -> tuple[Machine, ...]:
    prices = dict(parse_price(p) for p in args.price)
    if args.instance:
        if args.gpu or args.gpus:
            raise MemfitError("--instance names the GPUs: drop --gpu and --gpus (or drop --instance).")
        chosen = list(instance_catalog().values()) if args.instance.strip().lower() == "any" \
            else [get_instance(args.instance)]
        chosen = priced(chosen, prices)
        if args.instance.strip().lower() == "any":
            chosen = [i for i in chosen if i.usd_per_hour is not None]
        return tuple(Machine(i.gpu, i.gpus, i) for i in chosen)
    if prices:
        raise MemfitError("--price prices an instance: plan with --instance NAME or --instance any.")
    gpu = get_gpu(args.gpu or "h100")
    if args.gpus is not None:
        if args.gpus < 1:
            raise MemfitError(f"--gpus must be a positive integer, got {args.gpus}.")
        return (Machine(gpu, args.gpus),)
    return tuple(Machine(gpu, n) for n in DEFAULT_GPUS)


def run(args: argparse.Namespace) -> int:
    if not args.model:
        raise MemfitError("name a model (memfit models lists them), a config.json or a hub id.")
    if args.engine == "tgi":
        raise MemfitError("plan --task serve plans vllm and sglang (TGI's scheduler is not simulated); estimate a "
                          "TGI start-up with memfit estimate --task serve --engine tgi.")
    if args.export and args.json:
        raise MemfitError("--export writes plan 1's launch (a command or a manifest), --json the plans: give one.")
    if args.out and not args.export:
        raise MemfitError("--out writes an --export; name one: " + ", ".join(EXPORTS) + ".")
    if args.export in ("vllm", "sglang") and args.export != args.engine:
        raise MemfitError(f"--export {args.export} needs a plan for that engine: plan with --engine {args.export}.")
    model = load_model(args.model)
    request = ServeRequest(engine=args.engine, engine_version=args.engine_version, max_model_len=args.max_model_len,
                           concurrency=args.concurrency, machines=machines_from(args), input_len=args.input_len,
                           output_len=args.output_len, allow_lossy=args.allow == "lossy", objective=args.objective,
                           max_ttft_ms=args.max_ttft_ms, max_tpot_ms=args.max_tpot_ms,
                           min_output_tokens_per_s=args.min_output_tokens_per_s, top=args.top)
    started = time.perf_counter()
    result = plan_serving(model, request)
    elapsed = time.perf_counter() - started
    if args.export:
        if not result.feasible:
            raise MemfitError(f"nothing to export: {result.reason}")
        best = result.plans[0]
        text = deployment_yaml(best, model) if args.export == "kubernetes" else command_line(best.estimate) + "\n"
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text)
            output_console().print(f"wrote plan 1's {args.export} launch to {args.out}")
        else:
            print(text, end="")
        return 0
    if args.json:
        print_json({**result.to_json(), "elapsed_s": round(elapsed, 2)})
    else:
        print_serve_plans(result, output_console(), elapsed)
    return 0

