"""`memfit estimate`: where the memory goes, without running the model."""
from __future__ import annotations

import argparse

from rich.console import Console

from memfit.cli.common import (
    add_gpu_arguments,
    add_workload_arguments,
    check_output_path,
    gpu_from,
    output_console,
    print_json,
    workload_from,
)
from memfit.core.errors import MemfitError
from memfit.estimators import METHODS, estimate
from memfit.estimators.effects import leave_one_out
from memfit.estimators.sharding import zero_paper_table
from memfit.planner.cost import timing
from memfit.report.tables import print_estimate, workload_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_gpu_arguments(parser, "target GPU (memfit gpus); without it, the device `measure` would use here")
    parser.add_argument("--method", default="auto", help=f"one of {', '.join(METHODS)} (default auto: traced "
                                                          "where it can run)")
    parser.add_argument("--modules", action="store_true", help="add the top modules by memory (traced)")
    parser.add_argument("--timeline", metavar="FILE",
                        help="memory over the step: .png/.svg/.pdf plot or .json (traced)")
    parser.add_argument("--full-trace", action="store_true", help="trace every layer instead of extrapolating")
    parser.epilog = ("--task serve (an LLM serving engine's start-up: vLLM, SGLang, TGI) takes its own flags: "
                     "memfit estimate --task serve --help")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_output_path(args.timeline, (".png", ".svg", ".pdf", ".json"), "--timeline")
    workload = workload_from(args)
    gpu = gpu_from(args)
    options = {}
    if args.method != "analytic" and workload.engine == "pytorch":
        options = {"modules": args.modules, "timeline": bool(args.timeline), "full_trace": args.full_trace}
    elif args.timeline or args.modules:
        raise MemfitError("--timeline and --modules come from a trace; use --method traced (PyTorch engine).")
    with Console(stderr=True).status(f"estimating {workload.model} ({args.method}) ..."):
        result = estimate(workload, method=args.method, gpu=gpu, **options)
    if workload.techniques or workload.precision != "fp32" or workload.optimizer != "adamw":
        result.extra["technique_savings"] = technique_savings(workload, result, gpu)
    if gpu is not None:
        result.extra.update(time_of(workload, result, gpu))
    if workload.engine == "deepspeed" or workload.world_size > 1:
        result.extra["zero_table"] = zero_paper_table(result.num_parameters, workload.world_size)
    if args.timeline:
        from memfit.report.timeline_plot import write_timeline  # matplotlib loads only for a plot

        assert result.timeline is not None   # --timeline traces the step (checked above), which records it
        write_timeline(result.timeline, args.timeline, workload_line(result))
    if args.json:
        data = result.to_json()
        data.pop("timeline", None)
        print_json(data)
    else:
        print_estimate(result, output_console())
    return 0


def time_of(workload, result, gpu) -> dict:
    """The step-time model's figures for this configuration (planner/cost.py), where it has one: memfit's own step
    of a transformer config or a custom module (its kernels counted on a fake copy); a user's own step may run
    anything, and is not timed."""
    if workload.step:
        return {}
    return timing(workload, result, gpu)


def technique_savings(workload, result, gpu) -> list[dict]:
    """Each technique's saving (leave one out): analytic where it models the workload (milliseconds per
    estimate), else traced (custom modules, or a technique the analytic model has only for decoders)."""
    methods = ("analytic", "traced") if workload.source.is_hf else ("traced",)
    for method in methods:
        try:
            full = result if result.method == method else estimate(workload, method=method, gpu=gpu)
            return leave_one_out(workload, full, gpu=gpu, method=method)
        except MemfitError:
            if method == methods[-1]:
                raise
    raise AssertionError("unreachable: the last method returns or raises")
