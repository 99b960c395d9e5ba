"""`memfit explain-oom`: read a CUDA OOM (message, log or memory snapshot) and rank the fixes."""
from __future__ import annotations

import argparse

from memfit.cli.common import (
    add_gpu_arguments,
    add_workload_arguments,
    given_workload_flags,
    gpu_from,
    output_console,
    print_json,
    workload_from,
)
from memfit.cli.console import read_text
from memfit.core.errors import MemfitError
from memfit.measurement.oom import load_snapshot, parse_oom_message, summarize_snapshot
from memfit.report.oom_fixes import analyze, print_report, to_json

SNAPSHOT_SUFFIXES = (".pickle", ".pkl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", nargs="?", default="-",
                        help="a log or traceback holding the OOM message, a memory snapshot .pickle "
                             "(torch.cuda.memory._dump_snapshot), or - for stdin (default)")
    parser.add_argument("--snapshot", metavar="FILE.pickle", help="a memory snapshot besides the message")
    add_workload_arguments(parser, model_flag=True)
    add_gpu_arguments(parser, "the GPU it ran on (memfit gpus), for the workload's estimate")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    message = snapshot = None
    snapshot_path = args.snapshot
    if args.source.endswith(SNAPSHOT_SUFFIXES):
        snapshot_path = args.source
    else:
        message = parse_oom_message(read_text(args.source))
    if snapshot_path:
        snapshot = summarize_snapshot(load_snapshot(snapshot_path))
    workload = None
    if args.model or args.plan:   # the workload that failed: fixes are then predicted by memfit's estimate of it
        workload = workload_from(args)
    elif given_workload_flags(args) or args.step or args.inputs:
        raise MemfitError("the workload flags describe the workload that failed: pass --model (or --plan) with them.")
    analysis = analyze(message, snapshot, workload, gpu_from(args))
    if args.json:
        print_json(to_json(analysis))
    else:
        print_report(analysis, output_console())
    return 0
