"""llama.cpp's speed on this CPU, file types side by side: a 250M-parameter llama-shaped model (random weights, the
gguf package) quantized by llama.cpp's own quantizer to several types, each loaded in turn and timed generating
(one token a step, tg) and reading a prompt (pp512), at an empty and a 2048-token context; the rounds interleave the
types, and each figure is the best of its rounds (this machine is shared). Beside each, the ratio memfit's speed model
(serving/llamacpp_speed.py) predicts against F16: a generated token reads each weight once, at the rate of its type's
kernel (calibrated on published GPU runs), and the cache at the depth.

    bash scripts/setup_llamacpp.sh                                  # once: ./.venv-llama
    .venv-llama/bin/python benchmarks/llamacpp_cpu_speed.py        # -> benchmarks/results/llamacpp_cpu_speed.{json,txt}

Only ratios measured in one run are compared: absolute tokens/s on a shared 2-core machine say little.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
RESULTS = os.path.join(HERE, "results", "llamacpp_cpu_speed")
MODEL = dict(arch="llama", n_embd=2048, n_layer=4, n_head=16, n_head_kv=4, n_ff=5632, n_vocab=32000)
TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K", "IQ4_XS")
DEPTHS = (0, 2048)
TG_STEPS = 24


def measure(path: str, depths: tuple[int, ...]) -> dict:
    """In this process (a child per file): pp512 and tg at each depth, tokens per second."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 4096, 512, 512
    params.n_threads = params.n_threads_batch = os.cpu_count() or 1
    context = llama_cpp.llama_init_from_model(model, params)
    rng = random.Random(0)

    def decode(n: int) -> float:
        tokens = (llama_cpp.llama_token * n)(*[rng.randrange(1, MODEL["n_vocab"]) for _ in range(n)])
        started = time.perf_counter()
        if llama_cpp.llama_decode(context, llama_cpp.llama_batch_get_one(tokens, n)) != 0:
            raise SystemExit(f"llama_decode failed on {path}")
        return time.perf_counter() - started

    out = {}
    for depth in depths:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context), True)
        for _ in range(depth // 512):
            decode(512)
        pp = 512 / decode(512)
        for _ in range(4):   # warm
            decode(1)
        tg = TG_STEPS / sum(decode(1) for _ in range(TG_STEPS))
        out[f"pp512@d{depth}"], out[f"tg@d{depth + 512}"] = pp, tg
    llama_cpp.llama_free(context)
    llama_cpp.llama_model_free(model)
    return out


def predicted_ratios(files: dict[str, str], depth: int) -> dict[str, float]:
    """memfit's tg speed of each type against F16's, every layer on the CPU (the host's bandwidth cancels)."""
    from memfit.serving.gguf_file import read_gguf
    from memfit.serving.llamacpp import LlamaCppSettings, estimate_llamacpp
    from memfit.serving.llamacpp_speed import HOST_BANDWIDTH_GBPS, decode_seconds

    seconds = {}
    for kind, path in files.items():
        model = read_gguf(path)
        estimate = estimate_llamacpp(model, LlamaCppSettings(ctx_size=4096, n_gpu_layers=0))
        seconds[kind] = decode_seconds(estimate, model, None, HOST_BANDWIDTH_GBPS, depth / estimate.kv.cells)
    return {kind: seconds["F16"] / seconds[kind] for kind in files}


def run(rounds: int, folder: str) -> dict:
    from llamacpp_cpu_run import quantize, write_gguf

    source = os.path.join(folder, "speed-F32.gguf")
    write_gguf(source, **MODEL)
    files = {}
    for kind in TYPES:
        files[kind] = os.path.join(folder, f"speed-{kind}.gguf")
        print(f"quantizing {kind}", file=sys.stderr, flush=True)
        quantize(source, files[kind], kind)
    os.remove(source)
    best: dict[str, dict[str, float]] = {kind: {} for kind in TYPES}
    for round_ in range(rounds):
        for kind in TYPES if round_ % 2 == 0 else reversed(TYPES):
            child = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", files[kind]],
                                   capture_output=True, text=True, timeout=900)
            if child.returncode != 0:
                raise SystemExit(f"{kind}: {child.stderr[-2000:]}")
            for test, speed in json.loads(child.stdout.strip().splitlines()[-1]).items():
                best[kind][test] = max(best[kind].get(test, 0.0), speed)
            print(f"round {round_ + 1}/{rounds} {kind}: {best[kind]}", file=sys.stderr, flush=True)
    predicted = {depth + 512: predicted_ratios(files, depth + 512) for depth in DEPTHS}
    return {"model": MODEL, "threads": os.cpu_count(), "rounds": rounds, "measured_tokens_per_s": best,
            "predicted_tg_ratio_to_f16": {str(d): r for d, r in predicted.items()},
            "file_bytes": {kind: os.path.getsize(path) for kind, path in files.items()}}


def table(result: dict) -> str:
    best, lines = result["measured_tokens_per_s"], []
    lines.append(f"llama.cpp on this CPU ({result['threads']} threads), a {MODEL['n_layer']}-layer n_embd "
                 f"{MODEL['n_embd']} model, best of {result['rounds']} interleaved rounds; ratios against F16")
    lines.append(f"{'type':<8} {'MiB':>7} {'pp512 t/s':>10} {'pp ratio':>9} " + " ".join(
        f"{'tg@' + str(d + 512):>9} {'ratio':>6} {'memfit':>6} {'error':>7}" for d in DEPTHS))
    errors = []
    for kind in TYPES:
        row = f"{kind:<8} {result['file_bytes'][kind] / 2**20:7.1f} {best[kind]['pp512@d0']:10.1f} " \
              f"{best[kind]['pp512@d0'] / best['F16']['pp512@d0']:9.2f} "
        for depth in DEPTHS:
            test = f"tg@d{depth + 512}"
            ratio = best[kind][test] / best["F16"][test]
            model = result["predicted_tg_ratio_to_f16"][str(depth + 512)][kind]
            errors.append(abs(model / ratio - 1)) if kind != "F16" else None
            row += f"{best[kind][test]:9.2f} {ratio:6.2f} {model:6.2f} {model / ratio - 1:+7.0%} "
        lines.append(row.rstrip())
    lines.append(f"memfit's tg ratios against the measured: mean |error| {sum(errors) / len(errors):.0%}, worst "
                 f"{max(errors):.0%}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, DEPTHS)))
        return
    with tempfile.TemporaryDirectory(prefix="memfit-llamacpp-speed-") as folder:
        result = run(args.rounds, folder)
    with open(RESULTS + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
        fh.write("\n")
    text = table(result)
    with open(RESULTS + ".txt", "w") as fh:
        fh.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
