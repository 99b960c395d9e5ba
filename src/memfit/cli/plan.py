"""`memfit plan`: the fastest combination of techniques and batch shape that fits the GPUs."""
from __future__ import annotations

import argparse
import json
import sys
from typing import cast

from rich.console import Console

from memfit.cli.common import (
    add_gpu_arguments,
    add_workload_arguments,
    check_output_path,
    command_line,
    flag_of,
    given_workload_flags,
    gpu_from,
    output_console,
    print_json,
)
from memfit.core.errors import MemfitError
from memfit.core.units import parse_bytes
from memfit.planner import PlanRequest, plan
from memfit.planner.export import EXPORTS, export
from memfit.planner.instances import plan_on_instances
from memfit.planner.request import ALLOW, DEFAULT_MARGIN, DEFAULT_SPEED_MARGIN, OBJECTIVES, parse_fraction
from memfit.report.plan_report import print_instance_ranking, print_plans, write_pareto_plot
from memfit.specs.hardware import GPU
from memfit.specs.instances import Instance, get_instance, instance_catalog, parse_price, priced


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_gpu_arguments(parser, "target GPU (memfit gpus); --instance implies it")
    parser.add_argument("--instance", help="a machine from `memfit instances` (its GPUs, host RAM and price), or "
                                           "any: every priced machine, cheapest per million tokens first")
    parser.add_argument("--price", action="append", default=[], metavar="NAME=USD",
                        help="an instance's hourly price instead of its list price (repeatable)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="train: sequences per optimizer step over all GPUs (default: one per GPU); the "
                             "planner splits it into micro-batches and gradient accumulation")
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME",
                        help="a technique, precision or optimizer no plan may use (repeatable)")
    parser.add_argument("--method", help="the estimator of every candidate: analytic or traced (default: analytic "
                                         "where it models the model, else traced)")
    parser.add_argument("--host-ram", help="host RAM per node for offload, e.g. 512GiB or 1TiB (default: not "
                                           "checked; 0 rules offload out)")
    parser.add_argument("--allow", default="lossless", help=f"{' or '.join(ALLOW)} (default lossless: techniques "
                                                            "that change results beyond numerics are left out)")
    parser.add_argument("--max-ppl-increase", help="with --allow lossy: the accuracy budget, e.g. 2%% (measured "
                                                   "perplexity costs; techniques without one are left out)")
    parser.add_argument("--objective", default="fastest", help=f"{' | '.join(OBJECTIVES)} (default fastest: "
                                                               "tokens per second per GPU)")
    parser.add_argument("--margin", default=f"{DEFAULT_MARGIN:.0%}", help="device memory kept free beyond the "
                                                                          "modelled overheads (default %(default)s)")
    parser.add_argument("--speed-margin", default=f"{DEFAULT_SPEED_MARGIN:.0%}",
                        help="--objective fastest: plans this close to the fastest count as fast, and the one that "
                             "changes training least comes first (default %(default)s; 0 for the fastest alone)")
    parser.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    parser.add_argument("--save", metavar="PLAN.json", help="write the plans (for estimate/measure --plan)")
    parser.add_argument("--export", choices=EXPORTS, help="plan 1 for the tool that runs it: TrainingArguments "
                        "keyword arguments (hf-trainer), a DeepSpeed config (deepspeed), an accelerate config file "
                        "(accelerate), Lightning Trainer arguments (lightning) or the torchrun launch line")
    parser.add_argument("--out", metavar="FILE", help="with --export: write it to FILE instead of printing it")
    parser.add_argument("--plot", metavar="FILE.png", help="the memory/time Pareto frontier (.png/.svg/.pdf)")
    parser.add_argument("--verify", choices=("traced",), help="re-check the chosen plans with the traced estimator")
    parser.set_defaults(run=run)


# Workload flags `plan` does not search over: each refused with the reason (the planner chooses them, or has no
# axis for them yet)
NOT_PLANNED = {
    "optimizer_impl": "the planner runs PyTorch's default implementation on the GPU",
    "zero_stage": "the planner chooses the ZeRO stage (require a sharding technique with -t, or keep one out with "
                  "--exclude)",
    "engine": "the planner chooses the engine (DeepSpeed where a plan needs it)",
    "reduce_bucket": "the planner keeps DeepSpeed's default bucket",
    "allow_long_seq": "plan within the model's maximum sequence length",
}


def request_from(args: argparse.Namespace, instance: Instance | None = None) -> PlanRequest:
    if instance is None and not args.gpu:
        raise MemfitError("memfit plan needs --gpu (memfit gpus) or --instance (memfit instances).")
    if args.plan:
        raise MemfitError("--plan reads a saved plan for estimate and measure; `memfit plan` takes the model and "
                          "flags.")
    if not args.model:
        raise MemfitError("name a model to plan (memfit models lists them).")
    given = given_workload_flags(args)
    for field, reason in NOT_PLANNED.items():
        if field in given:
            raise MemfitError(f"{flag_of(field)}: {reason}; drop it.")
    task = given.get("task", "train")
    if "batch_size" in given and task == "train":
        raise MemfitError("--batch-size is the served batch of --task inference; for training give --global-batch "
                          "(sequences per optimizer step) and the planner chooses the micro-batch.")
    gpu = cast(GPU, gpu_from(args, instance.gpu if instance else None))   # no --gpu: an instance (checked above)
    gpus = given.get("world_size")
    return PlanRequest(
        model=args.model, inputs=args.inputs, step=args.step, gpu=gpu, task=task, seq_len=given.get("seq_len"),
        global_batch=args.global_batch, batch_size=given.get("batch_size", 1), new_tokens=given.get("new_tokens", 0),
        num_gpus=gpus if gpus is not None else instance.gpus if instance else 1,
        host_ram_bytes=parse_bytes(args.host_ram, "--host-ram") if args.host_ram is not None
        else instance.host_ram_bytes if instance else None,
        allow=args.allow, max_ppl_increase=parse_fraction(args.max_ppl_increase, "--max-ppl-increase")
        if args.max_ppl_increase is not None else None,
        objective=args.objective, margin=parse_fraction(args.margin, "--margin"),
        speed_margin=parse_fraction(args.speed_margin, "--speed-margin"), top=args.top, instance=instance,
        techniques=given.get("techniques", ()), precision=given.get("precision"), optimizer=given.get("optimizer"),
        exclude=tuple(args.exclude), method=args.method)


def on_any_instance(args: argparse.Namespace) -> bool:
    return args.instance is not None and args.instance.strip().lower() == "any"


def instances_of(args: argparse.Namespace) -> list[Instance]:
    """The machines --instance names (all for `any`), priced as --price says."""
    overrides = dict(parse_price(text) for text in args.price)
    if args.instance is None:
        if overrides:
            raise MemfitError("--price sets an instance's price; add --instance NAME or --instance any.")
        return []
    if on_any_instance(args):
        if args.gpu or args.world_size:
            raise MemfitError("--instance any plans one machine of each type in `memfit instances`, with its own "
                              "GPUs; drop --gpu/--gpus (or plan one machine type with --instance NAME --gpus N).")
        return priced(list(instance_catalog().values()), overrides)
    return priced([get_instance(args.instance)], overrides)


def run(args: argparse.Namespace) -> int:
    check_output_path(args.plot, (".png", ".svg", ".pdf"), "--plot")
    check_output_path(args.save, (".json",), "--save")
    instances = instances_of(args)
    if on_any_instance(args):
        return run_on_instances(args, instances)
    request = request_from(args, instances[0] if instances else None)
    status = Console(stderr=True).status(f"planning {request.model} ...")
    with status:
        result = plan(request, progress=status.update, explore_all=bool(args.plot),
                      verify_traced=args.verify == "traced")
    data = result.to_json()
    if args.export:
        if not result.feasible:
            raise MemfitError(f"--export: no plan fits ({result.reason}); nothing to export.")
        text = export(result.plans[0], request, args.export)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text + "\n")
            print(f"wrote plan 1 as {args.export} to {args.out}", file=sys.stderr)
        else:
            print(text)
        return 0
    if args.save:
        save_json(args.save, data)
    if args.plot and result.feasible:
        write_pareto_plot(result, args.plot)
    if args.json:
        print_json(data)
        return 0
    console = output_console()
    print_plans(result, console)
    if result.feasible:
        how = (f"memfit estimate --plan {args.save}   |   memfit measure --plan {args.save}" if args.save else
               f"memfit estimate {command_line(result.plans[0].workload(request))} --gpu {request.gpu.name}")
        console.print(f"run plan 1: {how}", soft_wrap=True)   # one line: pasted whole
    if args.plot and not result.feasible:
        console.print("[dim]--plot: nothing fits, so no frontier was drawn[/dim]")
    elif args.plot:
        console.print(f"Pareto frontier: {args.plot}")
    return 0


def run_on_instances(args: argparse.Namespace, instances: list[Instance]) -> int:
    for flag in ("export", "plot", "verify", "gpu_memory"):
        if getattr(args, flag):
            raise MemfitError(f"--{flag.replace('_', '-')} takes one machine: plan it with --instance NAME.")
    with Console(stderr=True).status(f"planning {args.model} on {len(instances)} instances ...") as status:
        ranking = plan_on_instances(lambda instance: request_from(args, instance), instances, progress=status.update)
    data = ranking.to_json()
    if args.save:
        save_json(args.save, data)
    if args.json:
        print_json(data)
        return 0
    print_instance_ranking(ranking, output_console())
    return 0


def save_json(path: str, data: dict) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2)
