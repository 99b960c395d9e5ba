"""Real llama.cpp --fit here: llama.cpp's own llama-fit-params (the release llama-cpp-python 0.3.36 vendors) fitting
tiny GGUF models to fake GPUs, and memfit's replay of that fit (serving/llamacpp_fit.py) on the same model and
free memory.

A fake GPU is ggml's RPC server serving this CPU as a device: llama.cpp counts an RPC device as a GPU, and the
preloaded shim (benchmarks/native/fake_device_memory.c) sets the memory it reports. Its backend is the CPU's, which
copies no weight from the host to run a prompt's products: memfit's --no-op-offload. Each case records the fitted
arguments llama-fit-params prints and the projections its trace (-lv 4) prints; each split the compute buffers its
dry run reserves on each device; each load (llama-batched-bench) the ones a real load allocates.

    bash scripts/setup_llamacpp_fit.sh                 # once: ./.llamacpp-tools (about 10 minutes)
    python benchmarks/llamacpp_fit_run.py --record     # -> benchmarks/results/llamacpp_fit_run.json
    python benchmarks/llamacpp_fit_run.py              # memfit against the record -> results/llamacpp_fit_run.txt
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.environ.get("MEMFIT_LLAMACPP_TOOLS", os.path.join(REPO, ".llamacpp-tools"))
RESULT = os.path.join(REPO, "benchmarks", "results", "llamacpp_fit_run.json")
TEXT = os.path.join(REPO, "benchmarks", "results", "llamacpp_fit_run.txt")
PORT = 21152   # below the ephemeral ports (32768-60999), which client sockets in TIME_WAIT may hold
MiB = 2**20

# tiny float32 models (write_gguf's arguments), trained at 32768 tokens so that an unset context can shrink
MODELS = {
    "dense": dict(arch="llama", n_embd=256, n_layer=8, n_head=8, n_head_kv=4, n_ff=1024, n_vocab=2048,
                  n_ctx_train=32768),
    "moe": dict(arch="llama", n_embd=256, n_layer=8, n_head=8, n_head_kv=4, n_ff=1024, n_vocab=2048, n_expert=4,
                n_expert_used=2, n_ff_exp=1024, n_ctx_train=32768),
    "qwen3": dict(arch="qwen3", n_embd=384, n_layer=12, n_head=6, n_head_kv=2, n_ff=1024, n_vocab=4096,
                  head_dim=128, n_ctx_train=32768),
}
# (model, each fake GPU's MiB, llama-fit-params' arguments besides -m and --rpc)
CASES = [
    ("dense", [220], "-fitt 1 -fitc 256"),                 # nothing changes
    ("dense", [100], "-fitt 1 -fitc 256"),                 # the context shrinks
    ("dense", [1200], ""),                                 # the default target (1024 MiB) and least context
    ("dense", [30], "-fitt 1 -fitc 256"),                  # the least context, then layers
    ("dense", [40], "-c 4096 -fitt 1"),                    # a context given: layers
    ("dense", [25], "-c 2048 -fitt 1 -np 2"),              # two slots
    ("dense", [40], "-c 4096 -fitt 1 -ctk q8_0 -ctv q8_0"),
    ("dense", [20, 30], "-c 4096 -fitt 1"),                # two GPUs
    ("dense", [300], "-fitt 1 -fitc 1024 -fa off"),
    ("qwen3", [60], "-fitt 1 -fitc 512"),
    ("qwen3", [30], "-c 8192 -fitt 1"),
    ("moe", [90], "-c 4096 -fitt 1"),                      # the experts of the last layers on the CPU
    ("moe", [60], "-c 4096 -fitt 1"),
    ("moe", [80], "-fitt 1 -fitc 1024"),
    ("moe", [20], "-c 4096 -fitt 1"),                      # even the dense weights do not fit
    ("moe", [40, 40], "-c 4096 -fitt 1"),
    ("moe", [55, 60], "-c 4096 -fitt 1"),                  # a layer's FFN split over two GPUs
]


# (model, each fake GPU's MiB, llama.cpp's settings): the compute buffer of each device for a graph split between
# devices, as llama.cpp's dry run reserves it (llama-fit-params --fit-print: its sched_reserve lines)
SPLITS = [
    ("dense", [400], "-c 4096"),
    ("dense", [400], "-c 4096 -ngl 5"),
    ("dense", [400], "-c 4096 -ngl 1"),
    ("dense", [400], "-c 2048 -ngl 3 -fa off"),
    ("dense", [400], "-c 4096 -ngl 6 -ctk q8_0 -ctv q8_0 -ub 256"),
    ("dense", [400, 400], "-c 4096 -ngl 6 -ts 1,1"),
    ("dense", [400, 400], "-c 4096"),                      # every layer on two GPUs: pipelined
    ("moe", [300, 400], "-c 2048 -ub 256"),
    ("qwen3", [400], "-c 4096 -ngl 7"),
    ("moe", [400], "-c 4096 -ngl 1"),
    ("moe", [400], "-c 4096 -ngl 2"),
    ("moe", [400], "-c 4096 -ngl 5"),
    ("moe", [400], "-c 4096 -ncmoe 3"),
    ("moe", [400], r"-c 4096 -ot blk\.[1-8]\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU"),
    ("moe", [400], r"-c 4096 -ot blk\.1\.ffn_(gate|up|gate_up|down).*=CPU,"
                   r"blk\.[2-8]\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU"),
    ("moe", [400, 400], "-c 4096 -ngl 7 -ts 2,1"),
]

# (model, each fake GPU's MiB, llama.cpp's settings): each device's compute buffer as a real load allocates it
# (llama-batched-bench, --fit off): --no-kv-offload without flash attention, whose dry run (the fit's, above) loses
# llama.cpp's setting of the attention's output to the CPU (ggml_backend_sched_reserve_size resets the scheduler)
LOADS = [
    ("dense", [400], "-c 2048 -ngl 3 -nkvo -fa off"),
    ("dense", [400], "-c 4096 -nkvo -fa off"),
    ("qwen3", [400], "-c 4096 -nkvo -fa off"),
    ("dense", [400, 400], "-c 4096 -nkvo -fa off"),
    ("dense", [400], "-c 4096 -ngl 5 -nkvo"),
    ("dense", [400], "-c 4096 -nkvo"),
    ("moe", [400], "-c 4096 -ngl 5 -nkvo -fa off"),
    ("dense", [400], "-c 4096 -ngl 5"),                     # the cache on the GPU, for comparison
]


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wait_for(port: int) -> None:
    for _ in range(100):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"ggml-rpc-server did not listen on port {port}")


def run_case(folder: str, model: str, free_mib: list[int], arguments: str, *, split: bool = False,
             load: bool = False) -> dict:
    """llama-fit-params on fake GPUs of `free_mib` MiB: its fitted arguments and the first projection its trace
    prints; with `split`, instead each device's compute buffer at these settings (MiB, as its log prints them); with
    `load`, the same from a real load (llama-batched-bench, one short prompt and one token, --fit off). llama.cpp
    logs from a thread of its own: on a busy machine its last lines may be lost as it exits, so a run that lacks them
    is run again (three tries)."""
    path = os.path.join(folder, f"{model}.gguf")
    if not os.path.exists(path):
        _benchmark("llamacpp_cpu_run").write_gguf(path, **MODELS[model])
    tool = ["llama-batched-bench", "-npp", "8", "-ntg", "1", "-npl", "1", "-fit", "off", "-lv", "4"] if load \
        else ["llama-fit-params", *(["-lv", "5", "-fitp", "on"] if split else ["-lv", "4"])]
    for attempt in range(3):
        done = _run_on_fake_gpus(tool + ["-m", path, *arguments.split()], free_mib)
        if done.returncode != 0:
            raise SystemExit(f"{tool[0]} failed on {model} {free_mib} {arguments}:\n{done.stderr[-3000:]}")
        if split or load:
            compute = {}
            for device, mib in re.findall(r"sched_reserve:\s+(\S+) compute buffer size =\s+([\d.]+) MiB",
                                          done.stderr):
                compute[_device_name(device, len(free_mib))] = float(mib)
            if compute or attempt == 2:
                return {"model": model, "free_mib": free_mib, "arguments": arguments, "compute_mib": compute}
            continue
        lines = done.stdout.strip().splitlines()
        projected = re.search(r"projected to use (\d+) MiB", done.stderr)
        if (lines and projected) or attempt == 2:
            fitted = lines[-1] if lines else ""
            for index in range(len(free_mib)):
                fitted = fitted.replace(f"RPC0[127.0.0.1:{PORT + index}]", f"GPU{index}")
            return {"model": model, "free_mib": free_mib, "arguments": arguments, "fitted": fitted,
                    "projected_mib": int(projected.group(1)) if projected else None}
    raise AssertionError("unreachable")


def _run_on_fake_gpus(command: list[str], free_mib: list[int]) -> subprocess.CompletedProcess:
    """One of llama.cpp's tools with an RPC server per fake GPU of `free_mib` MiB (`--rpc` added)."""
    global PORT
    PORT += 4   # a fresh port for each run: a server just stopped may still hold the last one
    tools = os.path.join(TOOLS, "build", "bin")
    servers = []
    try:
        for index, mib in enumerate(free_mib):
            env = {**os.environ, "LD_PRELOAD": os.path.join(TOOLS, "fake_device_memory.so"),
                   "FAKE_DEVICE_MIB": str(mib)}
            servers.append(subprocess.Popen([os.path.join(tools, "ggml-rpc-server"), "-H", "127.0.0.1", "-p",
                                             str(PORT + index), "-t", "1"], env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
            _wait_for(PORT + index)
        endpoints = ",".join(f"127.0.0.1:{PORT + i}" for i in range(len(free_mib)))
        return subprocess.run([os.path.join(tools, command[0]), *command[1:], "--rpc", endpoints],
                              capture_output=True, text=True, timeout=300)
    finally:
        for server in servers:
            server.kill()
            server.wait()


def _device_name(buffer: str, gpus: int) -> str:
    """A server's buffer, RPC0[host:port], as memfit's GPU of that index (the CPU's stays CPU)."""
    for index in range(gpus):
        if buffer == f"RPC0[127.0.0.1:{PORT + index}]":
            return f"GPU{index}"
    return buffer


def record() -> tuple[list[dict], list[dict], list[dict]]:
    with tempfile.TemporaryDirectory() as folder:
        results, splits, loads = [], [], []
        for model, free_mib, arguments in CASES:
            results.append(run_case(folder, model, free_mib, arguments))
            print(f"{model:<6} {'+'.join(map(str, free_mib)):>7} MiB  {arguments:<38} -> {results[-1]['fitted']}",
                  file=sys.stderr)
        for model, free_mib, arguments in SPLITS:
            splits.append(run_case(folder, model, free_mib, arguments, split=True))
            print(f"{model:<6} {arguments:<60} -> {splits[-1]['compute_mib']}", file=sys.stderr)
        for model, free_mib, arguments in LOADS:
            loads.append(run_case(folder, model, free_mib, arguments, load=True))
            print(f"{model:<6} {arguments:<60} -> {loads[-1]['compute_mib']} (a real load)", file=sys.stderr)
    return results, splits, loads


def _case_settings(case: dict):
    """The recorded case's model (the file it wrote, read back), settings (llama.cpp's flags; the RPC device copies
    no weight) and llama-fit-params' own flags."""
    from memfit.cli.llamacpp import add_settings, settings_from
    from memfit.serving.gguf_file import read_gguf
    from memfit.serving.llamacpp_fit import FIT_CTX, FIT_TARGET

    parser = argparse.ArgumentParser()
    add_settings(parser)   # as the command line reads them
    parser.add_argument("-fitt", type=int, default=FIT_TARGET // MiB)
    parser.add_argument("-fitc", type=int, default=FIT_CTX)
    args = parser.parse_args(case["arguments"].split())
    args.engine, args.engine_version = "llama.cpp", None
    settings = settings_from(args)
    settings = type(settings)(**{**settings.__dict__, "no_op_offload": True})
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"{case['model']}.gguf")
        _benchmark("llamacpp_cpu_run").write_gguf(path, **MODELS[case["model"]])
        model = read_gguf(path)
    return model, settings, args


def memfit_fit(case: dict):
    """memfit's fit of the recorded case, on the same model, settings and free memory."""
    from memfit.serving.llamacpp_fit import fit_llamacpp

    model, settings, args = _case_settings(case)
    return fit_llamacpp(model, settings, free=[mib * MiB for mib in case["free_mib"]], margins=[args.fitt * MiB],
                        n_ctx_min=None if args.ctx_size == 0 else args.fitc)


def compare_split(case: dict) -> dict:
    """memfit's compute buffer on each device against llama.cpp's (MiB to its log's 2 decimals)."""
    from memfit.serving.llamacpp import estimate_llamacpp

    model, settings, _ = _case_settings(case)
    estimate = estimate_llamacpp(model, settings, gpus=len(case["free_mib"]))
    memfit = {name: round(estimate.buffers[name].compute / MiB, 2) for name in case["compute_mib"]}
    return {**case, "memfit_mib": memfit, "same": memfit == case["compute_mib"]}


def fitted_settings(text: str) -> dict:
    """llama-fit-params' line (-c N -ngl N [-ts a,b] [-ot "p=B,..."]) as comparable values."""
    from memfit.serving.llamacpp_fit import parse_overrides

    overrides = re.search(r'-ot "([^"]*)"', text)
    split = re.search(r"-ts (\S+)", text)
    return {"ctx_size": int(re.search(r"-c (\d+)", text).group(1)),
            "n_gpu_layers": int(re.search(r"-ngl (-?\d+)", text).group(1)),
            "tensor_split": tuple(float(x) for x in split.group(1).split(",")) if split else None,
            "override_tensor": parse_overrides(overrides.group(1)) if overrides else ()}


def compare(case: dict) -> dict:
    fit = memfit_fit(case)
    memfit = fitted_settings(fit.arguments())
    llama = fitted_settings(case["fitted"])
    projected = int(re.search(r"use (\d+) MiB", fit.steps[0]).group(1))
    return {**case, "memfit": fit.arguments(), "same": memfit == llama, "memfit_projected_mib": projected,
            "differs_in": [key for key in memfit if memfit[key] != llama[key]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help=f"run llama.cpp's fit on every case: {RESULT}")
    args = parser.parse_args()
    if args.record:
        cases, splits, loads = record()
        with open(RESULT, "w") as fh:
            json.dump({"llama_cpp": "llama-cpp-python 0.3.36's vendored llama.cpp: llama-fit-params, "
                       "llama-batched-bench, ggml-rpc-server", "cases": cases, "splits": splits, "loads": loads},
                      fh, indent=1)
            fh.write("\n")
    with open(RESULT) as fh:
        recorded = json.load(fh)
    rows = [compare(case) for case in recorded["cases"]]
    splits = [compare_split(case) for case in recorded["splits"]]
    loads = [compare_split(case) for case in recorded.get("loads", [])]
    lines = ["llama.cpp's --fit (llama-fit-params, llama-cpp-python 0.3.36's llama.cpp) on fake GPUs here, and "
             "memfit's replay of it;",
             "proj.: the MiB the GPUs would use with the settings given (the fit's first projection)",
             f"{'model':<6} {'GPUs MiB':>8}  {'arguments':<36} {'proj.':>5} {'memfit':>6}  same  llama.cpp's fit "
             "(memfit's below where they differ)"]
    for row in rows:
        lines.append(f"{row['model']:<6} {'+'.join(map(str, row['free_mib'])):>8}  {row['arguments']:<36} "
                     f"{row['projected_mib']:>5} {row['memfit_projected_mib']:>6}  "
                     f"{'yes' if row['same'] else 'NO ':<4}  {row['fitted'][:60]}")
        if not row["same"]:
            lines.append(f"{'':>70}memfit: {row['memfit'][:60]} ({', '.join(row['differs_in'])} differ)")
    same = sum(row["same"] for row in rows)
    lines.append(f"memfit's fit equal to llama.cpp's in {same} of {len(rows)} cases; projections within "
                 f"{max(abs(r['projected_mib'] - r['memfit_projected_mib']) for r in rows)} MiB")
    lines += ["", "each device's compute buffer (MiB) for a graph split between devices: llama.cpp's / memfit's",
              f"{'model':<6} {'arguments':<64} devices"]
    for row in splits:
        shown = "  ".join(f"{name} {mib:.2f}/{row['memfit_mib'][name]:.2f}" for name, mib in row["compute_mib"].items())
        lines.append(f"{row['model']:<6} {row['arguments'][:64]:<64} {shown}{'' if row['same'] else '  (differs)'}")
    lines.append(f"equal in {sum(r['same'] for r in splits)} of {len(splits)} settings, every device")
    lines += ["", "each device's compute buffer (MiB) in a real load (llama-batched-bench): llama.cpp's / memfit's"]
    for row in loads:
        shown = "  ".join(f"{name} {mib:.2f}/{row['memfit_mib'][name]:.2f}" for name, mib in row["compute_mib"].items())
        lines.append(f"{row['model']:<6} {row['arguments'][:64]:<64} {shown}{'' if row['same'] else '  (differs)'}")
    lines.append(f"equal in {sum(r['same'] for r in loads)} of {len(loads)} loads, every device")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(TEXT, "w") as fh:
        fh.write(text)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import docs_sync  # the docs show these results

    docs_sync.sync()


if __name__ == "__main__":
    main()
