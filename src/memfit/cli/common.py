"""Flags shared by the commands that take a workload, and their mapping onto Workload."""
from __future__ import annotations

import argparse
from typing import Any

from memfit.cli.console import PIPED_WIDTH, output_console, print_json  # noqa: F401  (the commands' import)
from memfit.core.errors import MemfitError
from memfit.core.precision import PRECISIONS
from memfit.core.units import parse_bytes
from memfit.planner import load_plan
from memfit.specs.hardware import GPU, get_gpu
from memfit.specs.workload import DEEPSPEED_REDUCE_BUCKET, ENGINES, OPTIMIZER_IMPLS, TASKS, Workload
from memfit.techniques.resolve import ResolvedWorkload, optimizers, resolve

# The workload's flags: (flag and aliases, Workload field, argparse options, help). Every command that takes a
# workload takes all of them; each defaults to "not given" (None), so a command can tell what the user set, and
# Workload's own defaults (named in the help) fill the rest.
WorkloadFlag = tuple[tuple[str, ...], str, dict[str, Any], str]
WORKLOAD_FLAGS: tuple[WorkloadFlag, ...] = (
    (("--task",), "task", {}, f"one of {', '.join(TASKS)} (default train)"),
    (("--batch-size",), "batch_size", {"type": int}, "micro-batch size (default 1)"),
    (("--seq-len",), "seq_len", {"type": int},
     "tokens per sequence; image side for vision models (default 512, or the image size)"),
    (("--new-tokens",), "new_tokens", {"type": int}, "decode steps after the prefill (inference)"),
    (("--precision",), "precision", {}, f"one of {', '.join(PRECISIONS)} (default fp32)"),
    (("--optimizer",), "optimizer", {}, f"one of {', '.join(optimizers())} (default adamw)"),
    (("--optimizer-impl",), "optimizer_impl", {"metavar": "IMPL"},
     f"how torch.optim runs the step: {', '.join(OPTIMIZER_IMPLS)} (default: PyTorch's choice on the device: "
     "foreach on CUDA, for-loop on the CPU)"),
    (("--world-size", "--gpus"), "world_size", {"type": int, "metavar": "N"},
     "GPUs (ranks) the step runs over (default 1)"),
    (("--zero",), "zero_stage", {"type": int}, "ZeRO stage 0-3 over the ranks"),
    (("--engine",), "engine", {}, f"training engine: {' or '.join(ENGINES)}"),
    (("--reduce-bucket",), "reduce_bucket", {"type": int, "metavar": "ELEMENTS"},
     f"--engine deepspeed: ZeRO's reduce_bucket_size (default {DEEPSPEED_REDUCE_BUCKET}, DeepSpeed's; a buffer of "
     "this many half-precision elements per rank)"),
    (("--allow-long-seq",), "allow_long_seq", {"action": "store_const", "const": True},
     "allow a sequence longer than the model's maximum (positions are extended)"),
    (("-t", "--technique"), "techniques", {"action": "append", "metavar": "NAME[:k=v,...]"},
     "apply a memory technique (repeatable; see `memfit techniques`)"),
)
MODEL_HELP = ("catalog name (memfit models), a Hugging Face config.json, folder or hub id, or package.module:function "
              "/ path/file.py:function returning an nn.Module")


def add_workload_arguments(parser: argparse.ArgumentParser, *, model_flag: bool = False) -> None:
    """The workload's flags (WORKLOAD_FLAGS), the model (positional, or `--model` where the command's positional is
    something else), a saved plan instead of both, the user's own code and --json."""
    if model_flag:
        parser.add_argument("--model", help=MODEL_HELP)
    else:
        parser.add_argument("model", nargs="?", help=MODEL_HELP)
    parser.add_argument("--plan", metavar="PLAN.json", help="the workload of a plan saved by `memfit plan --save` "
                                                            "(instead of a model and flags)")
    parser.add_argument("--plan-index", type=int, default=0, metavar="K", help="which plan of the file (default 0, "
                                                                               "the best)")
    add_user_code_arguments(parser)
    group = parser.add_argument_group("workload")
    for flags, field, options, text in WORKLOAD_FLAGS:
        group.add_argument(*flags, dest=field, default=None, help=text, **options)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_user_code_arguments(parser: argparse.ArgumentParser) -> None:
    """--step and --inputs: the user's own step and a custom module's batch."""
    parser.add_argument("--step", metavar="MODULE:FUNCTION",
                        help="your own step: package.module:function or path/file.py:function, called as "
                             "fn(model, batch, optimizer) (optimizer None for --task inference); traced and measured "
                             "as it runs")
    parser.add_argument("--inputs", help="package.module:function(batch_size, seq_len) returning the batch "
                                         "(needed for a custom module)")


def given_workload_flags(args: argparse.Namespace) -> dict:
    """The workload fields the command line set, by Workload field name (techniques as a tuple)."""
    given = {field: getattr(args, field) for _, field, _, _ in WORKLOAD_FLAGS if getattr(args, field) is not None}
    if "techniques" in given:
        given["techniques"] = tuple(given["techniques"])
    return given


def flag_of(field: str) -> str:
    """The command-line flag of a Workload field."""
    return next(flags[0] for flags, name, _, _ in WORKLOAD_FLAGS if name == field)


def workload_from(args: argparse.Namespace) -> ResolvedWorkload:
    given = given_workload_flags(args)
    if args.plan:
        if args.model or given:
            flags = ["the model"] * bool(args.model) + [flag_of(field) for field in given]
            raise MemfitError(f"--plan gives the whole workload; drop {', '.join(flags)}.")
        return resolve(load_plan(args.plan, args.plan_index)[0])
    if not args.model:
        raise MemfitError("name a model (memfit models lists them) or pass --plan PLAN.json.")
    return resolve(Workload(model=args.model, inputs=args.inputs, step=args.step, **given))


def add_gpu_arguments(parser: argparse.ArgumentParser, gpu_help: str) -> None:
    parser.add_argument("--gpu", help=gpu_help)
    parser.add_argument("--gpu-memory", metavar="SIZE",
                        help="the GPU's total memory as CUDA reports it, e.g. 39.4GiB (a MIG slice, ECC, another "
                             "driver); default: the catalog's")


def gpu_from(args: argparse.Namespace, fallback: GPU | None = None) -> GPU | None:
    """The --gpu named, else the target GPU of a --plan file, else `fallback`; with --gpu-memory's total."""
    if args.gpu:
        gpu: GPU | None = get_gpu(args.gpu)
    elif getattr(args, "plan", None):
        gpu = load_plan(args.plan, args.plan_index)[1]
    else:
        gpu = fallback
    if args.gpu_memory is None:
        return gpu
    if gpu is None:
        raise MemfitError("--gpu-memory gives the total of the GPU --gpu names; name one (memfit gpus).")
    return gpu.with_memory(parse_bytes(args.gpu_memory, "--gpu-memory"))


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


def check_output_path(path: str | None, suffixes: tuple[str, ...], flag: str) -> None:
    if path and not path.endswith(suffixes):
        raise MemfitError(f"{flag} {path!r}: the file name must end in {', '.join(suffixes)}.")
