"""`memfit models`: the bundled architectures with their parameter counts."""
from __future__ import annotations

import argparse

from rich.table import Table

from memfit.cli.common import output_console, print_json
from memfit.estimators import count_parameters
from memfit.specs.model_source import catalog, resolve_source
from memfit.specs.workload import Workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(run=run)


def rows() -> list[dict]:
    out = []
    for name, doc in catalog().items():
        source = resolve_source(name)
        config = doc["hf_config"]
        seq = min(8, source.max_seq_len or 8) if source.head != "image-classification" else source.image_size
        out.append({
            "name": name, "model_type": config["model_type"], "class": source.hf_class_name,
            "num_parameters": count_parameters(Workload(model=name, seq_len=seq)),
            "published_num_parameters": doc.get("published_num_parameters"),
            "num_layers": source.num_layers, "max_seq_len": source.max_seq_len, "reference": doc.get("reference"),
        })
    return out


def run(args: argparse.Namespace) -> int:
    data = rows()
    if args.json:
        print_json({"schema": "memfit.models/1", "models": data})
        return 0
    table = Table(title="memfit model catalog (parameters counted from the architecture)", title_justify="left")
    for column in ("name", "type", "parameters", "layers", "max seq", "reference"):
        table.add_column(column, justify="right" if column in ("parameters", "layers", "max seq") else "left",
                         no_wrap=column == "name", overflow="fold")
    for row in data:
        table.add_row(row["name"], row["model_type"], f"{row['num_parameters']:,}", str(row["num_layers"]),
                      str(row["max_seq_len"] or "—"), row["reference"] or "")
    output_console().print(table)
    return 0
