"""memfit's step-time model against published GPU speeds: every row of the calibration set (published_throughput.md,
copied from the shared data) typed in as memfit settings, the cost model's time beside the one the source implies.

    python benchmarks/published_throughput.py     # writes benchmarks/results/published_throughput.{txt,json}

Training rows compare the time of one optimizer step (the source's tokens per GPU per step over its tokens/s per
GPU); inference rows the time to generate (prompt, then every new token), from the source's generated tokens/s.
error = predicted / reported − 1, in time. The cost model times the step's counted kernels with its constants
(planner/cost.py: the matmul rate calibrated on the liger-mlp op benchmark, the rest assumed or published): nothing
here is fitted to these rows, and a row memfit cannot express yet (float8 linears, context parallel, 2-D meshes,
op-level kernels) is a miss with its reason. A compiled run is timed with `-t compile`'s cost over the eager step's
analytic estimate.
"""
from __future__ import annotations

import sys
from pathlib import Path

from published_gpu import GEN, TITAN8B, TITAN_NOTE, TT3B, TT_CHUNKED
from published_table import write_results
from rich.markup import escape
from rich.table import Table

from memfit.core.errors import MemfitError
from memfit.estimators import estimate
from memfit.planner.cost import timing
from memfit.specs.hardware import get_gpu
from memfit.specs.workload import Workload
from memfit.techniques.resolve import resolve

HERE = Path(__file__).parent
RESULTS = HERE / "results"
TT3B_TOKENS = 2 * 4096
CAPPED = "the source's A100s are power-capped at 330 W (about 1.7 TB/s measured); memfit's A100 is the data sheet's"
INT4 = "torchao's int4 weight-only (groups of 64) predicted as bitsandbytes NF4 (4-bit weights either way)"
MIXTRAL_INT8 = ("gpt-fast quantizes its own experts to int8, as int8-weight-only does transformers' (per expert "
                "and row, with torchao)")
SAC_COMPILE = "compile over selective-op checkpointing is refused by memfit: the eager step is timed"
TP_INFER = ("the source runs compiled with reduce-overhead (CUDA graphs) over a cube mesh; memfit's tensor-parallel "
            "all-reduces cost its NVLink bandwidth")


A100_64 = ("64 GPUs over 8 nodes: FSDP2's collectives run at the network's share per GPU (assumed 400 Gb/s) and hide "
           "behind the compute")


def train(id, step_s, gpu, workload=None, miss=None, notes=()):
    return {"id": id, "kind": "train", "reported_s": step_s, "gpu": gpu, "workload": workload, "miss": miss,
            "notes": list(notes)}


def generate(id, tokens_per_s, gpu, workload=None, miss=None, notes=()):
    """A generation row: the source's generated tokens per second; the time to generate them is what is compared."""
    new = (workload or {}).get("new_tokens", 200) * (workload or {}).get("batch_size", 1)
    return {"id": id, "kind": "generate", "reported_s": new / tokens_per_s, "reported_tokens_per_s": tokens_per_s,
            "gpu": gpu, "workload": workload, "miss": miss, "notes": list(notes)}


GRAPHS = "compile:mode=reduce-overhead"   # gpt-fast's mode; torchao's max-autotune replays CUDA graphs too
GEN200 = dict(GEN, seq_len=5, new_tokens=200)   # torchao's generate.py: "Hello, my name is", 200 new tokens
GEN200C = dict(GEN200, techniques=(GRAPHS,))    # ... compiled, as both sources run it
ROWS = [
    train("tt3b-packed", TT3B_TOKENS / 7075, "a100-80gb", TT3B),
    train("tt3b-compile", TT3B_TOKENS / 8998, "a100-80gb", dict(TT3B, techniques=("compile",))),
    train("tt3b-chunked", TT3B_TOKENS / 9174, "a100-80gb", dict(TT3B, techniques=("compile", TT_CHUNKED))),
    train("tt3b-ac", TT3B_TOKENS / 7210, "a100-80gb",
          dict(TT3B, techniques=("compile", TT_CHUNKED, "checkpointing"))),
    train("tt8b-4090", 2 * 2048 / 1650, "rtx-4090",
          dict(model="llama-3.1-8b", task="train", batch_size=2, seq_len=2048, precision="bf16",
               techniques=("paged-adamw8bit", "optimizer-in-backward", "checkpointing", TT_CHUNKED,
                           "compile")),
          notes=["tokens/s over one epoch: the first steps' compile time is in it"]),
    train("titan8b-8", 2 * 8192 / 5762, "h100-96gb", TITAN8B, notes=[TITAN_NOTE]),
    train("titan8b-8-compile", 2 * 8192 / 6667, "h100-96gb", TITAN8B, notes=[TITAN_NOTE, SAC_COMPILE]),
    train("titan-a100-8b", 8192 / 2973, "a100-80gb", dict(TITAN8B, batch_size=1, world_size=64),
          notes=[A100_64]),
    train("titan-a100-70b", 8192 / 331, "a100-80gb",
          dict(TITAN8B, model="llama-3.1-70b", batch_size=1, world_size=64, techniques=("fsdp2", "checkpointing")),
          notes=[A100_64]),
    train("ao-fp8-bf16", 8192 / 6150, "h100-sxm-80gb", dict(TITAN8B, batch_size=1), notes=[SAC_COMPILE]),
    train("titan8b-cp", 32768 / 3890, "h100-96gb", miss="context parallel and float8 linears are not modelled"),
    train("titan70b-2d", 16 * 8192 / 829, "h100-96gb",
          miss="float8 linears and all-gathers are not modelled (its 2-D mesh, FSDP 32 × TP 8, is)"),
    train("titan-h200", 2 * 8192 / 10938, "h200-141gb", miss="float8 linears and float8 all-gather are not modelled"),
    train("megatron-h100", None, "h100-sxm-80gb",
          miss="the source reports TFLOP/s only, for a 1.7B GPT not in memfit's catalog (no step time to compare)"),
    train("liger-mlp", 0.03629, "a100-80gb", miss="an op-level benchmark (one MLP forward): memfit times whole steps"),
    train("liger-head-ce", 0.11145, "a100-80gb", miss="an op-level benchmark: memfit times whole steps"),
    generate("gptfast-eager", 25.5, "a100-80gb", dict(GEN200, model="llama-2-7b"),
             notes=[CAPPED, "eager and bound by the host issuing kernels: the source's host took about 31 us "
                           "per kernel, memfit assumes 10 us"]),
    generate("ao-8b-a100-bf16", 95.64, "a100-80gb", GEN200C, notes=[CAPPED]),
    generate("ao-8b-a100-int8", 153.03, "a100-80gb", dict(GEN200, techniques=("int8-weight-only", GRAPHS)),
             notes=[CAPPED]),
    generate("ao-8b-a100-int4", 180.80, "a100-80gb", dict(GEN200, techniques=("bnb-4bit", GRAPHS)),
             notes=[CAPPED, INT4]),
    generate("ao-8b-h100-bf16", 126.90, "h100-sxm-80gb", GEN200C),
    generate("ao-8b-h100-int8", 198.85, "h100-sxm-80gb", dict(GEN200, techniques=("int8-weight-only", GRAPHS))),
    generate("ao-8b-h100-int4", 241.39, "h100-sxm-80gb", dict(GEN200, techniques=("bnb-4bit", GRAPHS)),
             notes=[INT4]),
    *(generate(f"gptfast-tp{n}", speed, "a100-80gb",
               dict(GEN200, model="llama-2-70b", world_size=n, techniques=("tensor-parallel", GRAPHS)),
               notes=[CAPPED, TP_INFER])
      for n, speed in ((2, 21.32), (4, 38.01), (8, 62.50))),
    generate("gptfast-mixtral-int8", 97.92, "a100-80gb", dict(GEN200, model="mixtral-8x7b",
                                                              techniques=("int8-weight-only", GRAPHS)),
             notes=[CAPPED, "the source reads only the two routed experts' weights per token", MIXTRAL_INT8]),
    generate("gptfast-mixtral-tp8", 227.82, "a100-80gb",
             dict(GEN200, model="mixtral-8x7b", world_size=8, techniques=("tensor-parallel", GRAPHS)),
             notes=[CAPPED, TP_INFER, "the source reads only the two routed experts' weights per token"]),
    generate("bloom-accelerate", 1 / 0.23038, "a100-80gb",
             miss="BLOOM-176B is not in memfit's catalog, and accelerate's device_map over 8 GPUs (one busy at a "
                  "time) is not a memfit layout"),
]


def predict(spec: dict) -> dict:
    """The cost model's time for the row's configuration: a compiled run's over the eager step's estimate."""
    gpu, fields = get_gpu(spec["gpu"]), spec["workload"]
    eager = Workload(**{**fields, "techniques": tuple(t for t in fields.get("techniques", ())
                                                      if not t.startswith("compile"))})
    memory = estimate(eager, method="analytic", gpu=gpu)
    timed = timing(resolve(Workload(**fields)), memory, gpu)
    return {"predicted_s": timed["step_time_s"], "time_parts_s": timed["time_parts_s"],
            "time_source": timed["time_source"]}


def run() -> list[dict]:
    out = []
    for spec in ROWS:
        record = {k: spec[k] for k in ("id", "kind", "gpu", "reported_s", "notes")}
        record.update(predicted_s=None, error=None, unit="s per step" if spec["kind"] == "train" else
                      "s per generation")
        if spec["miss"]:
            record["notes"] = ["miss: " + spec["miss"], *record["notes"]]
        else:
            try:
                record.update(predict(spec))
                record["error"] = round(record["predicted_s"] / spec["reported_s"] - 1, 4)
            except MemfitError as exc:
                record["notes"] = [f"miss: memfit refused it: {exc}", *record["notes"]]
            record["workload"] = {k: Path(v).parent.name if isinstance(v, str) and v.endswith("config.json") else v
                                  for k, v in spec["workload"].items()}
        print(f"{record['id']}: {record['error']}", file=sys.stderr)
        out.append(record)
    return out


def summary(records: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in records if r["error"] is not None]
    return {"rows": len(records), "reproduced": len(errors), "missed": len(records) - len(errors),
            "mean_abs_error": round(sum(errors) / len(errors), 4) if errors else None,
            "worst_abs_error": max(errors, default=None), "within_15_percent": sum(e <= 0.15 for e in errors)}


def seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f} s" if value < 100 else f"{value:.0f} s"


def table_of(records: list[dict], totals: dict) -> Table:
    table = Table(title="memfit's step-time model against published GPU speeds (the step's kernels counted; constants "
                        "in planner/cost.py, none fitted to these rows; error = predicted / reported − 1, in time)",
                  title_justify="left")
    for column in ("row", "GPU", "unit", "reported", "memfit", "error", "notes"):
        table.add_column(column, justify="left" if column in ("row", "GPU", "unit", "notes") else "right")
    for r in records:
        table.add_row(r["id"], r["gpu"], r["unit"], seconds(r["reported_s"]), seconds(r["predicted_s"]),
                      f"{r['error']:+.1%}" if r["error"] is not None else "miss", escape("; ".join(r["notes"])))
    table.caption = (f"{totals['reproduced']} of {totals['rows']} rows timed; mean |error| "
                     f"{totals['mean_abs_error']:.1%}, worst {totals['worst_abs_error']:.1%}; "
                     f"{totals['within_15_percent']} within 15 %; {totals['missed']} misses")
    return table


def main() -> int:
    records = run()
    totals = summary(records)
    write_results("published_throughput", totals, records, table_of(records, totals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
