"""Golden outputs: the JSON that `memfit estimate` (analytic and traced), `memfit plan` and `memfit explain-oom`
print for a fixed set of commands, recorded so that a refactoring can prove it changed nothing.

    python scripts/golden.py --check              # every case against tests/golden/*.json; prints the diffs
    python scripts/golden.py --check --kind plan  # one kind
    python scripts/golden.py --write              # record them again (after an intended change: say why)

Timings (`elapsed_s`) are dropped; everything else must be byte-identical. A command that fails records its
exit code and its one-line error, which must not change either. The suite does not run it (about two minutes).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden"
KINDS = ("analytic", "traced", "plan", "oom")

CATALOG = ("bert-base-uncased", "bert-large-uncased", "gemma-2-9b", "gpt2-large", "gpt2-medium", "gpt2-xl", "gpt2",
           "gpt3-175b", "llama-2-13b", "llama-2-70b", "llama-2-7b", "llama-3.1-405b", "llama-3.1-70b", "llama-3.1-8b",
           "mistral-7b", "mixtral-8x7b", "phi-3-mini", "qwen2.5-72b", "qwen2.5-7b", "t5-base", "tiny-bert",
           "tiny-gemma2", "tiny-gpt2", "tiny-llama", "tiny-mixtral", "tiny-phi3", "tiny-qwen2", "tiny-t5", "tiny-vit",
           "vit-base-patch16-224")
DECODER_TRAIN = ("llama-3.1-8b", "--seq-len", "2048", "--precision", "bf16-mixed", "--gpu", "h100-sxm-80gb")
DECODER_INFER = ("mistral-7b", "--task", "inference", "--seq-len", "2048", "--new-tokens", "32", "--batch-size", "4",
                 "--precision", "bf16", "--gpu", "l4")
TRAIN_TECHNIQUES = (
    ("-t", "checkpointing"), ("-t", "checkpointing:every=2"), ("-t", "checkpointing:mode=selective"),
    ("-t", "checkpointing:mode=offload"), ("-t", "chunked-ce"), ("-t", "chunked-ce:chunks=4", "-t", "checkpointing"),
    ("-t", "cpu-offload"), ("-t", "adamw8bit"), ("-t", "adamw4bit"), ("-t", "adafactor"), ("--optimizer", "sgd"),
    ("-t", "lora"), ("-t", "lora:rank=8,targets=q_proj|v_proj", "-t", "checkpointing"), ("-t", "qlora"),
    ("-t", "qlora:format=fp4,double_quant=false"), ("-t", "prune-structured"), ("-t", "prune-structured:part=mlp"),
    ("-t", "truncate:max_len=1024"), ("-t", "sequence-chunks:window=512"),
    ("-t", "sequence-chunks:window=768,stride=512"), ("-t", "expandable-segments"), ("-t", "release-cache"),
    ("-t", "distill"), ("--precision", "bf16", "-t", "distill:teacher=int8"), ("--precision", "fp32", "-t", "qat"),
    ("--precision", "fp32", "-t", "bf16"),
    ("--world-size", "8"), ("--world-size", "8", "-t", "ddp:bucket_view=true"), ("--world-size", "8", "--zero", "1"),
    ("--world-size", "8", "-t", "fsdp2"), ("--world-size", "8", "-t", "fsdp2:reshard=false"),
    ("--world-size", "8", "-t", "fsdp2", "-t", "cpu-offload", "-t", "checkpointing"),
    ("--world-size", "8", "-t", "tensor-parallel"),
    ("--world-size", "4", "--batch-size", "8", "-t", "pipeline-parallel:microbatches=4"),
    ("--world-size", "4", "--batch-size", "8", "-t", "pipeline-parallel:microbatches=8,schedule=gpipe"),
    ("--world-size", "8", "--zero", "1", "--engine", "deepspeed"),
    ("--world-size", "8", "--zero", "2", "--engine", "deepspeed"),
    ("--world-size", "8", "--zero", "3", "--engine", "deepspeed"),
    ("--world-size", "8", "--zero", "2", "--engine", "deepspeed", "-t", "cpu-offload"),
    ("--world-size", "8", "--zero", "3", "--engine", "deepspeed", "-t", "cpu-offload"),
    ("-t", "checkpointing", "-t", "chunked-ce", "-t", "cpu-offload", "-t", "expandable-segments"),
    # refused combinations: the error line is part of the output
    ("-t", "adamw8bit", "--world-size", "2", "--zero", "1"), ("--world-size", "2", "-t", "ddp", "-t", "fsdp2"),
    ("--world-size", "2", "-t", "fsdp2", "-t", "chunked-ce"), ("-t", "qlora", "-t", "lora"),
    ("--world-size", "2", "-t", "fsdp2", "-t", "adamw8bit"), ("-t", "cpu-offload", "-t", "adamw8bit"),
    ("--world-size", "2", "-t", "tensor-parallel", "-t", "cpu-offload"), ("-t", "distill", "-t", "chunked-ce"),
)
INFER_TECHNIQUES = (
    (), ("-t", "int8-weight-only"), ("-t", "int8-dynamic"), ("-t", "bnb-4bit"), ("-t", "bnb-4bit:format=fp4"),
    ("-t", "stream-layers"), ("-t", "sliding-window:window=512"), ("--world-size", "2", "-t", "tensor-parallel"),
    ("-t", "prune-structured:ratio=0.5"), ("-t", "checkpointing"),
)
TINY_TRAIN = ("tiny-llama", "--batch-size", "2", "--seq-len", "64")
TRACED_TECHNIQUES = (
    (), ("-t", "checkpointing"), ("-t", "checkpointing:mode=selective"), ("-t", "checkpointing:mode=offload"),
    ("-t", "chunked-ce"), ("-t", "cpu-offload"), ("-t", "adamw8bit"), ("-t", "adafactor"), ("-t", "lora"),
    ("-t", "qlora"), ("-t", "prune-structured"), ("-t", "bf16-mixed"), ("-t", "fp16-mixed"), ("-t", "bf16"),
    ("-t", "truncate:max_len=32"), ("-t", "sequence-chunks:window=16,stride=8"), ("-t", "distill"), ("-t", "qat"),
    ("--world-size", "2"), ("--world-size", "2", "-t", "fsdp2"), ("--world-size", "2", "-t", "tensor-parallel"),
    ("--world-size", "2", "-t", "pipeline-parallel:microbatches=2"),
    ("--world-size", "2", "-t", "fsdp2", "-t", "cpu-offload"),
)
OOM_MESSAGES = {
    "modern": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 19.68 GiB. GPU 0 has a total capacity of "
              "23.68 GiB of which 11.88 GiB is free. Including non-PyTorch memory, this process has 11.79 GiB memory "
              "in use. Of the allocated memory 11.44 GiB is allocated by PyTorch, and 43.59 MiB is reserved by PyTorch "
              "but unallocated.",
    "shared": "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.25 GiB. GPU 1 has a total capacity of 93.02 "
              "GiB of which 1.18 GiB is free. Process 2752205 has 91.82 GiB memory in use. Of the allocated memory "
              "90.63 GiB is allocated by PyTorch, and 120.54 MiB is reserved by PyTorch but unallocated.",
    "legacy": "RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 "
              "MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)",
    "fragmented": "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 23.99 GiB of which "
                  "140.00 MiB is free. Including non-PyTorch memory, this process has 23.50 GiB memory in use. Of the "
                  "allocated memory 18.00 GiB is allocated by PyTorch, and 5.00 GiB is reserved by PyTorch but "
                  "unallocated.",
    "truncated": "CUDA out of memory. Tried to allocate",
}


def _snapshot() -> dict:
    """A small memory snapshot in PyTorch's format: two segments, a trace that runs out of memory."""
    frames = {"weights": [{"filename": "torch/nn/modules/module.py", "name": "_apply", "line": 1}],
              "states": [{"filename": "torch/optim/adamw.py", "name": "_init_group", "line": 1}],
              "acts": [{"filename": "model.py", "name": "forward", "line": 1}]}
    trace = [{"action": "alloc", "addr": 0, "size": 4 << 30, "frames": frames["weights"]},
             {"action": "alloc", "addr": 1 << 40, "size": 8 << 30, "frames": frames["states"]},
             {"action": "alloc", "addr": 2 << 40, "size": 6 << 30, "frames": frames["acts"]},
             {"action": "oom", "size": 3 << 30, "device_free": 1 << 30}]
    blocks = [{"size": 4 << 30, "state": "active_allocated", "frames": frames["weights"]},
              {"size": 8 << 30, "state": "active_allocated", "frames": frames["states"]},
              {"size": 6 << 30, "state": "active_allocated", "frames": frames["acts"]},
              {"size": 2 << 30, "state": "inactive"}]
    return {"segments": [{"device": 0, "total_size": 20 << 30, "blocks": blocks}], "device_traces": [trace]}


FLAGS = {"task": "--task", "batch_size": "--batch-size", "seq_len": "--seq-len", "new_tokens": "--new-tokens",
         "precision": "--precision", "world_size": "--world-size", "zero_stage": "--zero", "engine": "--engine",
         "inputs": "--inputs"}


def example_cases(covered: dict[str, list[str]]) -> dict[str, list[str]]:
    """A case for each registered technique no other case names: its first declared example (techniques/*.py
    `examples`) at tiny-llama's traced shape, estimated as `memfit estimate` chooses."""
    from memfit.techniques import REGISTRY, parse_technique

    named = {word for argv in covered.values() for word in argv}
    named |= {parse_technique(word).name for word in named if word.split(":")[0] in REGISTRY}
    out = {}
    for name, cls in sorted(REGISTRY.items()):
        if name in named:
            continue
        spec, fields = cls.examples[0]
        shape = {"model": "tiny-llama", "batch_size": 2, "seq_len": 64, **fields}
        argv = ["estimate", shape.pop("model"), *(x for key, value in shape.items() for x in (FLAGS[key], str(value)))]
        out[f"example {spec}"] = [*argv, "-t", spec]
    return out


def cases(kind: str, folder: Path) -> dict[str, list[str]]:
    """Case name -> memfit's argv (every case prints JSON)."""
    out: dict[str, list[str]] = {}
    if kind == "analytic":
        for model in CATALOG:
            seq = ["--seq-len", "224"] if "vit" in model else ["--seq-len", "128"]
            out[f"{model} train"] = ["estimate", model, *seq, "--method", "analytic"]
            out[f"{model} train bf16-mixed h100"] = ["estimate", model, *seq, "--method", "analytic", "--precision",
                                                     "bf16-mixed", "--gpu", "h100-sxm-80gb", "--batch-size", "2"]
            out[f"{model} inference"] = ["estimate", model, *seq, "--method", "analytic", "--task", "inference",
                                         "--precision", "bf16", "--gpu", "a100-80gb"] + (
                [] if ("bert" in model or "vit" in model) else ["--new-tokens", "8"])
        for extra in TRAIN_TECHNIQUES:
            out["llama-3.1-8b train " + " ".join(extra)] = ["estimate", *DECODER_TRAIN, "--method", "analytic", *extra]
        for extra in INFER_TECHNIQUES:
            out["mistral-7b inference " + " ".join(extra)] = ["estimate", *DECODER_INFER, "--method", "analytic",
                                                              *extra]
        out["llama-3.1-8b fp16-mixed v100"] = ["estimate", "llama-3.1-8b", "--seq-len", "1024", "--precision",
                                               "fp16-mixed", "--gpu", "v100-32gb", "--method", "analytic"]
        out["eager sdpa train"] = ["estimate", str(folder / "eager.json"), "--seq-len", "512", "--method",
                                   "analytic", "-t", "sdpa", "--precision", "bf16-mixed", "--gpu", "a10g"]
        out["eager inference"] = ["estimate", str(folder / "eager.json"), "--seq-len", "512", "--method", "analytic",
                                  "--task", "inference", "--gpu", "a10g"]
        out["gemma2 checkpointing chunked"] = ["estimate", "gemma-2-9b", "--seq-len", "1024", "--method", "analytic",
                                               "--precision", "bf16", "-t", "checkpointing", "-t", "chunked-ce"]
        out["mixtral lora"] = ["estimate", "mixtral-8x7b", "--seq-len", "1024", "--method", "analytic",
                               "--precision", "bf16-mixed", "-t", "lora", "-t", "checkpointing"]
        out["t5 bf16 checkpointing"] = ["estimate", "t5-base", "--seq-len", "256", "--method", "analytic",
                                        "--precision", "bf16-mixed", "-t", "checkpointing", "--gpu", "t4"]
    elif kind == "traced":
        for extra in TRACED_TECHNIQUES:
            out["tiny-llama train " + " ".join(extra)] = ["estimate", *TINY_TRAIN, "--method", "traced", *extra]
        for extra in (("--gpu", "rtx-4090"), ("--gpu", "rtx-4090", "--precision", "bf16-mixed", "-t", "checkpointing")):
            out["tiny-llama train " + " ".join(extra)] = ["estimate", *TINY_TRAIN, "--method", "traced", *extra]
        out["tiny-llama inference"] = ["estimate", "tiny-llama", "--task", "inference", "--seq-len", "64",
                                       "--new-tokens", "8", "--method", "traced"]
        out["tiny-llama inference int8"] = ["estimate", "tiny-llama", "--task", "inference", "--seq-len", "64",
                                            "--new-tokens", "8", "--method", "traced", "-t", "int8-weight-only"]
        for model in ("tiny-bert", "tiny-gpt2", "tiny-t5", "tiny-qwen2", "tiny-mixtral", "tiny-gemma2", "tiny-phi3"):
            out[f"{model} train"] = ["estimate", model, "--batch-size", "2", "--seq-len", "64", "--method", "traced"]
        out["tiny-vit train"] = ["estimate", "tiny-vit", "--batch-size", "2", "--method", "traced"]
        for example in ("convnet", "lstm", "frozen_encoder"):
            out[f"{example} train"] = ["estimate", f"memfit.examples.{example}:build", "--inputs",
                                       f"memfit.examples.{example}:make_inputs", "--seq-len", "32", "--method",
                                       "traced", "--batch-size", "2"]
        out["frozen_encoder park-frozen"] = out["frozen_encoder train"] + ["-t", "park-frozen"]
        out.update(example_cases({**cases("analytic", folder), **out}))
    elif kind == "plan":
        plans = {
            "8b on a 4090": ["llama-3.1-8b", "--seq-len", "4096", "--global-batch", "64", "--gpu", "rtx-4090"],
            "8b on a 4090 with 128 GiB": ["llama-3.1-8b", "--seq-len", "4096", "--global-batch", "64", "--gpu",
                                          "rtx-4090", "--host-ram", "128GiB"],
            "70b on 8 h100": ["llama-3.1-70b", "--gpu", "h100-sxm-80gb", "--gpus", "8", "--host-ram", "1TiB"],
            "7b on 8 a100": ["llama-2-7b", "--gpu", "a100-80gb", "--gpus", "8", "--seq-len", "4096", "--global-batch",
                             "64"],
            "mistral inference on l4": ["mistral-7b", "--task", "inference", "--batch-size", "16", "--seq-len",
                                        "8192", "--new-tokens", "512", "--gpu", "l4"],
            "mistral lossy budget": ["mistral-7b", "--task", "inference", "--batch-size", "4", "--seq-len", "2048",
                                     "--new-tokens", "64", "--gpu", "l4", "--allow", "lossy", "--max-ppl-increase",
                                     "0.5%"],
            "gpt2-xl lossy on t4": ["gpt2-xl", "--gpu", "t4", "--allow", "lossy", "--max-ppl-increase", "2%"],
            "70b on one 4090": ["llama-3.1-70b", "--gpu", "rtx-4090", "--seq-len", "2048", "--host-ram", "0"],
            "tiny smallest": ["tiny-llama", "--gpu", "t4", "--seq-len", "256", "--global-batch", "8", "--objective",
                              "smallest"],
            "tiny balanced": ["tiny-llama", "--gpu", "t4", "--seq-len", "256", "--global-batch", "8", "--objective",
                              "balanced"],
            "bert on a10g": ["bert-large-uncased", "--gpu", "a10g", "--seq-len", "512", "--global-batch", "32"],
            "eager on 2 a10g": [str(folder / "eager.json"), "--gpu", "a10g", "--gpus", "2", "--seq-len", "512",
                                "--global-batch", "8"],
        }
        out = {name: ["plan", *argv, "--json"] for name, argv in plans.items()}
    else:
        for name in OOM_MESSAGES:
            out[f"message {name}"] = ["explain-oom", str(folder / f"{name}.log")]
        out["snapshot"] = ["explain-oom", str(folder / "snapshot.pickle")]
        out["message + snapshot"] = ["explain-oom", str(folder / "modern.log"), "--snapshot",
                                     str(folder / "snapshot.pickle")]
        out["8b workload"] = ["explain-oom", str(folder / "fragmented.log"), "--model", "llama-3.1-8b", "--seq-len",
                              "4096", "--precision", "bf16-mixed", "--gpu", "rtx-4090"]
        out["tiny workload with techniques"] = ["explain-oom", str(folder / "modern.log"), "--model", "tiny-llama",
                                                "--seq-len", "256", "--batch-size", "8", "-t", "checkpointing"]
        out["inference workload"] = ["explain-oom", str(folder / "shared.log"), "--model", "mistral-7b", "--task",
                                     "inference", "--seq-len", "8192", "--batch-size", "8", "--new-tokens", "64",
                                     "--precision", "bf16", "--gpu", "l4"]
        out = {name: argv + ["--json"] for name, argv in out.items()}
    return {name: argv + (["--json"] if "--json" not in argv else []) for name, argv in out.items()}


def write_inputs(folder: Path) -> None:
    from memfit.specs.model_source import catalog

    config = {**catalog()["tiny-llama"]["hf_config"], "attn_implementation": "eager", "hidden_size": 1024,
              "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 8,
              "vocab_size": 32000, "max_position_embeddings": 4096}
    (folder / "eager.json").write_text(json.dumps(config))
    for name, text in OOM_MESSAGES.items():
        (folder / f"{name}.log").write_text(text)
    with open(folder / "snapshot.pickle", "wb") as fh:
        pickle.dump(_snapshot(), fh)


def _strip(value, folder: str):
    """Timings out; the temporary folder's path replaced by a fixed name."""
    if isinstance(value, dict):
        return {k: _strip(v, folder) for k, v in value.items() if k != "elapsed_s"}
    if isinstance(value, list):
        return [_strip(v, folder) for v in value]
    if isinstance(value, str):
        return value.replace(folder, "<inputs>").replace(Path(folder).name, "<inputs>")
    return value


def run_case(argv: list[str], folder: Path):
    from memfit.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except Exception as exc:   # a crash is recorded too: fixing it is an intended change
            return {"crash": f"{type(exc).__name__}: {exc}"}
    if code != 0:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return _strip({"exit": code, "error": lines[-1] if lines else ""}, str(folder))
    return _strip(json.loads(out.getvalue()), str(folder))


def run_kind(kind: str, folder: Path, only: set[str] | None = None, progress=None) -> dict:
    results = {}
    for name, argv in cases(kind, folder).items():
        if only is not None and name not in only:
            continue
        started = time.perf_counter()
        results[name] = run_case(argv, folder)
        if progress:
            progress(f"{kind}: {name} ({time.perf_counter() - started:.1f} s)")
    return results


def golden_path(kind: str) -> Path:
    return GOLDEN / f"{kind}.json"


def diff(kind: str, got: dict, want: dict) -> list[str]:
    problems = []
    for name in sorted(set(got) | set(want)):
        if name not in want:
            problems.append(f"{kind}: {name}: not recorded")
        elif name not in got:
            continue   # a sample run
        elif json.dumps(got[name], sort_keys=True) != json.dumps(want[name], sort_keys=True):
            problems.append(f"{kind}: {name}: differs\n" + _first_difference(got[name], want[name]))
    return problems


def _first_difference(got, want, path: str = "") -> str:
    if isinstance(got, dict) and isinstance(want, dict):
        for key in sorted(set(got) | set(want), key=str):
            if got.get(key, "<absent>") != want.get(key, "<absent>"):
                return _first_difference(got.get(key, "<absent>"), want.get(key, "<absent>"), f"{path}.{key}")
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                return _first_difference(a, b, f"{path}[{i}]")
    return f"    at {path or '.'}: got {json.dumps(got)[:300]}\n    want {json.dumps(want)[:300]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="record the outputs")
    action.add_argument("--check", action="store_true", help="compare with the recorded outputs")
    parser.add_argument("--kind", choices=KINDS, action="append", help="only these kinds (repeatable)")
    parser.add_argument("--case", action="append", help="only the cases with this name (repeatable)")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    problems = []
    with tempfile.TemporaryDirectory(prefix="memfit-golden-") as tmp:
        folder = Path(tmp)
        write_inputs(folder)
        for kind in args.kind or KINDS:
            got = run_kind(kind, folder, set(args.case) if args.case else None,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
            if args.write:
                GOLDEN.mkdir(parents=True, exist_ok=True)
                recorded = json.loads(golden_path(kind).read_text()) if args.case and golden_path(kind).exists() else {}
                golden_path(kind).write_text(json.dumps({**recorded, **got}, indent=1, sort_keys=True) + "\n")
                print(f"wrote {len(got)} {kind} cases to {golden_path(kind)}")
            else:
                problems += diff(kind, got, json.loads(golden_path(kind).read_text()))
    for line in problems:
        print(line)
    if args.check:
        print("golden outputs: " + ("all identical" if not problems else f"{len(problems)} differ"))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
