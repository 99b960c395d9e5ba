"""`memfit measure`: run the workload for real here and compare with the estimates."""
from __future__ import annotations

import argparse

from rich.console import Console

from memfit.cli.common import add_workload_arguments, check_output_path, output_console, print_json, workload_from
from memfit.estimators import methods_for
from memfit.measurement import measure
from memfit.report.tables import measure_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--device", help="cpu or cuda:N (default: CUDA when present, else CPU)")
    parser.add_argument("--snapshot", metavar="FILE.pickle",
                        help="CUDA only: write a memory snapshot for https://pytorch.org/memory_viz")
    parser.add_argument("--no-estimates", action="store_true", help="measure only")
    parser.add_argument("--profiler-categories", action="store_true",
                        help="CPU: also PyTorch's own memory-timeline categories at its peak (slower)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_output_path(args.snapshot, (".pickle", ".pkl"), "--snapshot")
    workload = workload_from(args)
    methods = () if args.no_estimates else methods_for(workload)
    with Console(stderr=True).status(f"estimating, then running {workload.model} for real ..."):
        result = measure(workload, device=args.device, snapshot_path=args.snapshot, estimates=methods,
                         profiler_categories=args.profiler_categories)
    if args.json:
        print_json(result.to_json())
        return 0
    console = output_console()
    console.print(measure_table(result))
    for note in result.notes:
        console.print(f"[dim]note: {note}[/dim]")
    if result.extra.get("max_memory_reserved"):
        console.print(f"max_memory_allocated {result.extra['max_memory_allocated']:,} B, "
                      f"max_memory_reserved {result.extra['max_memory_reserved']:,} B")
    return 0
