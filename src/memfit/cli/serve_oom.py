"""`memfit explain-oom LOG --task serve --engine vllm --model MODEL [settings]`: a serving engine's start-up failure
and the fixes computed for that model, each with what it buys. Light, like `memfit estimate --task serve`."""
from __future__ import annotations

import argparse

from memfit.cli import serve
from memfit.cli.console import output_console, print_json, read_text
from memfit.core.errors import MemfitError
from memfit.report.serving_report import print_serving_failure, serving_failure_json
from memfit.serving import estimate, load_model
from memfit.serving.fixes import parse_failure, serving_fixes, with_log_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", nargs="?", default="-", help="the engine's log (or - for stdin, the default)")
    serve.add_arguments(parser, model_flag=True)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    failure = parse_failure(read_text(args.source))
    if not args.model:
        raise MemfitError("name the model that failed (--model NAME, a config.json or a hub id): the fixes are "
                          "computed for it.")
    given = {field for _, field, _, _ in serve.SERVE_FLAGS if getattr(args, field) is not None}
    settings = with_log_settings(serve.settings_from(args), failure, given)
    gpu = serve.gpu_of(args)
    if failure.total_bytes and not args.gpu_memory:   # the log states the device's total
        gpu = gpu.with_memory(failure.total_bytes)
    model = load_model(args.model)
    predicted = estimate(model, gpu, settings)
    fixes = serving_fixes(model, gpu, settings)
    if args.json:
        print_json(serving_failure_json(failure, predicted, fixes))
    else:
        print_serving_failure(failure, predicted, fixes, output_console())
    return 0
