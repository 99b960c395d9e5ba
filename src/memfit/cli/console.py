"""Where the commands print: light (no torch), so a command that needs no model answers at once."""
from __future__ import annotations

import json
import os
import sys

from rich.console import Console

from memfit.core.errors import MemfitError

PIPED_WIDTH = 100   # a log or CI: what a reader's terminal or editor shows without scrolling


def output_console() -> Console:
    """Where a command prints its tables: the terminal at its width; piped into a file or a CI log, $COLUMNS if set,
    else 100 columns (and no colour codes)."""
    if sys.stdout.isatty():
        return Console()
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() and int(columns) > 0 else PIPED_WIDTH)


def print_json(data: dict) -> None:
    print(json.dumps(data, indent=2))


def read_text(source: str) -> str:
    if source == "-":
        if sys.stdin.isatty():
            raise MemfitError("paste the OOM message on stdin, or give a log file or a snapshot .pickle.")
        return sys.stdin.read()
    try:
        with open(source, errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:
        raise MemfitError(f"no such file {source!r}.") from None
