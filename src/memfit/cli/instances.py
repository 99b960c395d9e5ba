"""`memfit instances`: machines to rent, with their on-demand list prices (dated, sourced)."""
from __future__ import annotations

import argparse

from rich.table import Table

from memfit.cli.common import output_console, print_json
from memfit.core.units import format_bytes
from memfit.specs.hardware import get_gpu
from memfit.specs.instances import instance_catalog, parse_price, priced


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", help="only the machines with this GPU (memfit gpus)")
    parser.add_argument("--price", action="append", default=[], metavar="NAME=USD",
                        help="an instance's hourly price instead of its list price (repeatable)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(run=run)


def short_source(url: str | None) -> str:
    """A price source's page by its site, or its repository for GitHub-hosted data."""
    if not url:
        return "—"
    host, _, path = url.split("://", 1)[-1].partition("/")
    if host in ("github.com", "raw.githubusercontent.com"):
        return "/".join(path.split("/")[:2])
    return host


def run(args: argparse.Namespace) -> int:
    instances = priced(list(instance_catalog().values()), dict(parse_price(text) for text in args.price))
    if args.gpu:
        gpu = get_gpu(args.gpu)
        instances = [i for i in instances if i.gpu.name == gpu.name]
    if args.json:
        print_json({"schema": "memfit.instances/1", "instances": [i.to_json() for i in instances]})
        return 0
    table = Table(title="machines to rent — on-demand list prices as their source showed them on the date given "
                        "(--price NAME=USD to use yours)", title_justify="left")
    for column in ("name", "provider", "GPUs", "host RAM", "local NVMe", "GPU link", "network", "$/h", "price date",
                   "price source"):
        table.add_column(column, justify="right" if column in ("host RAM", "local NVMe", "$/h") else "left",
                         overflow="fold")
    for i in instances:
        table.add_row(i.name, i.provider, f"{i.gpus} × {i.gpu.name}", format_bytes(i.host_ram_bytes, 0),
                      format_bytes(i.local_nvme_bytes, 1) if i.local_nvme_bytes else "—", i.gpu_link,
                      f"{i.network_gbps:g} Gb/s" if i.network_gbps else "—",
                      f"{i.usd_per_hour:,.2f}" if i.usd_per_hour is not None else "—", i.price_date or "—",
                      short_source(i.price_source))
    console = output_console()
    console.print(table)
    console.print("[dim]each price's full source, region and note: memfit instances --json[/dim]")
    return 0
