"""Flags shared by the commands that take a workload, and their mapping onto Workload."""
from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from memfit.core.errors import MemfitError
from memfit.core.precision import PRECISIONS
from memfit.planner import load_plan
from memfit.specs.hardware import GPU, get_gpu
from memfit.specs.workload import DEEPSPEED_REDUCE_BUCKET, ENGINES, OPTIMIZER_IMPLS, TASKS, Workload
from memfit.techniques.resolve import ResolvedWorkload, optimizers, resolve


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="catalog name (memfit models), path to a HF config.json or "
                                                 "folder, or package.module:function returning an nn.Module")
    parser.add_argument("--plan", metavar="PLAN.json", help="the workload of a plan saved by `memfit plan --save` "
                                                            "(instead of a model and flags)")
    parser.add_argument("--plan-index", type=int, default=0, metavar="K", help="which plan of the file (default 0, "
                                                                               "the best)")
    add_user_code_arguments(parser)
    parser.add_argument("--task", default="train", help=f"one of {', '.join(TASKS)} (default train)")
    parser.add_argument("--batch-size", type=int, default=1, help="micro-batch size (default 1)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence; image side for vision models (default 512, or the image size)")
    parser.add_argument("--new-tokens", type=int, default=0, help="decode steps after the prefill (inference)")
    parser.add_argument("--precision", default="fp32", help=f"one of {', '.join(PRECISIONS)} (default fp32)")
    parser.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(optimizers())} (default adamw)")
    parser.add_argument("--optimizer-impl", metavar="IMPL",
                        help=f"how torch.optim runs the step: {', '.join(OPTIMIZER_IMPLS)} (default: PyTorch's choice "
                             "on the device: foreach on CUDA, for-loop on the CPU)")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--zero", type=int, default=0, dest="zero_stage", help="ZeRO stage 0-3 over --world-size")
    parser.add_argument("--engine", default="pytorch", help=f"training engine: {' or '.join(ENGINES)}")
    parser.add_argument("--reduce-bucket", type=int, default=DEEPSPEED_REDUCE_BUCKET, metavar="ELEMENTS",
                        help="--engine deepspeed: ZeRO's reduce_bucket_size (default %(default)s, DeepSpeed's; "
                             "a buffer of this many half-precision elements per rank)")
    parser.add_argument("--allow-long-seq", action="store_true",
                        help="allow a sequence longer than the model's maximum (positions are extended)")
    parser.add_argument("-t", "--technique", action="append", default=[], dest="techniques", metavar="NAME[:k=v,...]",
                        help="apply a memory technique (repeatable; see `memfit techniques`)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_user_code_arguments(parser: argparse.ArgumentParser) -> None:
    """--step and --inputs: the user's own step and a custom module's batch."""
    parser.add_argument("--step", metavar="MODULE:FUNCTION",
                        help="your own step: package.module:function or path/file.py:function, called as "
                             "fn(model, batch, optimizer) (optimizer None for --task inference); traced and measured "
                             "as it runs")
    parser.add_argument("--inputs", help="package.module:function(batch_size, seq_len) returning the batch "
                                         "(needed for a custom module)")


def workload_from(args: argparse.Namespace) -> ResolvedWorkload:
    if args.plan:
        if args.model or args.techniques:
            raise MemfitError("--plan gives the model and its techniques; drop the model name and -t flags.")
        return resolve(load_plan(args.plan, args.plan_index)[0])
    if not args.model:
        raise MemfitError("name a model (memfit models lists them) or pass --plan PLAN.json.")
    return resolve(Workload(model=args.model, inputs=args.inputs, step=args.step, task=args.task,
                            batch_size=args.batch_size, seq_len=args.seq_len, new_tokens=args.new_tokens,
                            precision=args.precision, optimizer=args.optimizer, optimizer_impl=args.optimizer_impl,
                            world_size=args.world_size, zero_stage=args.zero_stage,
                            engine=args.engine, reduce_bucket=args.reduce_bucket,
                            allow_long_seq=args.allow_long_seq, techniques=tuple(args.techniques)))


def gpu_from(name: str | None, args: argparse.Namespace | None = None) -> GPU | None:
    """The --gpu named, else the target GPU of a --plan file, else None."""
    if name:
        return get_gpu(name)
    if args is not None and getattr(args, "plan", None):
        return load_plan(args.plan, args.plan_index)[1]
    return None


def command_line(workload: ResolvedWorkload) -> str:
    """The flags that reproduce `workload` (for `memfit estimate` or `memfit measure`)."""
    defaults = Workload.__dataclass_fields__
    parts = [workload.model, "--task", workload.task, "--batch-size", str(workload.batch_size),
             "--seq-len", str(workload.effective_seq_len)]
    for field, flag in (("inputs", "--inputs"), ("step", "--step"), ("new_tokens", "--new-tokens"),
                        ("precision", "--precision"), ("optimizer", "--optimizer"),
                        ("optimizer_impl", "--optimizer-impl"), ("world_size", "--world-size"),
                        ("zero_stage", "--zero"), ("engine", "--engine")):
        value = getattr(workload, field)
        if value != defaults[field].default:
            parts += [flag, str(value)]
    for spec in workload.techniques:
        parts += ["-t", spec]
    return " ".join(parts)


PIPED_WIDTH = 240   # a log or CI keeps long lines; a table narrower than its content wraps into unreadable cells


def output_console() -> Console:
    """Where a command prints its tables: the terminal at its width, or, piped into a file or a CI log, a width
    that fits memfit's widest table on one line per row (and no colour codes)."""
    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)


def print_json(data: dict) -> None:
    print(json.dumps(data, indent=2))


def check_output_path(path: str | None, suffixes: tuple[str, ...], flag: str) -> None:
    if path and not path.endswith(suffixes):
        raise MemfitError(f"{flag} {path!r}: the file name must end in {', '.join(suffixes)}.")
