"""`memfit explain-oom LOG --engine llama.cpp --model MODEL [--quant T] [settings] --gpu G`: which buffer of llama.cpp's
did not fit, and the fixes computed for that model, each with what it buys."""
from __future__ import annotations

import argparse

from memfit.cli.console import output_console, print_json, read_text
from memfit.cli.llamacpp import FLAGS, add_settings, settings_from
from memfit.core.errors import MemfitError
from memfit.core.units import GiB
from memfit.serving.gguf_recipe import FILE_TYPES
from memfit.serving.llamacpp import gguf_model
from memfit.serving.llamacpp_oom import fixes, gpu_budget, parse_failure, with_log_settings
from memfit.specs.hardware import get_gpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Explain a llama.cpp (or Ollama) allocation failure: which buffer did not fit, and the "
                          "changes that would make it fit, computed for the model.")
    parser.add_argument("source", nargs="?", default="-", help="llama.cpp's log (or - for stdin, the default)")
    parser.add_argument("--engine", choices=("llama.cpp",), required=True, help="llama.cpp")
    parser.add_argument("--model", help="the .gguf file, or a Hugging Face model with --quant")
    parser.add_argument("--quant", type=str.upper, metavar="TYPE", help=f"its file type: {', '.join(FILE_TYPES)}")
    parser.add_argument("--gpu", required=True, help="the GPU (memfit gpus)")
    parser.add_argument("--engine-version", metavar="YYYY-MM", help="the llama.cpp build's date")
    add_settings(parser.add_argument_group("llama.cpp settings (its own names; the log's where not given)"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    failure = parse_failure(read_text(args.source))
    if not args.model:
        raise MemfitError("name the model that failed (--model FILE.gguf, or a Hugging Face model with --quant): the "
                          "fixes are computed for it.")
    gpu = get_gpu(args.gpu)
    given = {field for _, field, _, _ in FLAGS if getattr(args, field) is not None}
    settings = with_log_settings(settings_from(args), failure, given)
    model = gguf_model(args.model, args.quant)
    ways_out = fixes(model, gpu, settings,
                     None if args.model.endswith(".gguf") else lambda quant: gguf_model(args.model, quant))
    if args.json:
        print_json({"schema": "memfit.llamacpp-oom/1", "buffer": failure.buffer, "summary": failure.summary,
                    "line": failure.line, "failed_bytes": failure.failed_bytes, "settings_from_log": failure.settings,
                    "gpu_budget_bytes": gpu_budget(gpu),
                    "fixes": [{"change": f.change, "gpu_bytes": f.gpu_bytes, "buys": f.buys} for f in ways_out]})
        return 0
    console = output_console()
    console.print(f"{failure.summary}:\n  {failure.line}")
    console.print(f"{gpu.name}: {gpu_budget(gpu) / GiB:.2f} GiB for llama.cpp's buffers (its total less the CUDA "
                  "context, assumed)")
    if not ways_out:
        console.print("no single change fits it: fewer layers on the GPU and a smaller file type together, or a larger "
                      "GPU (memfit plan --engine llama.cpp searches them)")
    for fix in ways_out:
        console.print(f"  {fix.change:<40} {fix.buys}")
    return 0
