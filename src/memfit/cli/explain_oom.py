"""`memfit explain-oom`: read a CUDA OOM (message, log or memory snapshot) and rank the fixes."""
from __future__ import annotations

import argparse
import sys

from memfit.cli.common import output_console, print_json
from memfit.core.errors import MemfitError
from memfit.measurement.oom import load_snapshot, parse_oom_message, summarize_snapshot
from memfit.report.oom_fixes import analyze, print_report, to_json
from memfit.specs.hardware import get_gpu
from memfit.specs.workload import Workload
from memfit.techniques.resolve import resolve

SNAPSHOT_SUFFIXES = (".pickle", ".pkl")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("explain-oom", help="explain a CUDA out-of-memory error and rank the fixes")
    parser.add_argument("source", nargs="?", default="-",
                        help="a log or traceback holding the OOM message, a memory snapshot .pickle "
                             "(torch.cuda.memory._dump_snapshot), or - for stdin (default)")
    parser.add_argument("--snapshot", metavar="FILE.pickle", help="a memory snapshot besides the message")
    parser.add_argument("--model", help="the workload that failed (memfit models): fixes are then predicted by "
                                        "memfit's estimate of it")
    parser.add_argument("--task", default="train")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=0)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("-t", "--technique", action="append", default=[], dest="techniques", metavar="NAME[:k=v]")
    parser.add_argument("--gpu", help="the GPU it ran on (memfit gpus), for the workload's estimate")
    parser.add_argument("--json", action="store_true", help="one JSON object (schema memfit.oom/1)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    message = snapshot = None
    snapshot_path = args.snapshot
    if args.source.endswith(SNAPSHOT_SUFFIXES):
        snapshot_path = args.source
    else:
        message = parse_oom_message(_read_text(args.source))
    if snapshot_path:
        snapshot = summarize_snapshot(load_snapshot(snapshot_path))
    workload = None
    if args.model:
        workload = resolve(Workload(model=args.model, task=args.task, batch_size=args.batch_size,
                                    seq_len=args.seq_len, new_tokens=args.new_tokens, precision=args.precision,
                                    optimizer=args.optimizer, techniques=tuple(args.techniques)))
    elif args.techniques:
        raise MemfitError("-t describes the workload that failed: pass --model with it.")
    analysis = analyze(message, snapshot, workload, get_gpu(args.gpu) if args.gpu else None)
    if args.json:
        print_json(to_json(analysis))
    else:
        print_report(analysis, output_console())
    return 0


def _read_text(source: str) -> str:
    if source == "-":
        if sys.stdin.isatty():
            raise MemfitError("paste the OOM message on stdin, or give a log file or a snapshot .pickle.")
        return sys.stdin.read()
    try:
        with open(source, errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:
        raise MemfitError(f"no such file {source!r}.") from None
