"""`memfit techniques`: every technique, what it does, its parameters and its accuracy-risk label."""
from __future__ import annotations

import argparse

from rich.table import Table

from memfit.cli.common import output_console, print_json
from memfit.techniques import REGISTRY
from memfit.techniques.base import CHANGES, TRAITS
from memfit.techniques.rules import declared_rules
from memfit.techniques.stages import ORDER


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    stages = [stage for stage, _ in ORDER]
    rows = sorted(REGISTRY.values(), key=lambda cls: (stages.index(cls.stage), cls.name))
    if args.json:
        print_json({"techniques": [{"name": c.name, "stage": c.stage, "risk": c.risk,
                                    "changes": c.training_change(), "summary": c.summary,
                                    "parameters": c.parameters(), "time_factor": c.time_factor} for c in rows],
                    "changes": CHANGES,
                    "order": [{"stage": s, "why": why} for s, why in ORDER],
                    "rules": declared_rules(), "traits": TRAITS})
        return 0
    table = Table(title="memfit techniques (apply with -t NAME[:key=value,...]; applied in this order)",
                  title_justify="left")
    for column, ratio in (("name", None), ("stage", None), ("what it does", 3), ("parameters (defaults)", 2),
                          ("risk", None), ("changes", 1)):
        table.add_column(column, no_wrap=ratio is None, ratio=ratio, overflow="fold")
    for cls in rows:
        table.add_row(cls.name, cls.stage, cls.summary, cls.parameters(), cls.risk, cls.training_change())
    console = output_console()
    console.print(table)
    console.print("[dim]risk: lossless = same results; numerical = same up to floating-point rounding; "
                  "lossy = results change[/dim]")
    console.print("[dim]changes (what it changes in training, least first; `memfit plan` prefers the least among "
                  "plans about as fast): " + "; ".join(f"{name} = {what}" for name, what in CHANGES.items()) + "[/dim]")
    return 0
