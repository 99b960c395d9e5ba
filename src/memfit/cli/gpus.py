"""`memfit gpus`: the GPU catalog."""
from __future__ import annotations

import argparse

from rich.table import Table

from memfit.cli.common import output_console, print_json
from memfit.core.units import format_bytes
from memfit.specs.hardware import gpu_catalog


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    gpus = list(gpu_catalog().values())
    if args.json:
        print_json({"schema": "memfit.gpus/1", "gpus": [g.to_json() for g in gpus]})
        return 0
    table = Table(title="memfit GPU catalog (dense TFLOP/s; context memory is assumed)", title_justify="left")
    for column in ("name", "memory", "BF16 TF/s", "FP16 TF/s", "mem GB/s", "interconnect", "GB/s", "aliases"):
        table.add_column(column, justify="left" if column in ("name", "interconnect", "aliases") else "right",
                         no_wrap=column == "name", overflow="fold")
    for g in gpus:
        table.add_row(g.name, format_bytes(g.memory_bytes), str(g.bf16_tflops or "—"), str(g.fp16_tflops),
                      str(g.memory_bandwidth_gbps), g.interconnect, str(g.interconnect_gbps), ", ".join(g.aliases))
    output_console().print(table)
    return 0
