"""Entry point: `memfit <command> ...`. User errors print one line and exit 2."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from memfit.core.errors import MemfitError


def one_line(text: str) -> str:
    """A message on one line: control characters a user's value brought in (a newline, a carriage return) are
    shown escaped, as repr would show them."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, as for every user error
        print(f"memfit: error: {one_line(message)}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    # the commands load torch: imported after _quiet_libraries has set torch's and transformers' logging
    from memfit.cli import estimate, explain_oom, gpus, instances, measure, models, plan, techniques

    parser = _Parser(prog="memfit", description="Make large PyTorch models fit in GPU memory.")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in (models, gpus, instances, techniques, estimate, measure, plan, explain_oom):
        module.add_parser(subparsers)
    return parser


def _quiet_libraries() -> None:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # before torch loads: c10's profiler warnings
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    warnings.filterwarnings("ignore")
    for name in ("torchao", "bitsandbytes", "torch.utils._pytree"):   # import-time chatter of optional extras
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except MemfitError as exc:
        print(f"memfit: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
