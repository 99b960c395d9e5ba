"""memfit's serving speed against published benchmark runs: every row of the calibration set
(published_serving_throughput.md, copied from the shared data) typed in as the engine's settings and the benchmark
client's load, memfit's simulated figures beside the published ones.

    python benchmarks/published_serving_throughput.py   # writes benchmarks/results/published_serving_throughput.*

Rows {id, metric, reported, predicted, error, notes}; error = predicted / reported - 1. A setting the source does not
state is memfit's default unless a row's notes name the value assumed; a row memfit cannot express (an engine or GPU
it does not model, pipeline parallel, offload) is a miss with its reason. The summary's mean and worst are over each
row's throughput (output tokens/s, else total tokens/s, else requests/s); the target (issue 41): mean |error| <= 10 %,
worst <= 25 % over the rows whose source states every setting (FULL).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

from rich.table import Table

from memfit.core.errors import MemfitError
from memfit.serving.estimate import estimate_serving
from memfit.serving.load import Load
from memfit.serving.served_model import served_model
from memfit.serving.settings import ServeSettings
from memfit.specs.hardware import get_gpu
from memfit.specs.model_configs import find_config

sys.path.insert(0, str(Path(__file__).parent))
from published_table import rows_table, write_results

INF = math.inf
FP8 = {"quant_method": "fp8"}
FP8_BLOCK = {"quant_method": "fp8", "weight_block_size": [128, 128]}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
METRICS = {"req/s": "request_throughput", "out tok/s": "output_tokens_per_s", "total tok/s": "total_tokens_per_s",
           "TTFT ms": "mean_ttft_ms", "TPOT ms": "mean_tpot_ms", "median TTFT ms": "median_ttft_ms",
           "median TPOT ms": "median_tpot_ms", "ITL ms": "mean_itl_ms"}
THROUGHPUT = ("out tok/s", "total tok/s", "req/s")   # a row's headline: the first it reports
GPUSTACK = "GPUStack performance lab: engine version, serve command and client stated"


def sharegpt(mean_in: float, mean_out: float, prompts: int = 1000, **load) -> dict:
    return dict(dataset="sharegpt", input_len=mean_in, output_len=mean_out, num_prompts=prompts, **load)


def fixed(input_len: int, output_len: int, prompts: int, **load) -> dict:
    return dict(dataset="random", input_len=input_len, output_len=output_len, num_prompts=prompts, **load)


# id, model, gpu, checkpoint quantization_config, settings, load, {metric: reported}, full settings?, notes
ROWS = [
    ("R01", "qwen3-14b", "h100", None, dict(engine_version="0.11.0"), sharegpt(217.4, 201.6),
     {"req/s": 15.74, "out tok/s": 3173.92, "total tok/s": 6595.66, "TTFT ms": 22141.21, "TPOT ms": 226.03}, True, ()),
    ("R03", "qwen3-14b", "h100", None, dict(engine_version="0.11.0"), fixed(2000, 100, 500),
     {"req/s": 5.06, "out tok/s": 505.51, "total tok/s": 10597.19, "TTFT ms": 50716.13, "TPOT ms": 206.51}, True, ()),
    ("R04", "qwen3-14b", "h100", None, dict(engine_version="0.11.0"), fixed(32000, 100, 100),
     {"req/s": 0.26, "out tok/s": 25.48, "total tok/s": 8298.56, "TTFT ms": 191024.43, "TPOT ms": 277.44}, True, ()),
    ("R07", "qwen3-8b", "h100", None, dict(engine_version="0.11.0"), sharegpt(232.6, 220.6, 100, max_concurrency=2),
     {"req/s": 1.17, "out tok/s": 257.19, "total tok/s": 528.35, "TTFT ms": 63.78, "TPOT ms": 7.37}, True,
     ("calibrates vLLM V1's host time per step",)),
    ("R09", "qwen3-8b", "h100", None, dict(engine_version="0.9.2"), sharegpt(217, 200),
     {"total tok/s": 13305.38, "TTFT ms": 5172.78, "TPOT ms": 126.55}, True, ()),
    ("R10", "qwen3-8b", "h100", FP8, dict(engine_version="0.9.2"), sharegpt(217, 200),
     {"total tok/s": 16452.52, "TTFT ms": 4116.87, "TPOT ms": 85.57}, True,
     ("an fp8 per-tensor checkpoint (static scales)",)),
    ("R11", "qwen3-8b", "h100", None, dict(engine_version="0.9.2", quantization="fp8"), sharegpt(217, 200),
     {"total tok/s": 15275.64, "TTFT ms": 4445.10, "TPOT ms": 98.94}, True, ()),
    ("R12", "qwen3-8b", "h100", AWQ, dict(engine_version="0.9.2"), sharegpt(217, 200),
     {"total tok/s": 9756.06, "TTFT ms": 8794.29, "TPOT ms": 209.13}, True, ()),
    ("R13", "qwen3-8b", "h100", None, dict(engine_version="0.9.2", kv_cache_dtype="fp8"), sharegpt(217, 200),
     {"total tok/s": 13513.19, "TTFT ms": 5688.39, "TPOT ms": 103.21}, True, ()),
    ("R14", "qwen3-8b", "a100-80gb", None, dict(engine_version="0.9.2"), sharegpt(217, 200),
     {"total tok/s": 10338.25, "TTFT ms": 3412.85, "TPOT ms": 200.02}, True, ()),
    ("R15", "qwen3-8b", "a100-80gb", AWQ, dict(engine_version="0.9.2"), sharegpt(217, 200),
     {"total tok/s": 9611.61, "TTFT ms": 3950.64, "TPOT ms": 249.06}, True, ()),
    ("R16", "qwen3-8b", "a100-80gb", GPTQ, dict(engine_version="0.9.2"), sharegpt(217, 200),
     {"total tok/s": 8129.27, "TTFT ms": 10414.74, "TPOT ms": 261.64}, True, ()),
    ("R17", "qwen3-8b", "rtx-4090", None, dict(engine_version="0.9.2", max_model_len=8192), sharegpt(217, 200),
     {"total tok/s": 3869.3, "TTFT ms": 15385.7, "TPOT ms": 63.45}, True,
     ("max_model_len not stated: 8192 assumed (the model's 40960 does not fit beside its weights)",)),
    ("R18", "qwen3-8b", "rtx-4090", AWQ, dict(engine_version="0.9.2", max_model_len=8192), sharegpt(217, 200),
     {"total tok/s": 5653.4, "TTFT ms": 7913.4, "TPOT ms": 87.7}, True, ("max_model_len not stated: 8192 assumed",)),
    ("R19", "qwen3-235b-a22b", "h100", None, dict(engine_version="0.11.0", tensor_parallel=8),
     sharegpt(216.4, 197.0),
     {"req/s": 20.38, "out tok/s": 4015.36, "total tok/s": 8424.86, "TTFT ms": 8730.69, "TPOT ms": 147.56}, True,
     ("984 of 1000 requests succeeded",)),
    ("R20", "qwen3-235b-a22b", "h100", FP8_BLOCK, dict(engine_version="0.11.0", tensor_parallel=4),
     sharegpt(216.5, 197.6),
     {"req/s": 18.18, "out tok/s": 3592.57, "total tok/s": 7527.80, "TTFT ms": 9924.69, "TPOT ms": 169.20}, True, ()),
    ("R21", "deepseek-v3", "h200-141gb", None, dict(engine_version="0.11.0", tensor_parallel=8),
     sharegpt(219.2, 200.8),
     {"req/s": 13.06, "out tok/s": 2621.05, "total tok/s": 5482.59, "TTFT ms": 17743.08, "TPOT ms": 227.45}, True,
     ("DeepSeek-R1-0528: DeepSeek-V3's architecture and fp8 block checkpoint",)),
    ("R22", "deepseek-v3", "h200-141gb", None, dict(engine_version="0.11.0", tensor_parallel=8),
     fixed(4000, 200, 500),
     {"req/s": 3.77, "out tok/s": 753.67, "total tok/s": 15808.55, "TTFT ms": 63058.71, "TPOT ms": 164.23}, True,
     ("DeepSeek-R1-0528: DeepSeek-V3's architecture and fp8 block checkpoint",)),
    ("R29", "mistral-7b", "h100", None, dict(engine_version="0.5.4", gpu_memory_utilization=0.95, max_num_seqs=1024),
     sharegpt(158.5, 249, 10),
     {"req/s": 1.35, "out tok/s": 336.73, "total tok/s": 551.08, "TTFT ms": 51.81, "TPOT ms": 8.95}, False,
     ("calibrates vLLM V0's host time per step; version and server flags inferred by the table's compiler",)),
    ("R30", "mixtral-8x7b", "h100", None,
     dict(engine_version="0.5.4", tensor_parallel=2, gpu_memory_utilization=0.95, max_num_seqs=1024,
          max_model_len=2048), sharegpt(230.2, 218.9, 320),
     {"req/s": 9.95, "out tok/s": 2178.61, "total tok/s": 4469.70, "TTFT ms": 8536.45, "TPOT ms": 97.30}, False, ()),
    ("R31", "llama-3.1-70b", "h100", None,
     dict(engine_version="0.5.4", tensor_parallel=4, gpu_memory_utilization=0.95, max_num_seqs=1024,
          max_model_len=2048), sharegpt(204.9, 176.7, 320),
     {"req/s": 13.84, "out tok/s": 2445.30, "total tok/s": 5281.32, "TTFT ms": 2764.06, "TPOT ms": 88.09}, False,
     ("Meta-Llama-3-70B: Llama-3.1-70B's shapes",)),
    ("R35", "qwen3-32b", "h100-nvl-94gb", None, dict(engine_version="0.8.5", max_model_len=32000, max_num_seqs=32),
     sharegpt(217.4, 200.5),
     {"req/s": 3.26, "out tok/s": 653.61, "total tok/s": 1362.23, "TTFT ms": 146809.12}, False,
     ("prefix caching on: ShareGPT's prompts share no prefix",)),
    ("R36", "qwen3-235b-a22b", "b200", FP8_BLOCK,
     dict(tensor_parallel=4, kv_cache_dtype="fp8", gpu_memory_utilization=0.85, max_model_len=32768),
     fixed(30000, 1000, 128, max_concurrency=64),
     {"req/s": 0.85, "out tok/s": 847.07, "total tok/s": 26259.21, "TTFT ms": 15725.91}, False,
     ("vLLM main in June 2026: the newest release memfit models taken",)),
    ("R39", "qwen3-8b", "mi300x", None, dict(), fixed(1024, 1024, 100, max_concurrency=32),
     {"req/s": 2.64, "out tok/s": 2701.39, "total tok/s": 5402.79, "TTFT ms": 645.02, "TPOT ms": 9.42}, False,
     ("Qwen3Guard-Gen-8B: Qwen3-8B's shapes; vLLM's ROCm build taken as its CUDA one (the newest release)",)),
    ("R48", "mistral-7b", "rtx-4090", None, dict(max_model_len=8192), fixed(256, 128, 300, max_concurrency=16),
     {"req/s": 6.44, "out tok/s": 644, "TTFT ms": 155}, False,
     ("release and max_model_len not stated: the newest and 8192 assumed",)),
    ("R49", "mistral-7b", "rtx-4090", None, dict(max_model_len=8192), fixed(256, 128, 300, max_concurrency=48),
     {"req/s": 11.87, "out tok/s": 1190, "TTFT ms": 667}, False,
     ("release and max_model_len not stated: the newest and 8192 assumed",)),
    ("R51", "llama-3.1-8b", "h100", None, dict(engine_version="0.21.0"), fixed(128, 128, 50, max_concurrency=1),
     {"median TPOT ms": 6.48}, False, ("lengths not stated ('chatbot-short'): 128 and 128 assumed",)),
    ("R56", "qwen3-14b", "h100", None, dict(engine="sglang", engine_version="0.5.5"), sharegpt(217.4, 201.6),
     {"req/s": 20.06, "out tok/s": 4043.89, "total tok/s": 8403.97, "TTFT ms": 9230.85, "TPOT ms": 235.33}, True, ()),
    ("R57", "qwen3-14b", "h100", FP8_BLOCK, dict(engine="sglang", engine_version="0.5.5"), sharegpt(217.4, 201.8),
     {"req/s": 24.87, "out tok/s": 5019.64, "total tok/s": 10426.27, "TTFT ms": 7320.60, "TPOT ms": 251.67}, True, ()),
    ("R58", "qwen3-8b", "h100", None, dict(engine="sglang", engine_version="0.5.3"),
     sharegpt(232.6, 220.6, 100, max_concurrency=4),
     {"req/s": 2.38, "out tok/s": 525.59, "total tok/s": 1079.74, "TTFT ms": 27.70, "TPOT ms": 7.19}, True, ()),
    ("R59", "deepseek-v3", "h200-141gb", None, dict(engine="sglang", engine_version="0.5.3", tensor_parallel=8),
     sharegpt(219.2, 200.8),
     {"req/s": 15.80, "out tok/s": 3172.46, "total tok/s": 6635.73, "TTFT ms": 6948.08, "TPOT ms": 420.18}, True,
     ("DeepSeek-R1-0528: DeepSeek-V3's architecture and fp8 block checkpoint",)),
    ("R60", "qwen3-235b-a22b", "h100", None, dict(engine="sglang", engine_version="0.5.5", tensor_parallel=8),
     sharegpt(217.6, 197.0),
     {"req/s": 18.50, "out tok/s": 3644.72, "total tok/s": 7671.31, "TTFT ms": 11715.28, "TPOT ms": 178.35}, True,
     ("984 of 1000 requests succeeded",)),
    ("R64", "deepseek-v3", "h200-141gb", None, dict(engine="sglang", engine_version="0.5.7", tensor_parallel=8),
     fixed(1024, 1024, 64, max_concurrency=8),
     {"out tok/s": 596.8, "TTFT ms": 330.6, "TPOT ms": 12.8}, False,
     ("prompt count not stated: 64 assumed (8 per user)",)),
    ("R65", "deepseek-v3", "h200-141gb", None, dict(engine="sglang", engine_version="0.5.7", tensor_parallel=8),
     fixed(1024, 1024, 512, max_concurrency=64),
     {"out tok/s": 1788.8, "TTFT ms": 423.1, "TPOT ms": 34.6}, False,
     ("prompt count not stated: 512 assumed (8 per user)",)),
]
MISSES = [
    ("R23-R28", "vLLM 0.6's multi-step scheduling (--num-scheduler-steps 10) is not modelled"),
    ("R32", "Llama-3.2-11B-Vision is not bundled"),
    ("R33", "weights offloaded to the CPU (--cpu-offload-gb 60 on a GH200): their transfer each step is not modelled"),
    ("R34", "Qwen3-VL-32B is not bundled"),
    ("R37", "pipeline parallel (3 stages of 8 L20s): its stages' schedule is not modelled, and the L20 is not in "
            "the catalog"),
    ("R38", "the MI355X is not in the catalog"),
    ("R40", "Ministral-3-8B is not bundled"),
    ("R47", "the A40 is not in the catalog"),
    ("R52", "concurrency 16 of unstated prompt lengths"),
    ("R61-R63", "SGLang before 0.4 (2024) is outside the releases memfit models"),
    ("R66", "tensor parallel over two nodes: the network's all-reduce is not modelled"),
    ("R67-R76", "TensorRT-LLM is not an engine memfit models"),
    ("R77-R78", "TGI's scheduler is not modelled"),
]


def run() -> list[dict]:
    records = []
    for id_, name, gpu_name, quant, settings, load, reported, full, notes in ROWS:
        model = served_model(find_config(name))
        if quant is not None:
            model = dataclasses.replace(model, quantization=quant)
        load = {"request_rate": INF, **load}
        try:
            estimate = estimate_serving(model, get_gpu(gpu_name), ServeSettings(**settings), Load(**load))
        except MemfitError as exc:
            records.append({"id": id_, "metric": "-", "reported": None, "predicted": None, "error": None,
                            "full": full, "notes": f"miss: {exc}"})
            continue
        speed = estimate.speed.to_json()
        for metric, value in reported.items():
            guess = speed[METRICS[metric]]
            records.append({"id": id_, "metric": metric, "reported": value, "predicted": guess,
                            "error": guess / value - 1, "full": full, "notes": "; ".join(notes)})
    for id_, why in MISSES:
        records.append({"id": id_, "metric": "-", "reported": None, "predicted": None, "error": None, "full": False,
                        "notes": f"miss: {why}"})
    return records


def headline_errors(records: list[dict], full_only: bool) -> dict[str, float]:
    errors: dict[str, float] = {}
    for metric in THROUGHPUT:
        for r in records:
            if r["metric"] == metric and r["id"] not in errors and (r["full"] or not full_only):
                errors[r["id"]] = abs(r["error"])
    return errors


def summary(records: list[dict]) -> dict:
    out = {}
    for name, full_only in (("full", True), ("all", False)):
        errors = headline_errors(records, full_only)
        out[name] = {"rows": len(errors), "mean": sum(errors.values()) / len(errors), "worst": max(errors.values())}
    for metric in ("TTFT ms", "TPOT ms"):
        errors = [abs(r["error"]) for r in records if r["metric"] == metric]
        out[metric] = {"rows": len(errors), "mean": sum(errors) / len(errors)}
    out["misses"] = sum(1 for r in records if r["metric"] == "-")
    return out


def table_of(records: list[dict], totals: dict) -> Table:
    full, every = totals["full"], totals["all"]
    title = (f"memfit's serving speed against published benchmark runs: throughput's mean |error| "
             f"{100 * full['mean']:.1f} %, worst {100 * full['worst']:.1f} % over the {full['rows']} rows "
             f"with every setting stated ({100 * every['mean']:.1f} % / {100 * every['worst']:.1f} % over "
             f"all {every['rows']}); TTFT {100 * totals['TTFT ms']['mean']:.0f} %, TPOT "
             f"{100 * totals['TPOT ms']['mean']:.0f} % mean |error|; {totals['misses']} misses")
    table = rows_table(title, records, label=lambda r: r["id"] + ("" if r["full"] else "*"),
                       show=lambda r, v: f"{v:,.2f}")
    table.caption = "* a row whose source leaves settings unstated (not in the target's rows)"
    return table


def main() -> int:
    records = run()
    totals = summary(records)
    write_results("published_serving_throughput", totals, records, table_of(records, totals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
