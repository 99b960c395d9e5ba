"""Entry point: `memfit <command> ...`. User errors print one line and exit 2.

Only the command being run is imported (the commands load torch): `memfit --help` and `memfit --version` answer
at once."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import warnings

from memfit import __version__
from memfit.core.errors import MemfitError, closest

# name: (module, what it does); the order `memfit --help` lists them in
COMMANDS = {
    "models": ("memfit.cli.models", "list the bundled model architectures"),
    "gpus": ("memfit.cli.gpus", "list the GPU catalog"),
    "instances": ("memfit.cli.instances", "list machines to rent: GPUs, host RAM, links and list prices"),
    "techniques": ("memfit.cli.techniques", "list the memory techniques (-t NAME[:key=value,...])"),
    "estimate": ("memfit.cli.estimate", "estimate peak memory per device without running the model"),
    "measure": ("memfit.cli.measure", "run the workload for real on this machine and compare"),
    "plan": ("memfit.cli.plan", "find the fastest combination of techniques that fits your GPUs"),
    "explain-oom": ("memfit.cli.explain_oom", "explain a CUDA out-of-memory error and rank the fixes"),
}
# a command whose flags differ by task: (command, task) -> the module that takes that task
TASK_MODULES = {("estimate", "serve"): "memfit.cli.serve", ("explain-oom", "serve"): "memfit.cli.serve_oom",
                ("plan", "serve"): "memfit.cli.serve_plan"}


# llama.cpp: its own flags (llama-server's names), with or without --task serve
ENGINE_MODULES = {("estimate", "llama.cpp"): "memfit.cli.llamacpp", ("estimate", "ollama"): "memfit.cli.llamacpp",
                  ("plan", "llama.cpp"): "memfit.cli.llamacpp_plan", ("plan", "ollama"): "memfit.cli.llamacpp_plan",
                  ("explain-oom", "llama.cpp"): "memfit.cli.llamacpp_oom",
                  ("explain-oom", "ollama"): "memfit.cli.llamacpp_oom"}


def flag_in(argv: list[str], flag: str) -> str | None:
    """The value a command line gives a flag (--flag X or --flag=X), if any."""
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def task_in(argv: list[str]) -> str | None:
    """The --task a command line gives, if any."""
    return flag_in(argv, "--task")


def one_line(text: str) -> str:
    """A message on one line: control characters a user's value brought in (a newline, a carriage return) are
    shown escaped, as repr would show them."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, as for every user error
        suggestion = _suggestion(message, self)
        if suggestion:
            message = message.rstrip(".") + "." + suggestion
        print(f"memfit: error: {one_line(message)}", file=sys.stderr)
        raise SystemExit(2)


def _suggestion(message: str, parser: argparse.ArgumentParser) -> str:
    """A did-you-mean for argparse's own errors: an unknown choice, or an unknown flag of this parser."""
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        return closest(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
    unknown = re.search(r"unrecognized arguments: (.*)", message)
    if unknown:
        flags = [s for action in parser._actions for s in action.option_strings]
        for word in unknown.group(1).split():
            if word.startswith("-"):
                return closest(word.split("=")[0], flags, n=1)
    return ""


def version_line() -> str:
    """memfit's version and the installed libraries whose behaviour its estimates model (read without importing
    them), beside the versions memfit's rules were checked on (core/versions.py), and any rule outside them."""
    from memfit.core.versions import LIBRARIES, checked_range, installed, version_notes

    line = f"memfit {__version__} (" + "; ".join(
        f"{name} {installed(name) or 'not installed'}, checked with {checked_range(name)}" for name in LIBRARIES) + ")"
    return "\n".join([line, *version_notes("estimate"), *version_notes("measure")])


class _Version(argparse.Action):
    """--version, its line read only when asked for (the installed libraries' versions)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, with the full flags of the command `argv` names (the others listed by name only), and the
    command parsers by name."""
    parser = _Parser(prog="memfit", description="Make large PyTorch models fit in GPU memory.")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print memfit's version and the installed torch's and transformers', and exit")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    chosen = next((word for word in argv or () if not word.startswith("-")), None)
    commands: dict[str, argparse.ArgumentParser] = {}
    for name, (module, summary) in COMMANDS.items():
        commands[name] = subparsers.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")
        if name == chosen:
            task, engine = task_in(list(argv or ())) or "", flag_in(list(argv or ()), "--engine") or ""
            module = ENGINE_MODULES.get((name, engine), TASK_MODULES.get((name, task), module))
            importlib.import_module(module).add_arguments(commands[name])
    return parser, commands


def _quiet_libraries() -> None:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # before torch loads: c10's profiler warnings
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    warnings.filterwarnings("ignore")
    for name in ("torchao", "bitsandbytes", "torch.utils._pytree"):   # import-time chatter of optional extras
        logging.getLogger(name).setLevel(logging.ERROR)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line read, or one line and exit 2; an unknown flag is named against its command's own flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, commands = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = parse(argv)
    try:
        return args.run(args)
    except MemfitError as exc:
        print(f"memfit: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:   # a library failing inside memfit's own work on a combination memfit accepted
        if os.environ.get("MEMFIT_DEBUG"):
            raise
        print(f"memfit: error: {library_failure(exc, argv if argv is not None else sys.argv[1:])}", file=sys.stderr)
        return 1


LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "torchao", "deepspeed", "torch_pruning", "accelerate")


def library_failure(exc: BaseException, argv: list[str]) -> str:
    """One line for an unexpected failure: the library whose code raised it (else memfit), the exception, and the
    command line, which is what a report needs; MEMFIT_DEBUG=1 shows the traceback."""
    import traceback
    from pathlib import PurePath

    where = "memfit"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        parts = PurePath(frame.filename).parts
        found = next((p for p in parts if p in LIBRARIES), None)
        if found:
            where = found
            break
        if "memfit" in parts:
            break
    message = one_line(str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
    return (f"{where} failed ({type(exc).__name__}: {message[:200]}) on `memfit {' '.join(argv)}`: memfit accepted "
            "this combination, so this is a bug to report; MEMFIT_DEBUG=1 shows the traceback.")


if __name__ == "__main__":
    raise SystemExit(main())
