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
    table = Table(title="memfit GPU catalog: memory as CUDA reports it, dense tensor TFLOP/s (fp32 accumulate), "
                        "memory GB/s, GPU link GB/s; * assumed or derived", title_justify="left")
    for column in ("name", "memory", "BF16", "FP16", "GB/s", "link", "aliases"):
        table.add_column(column, justify="left" if column in ("name", "link", "aliases") else "right",
                         no_wrap=column in ("name", "memory", "link"), overflow="fold")
    for g in gpus:
        table.add_row(g.name, format_bytes(g.memory_bytes) + _mark(g.memory_source),
                      f"{g.bf16_tflops or '—'}{_mark(g.rates_source)}", str(g.fp16_tflops),
                      str(g.memory_bandwidth_gbps), f"{g.interconnect} {g.interconnect_gbps:g}", ", ".join(g.aliases))
    console = output_console()
    console.print(table)
    console.print("where each figure comes from: memfit gpus --json (memory_source, rates_source); "
                  "--gpu-memory SIZE gives your device's total")
    return 0


def _mark(source: str) -> str:
    """"*" for a figure that is assumed, derived or nominal rather than published for that GPU."""
    return "*" if source.startswith(("assumed", "derived", "nominal", "no ")) else ""
