"""memfit against published GPU runs: every row of the calibration set (published_gpu.md, copied from the shared
data) typed in as memfit settings, the estimate beside the figure its source reports.

    python benchmarks/published_gpu.py            # writes benchmarks/results/published_gpu.{txt,json}

A row memfit cannot reproduce yet is a miss with its reason. A row reproduced with a known gap says so in its
notes. The metric is the one the source reports: `alloc` compares the tensor peak (max_memory_allocated),
`reserved` the simulated allocator's reserved bytes. A run made with torch.compile is traced with `-t compile`
(the analytic estimate of its eager step beside it); one whose source runs its own program rather than a model's
training or generation step (gpt-fast's generate loop, Liger-Kernel's op benchmarks) is traced with `--step` over
that program, rewritten for memfit in published_configs/. The rest use the analytic estimate. Nothing here is
fitted to these rows.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from published_table import write_results  # the JSON, the table's text, the docs that show it
from rich.markup import escape
from rich.table import Table

from memfit.core.errors import MemfitError
from memfit.core.units import GiB, MiB, format_bytes
from memfit.estimators import estimate
from memfit.specs.hardware import get_gpu
from memfit.specs.workload import Workload

HERE = Path(__file__).parent
CONFIGS = HERE / "published_configs"
RESULTS = HERE / "results"
GB = 10**9
COMPILED = "traced with -t compile (modelled: Inductor's partitioner under fake tensors)"
COMPILE_UNDER_SAC = ("torch.compile over selective-op checkpointing is not modelled (memfit refuses the pair): the "
                     "eager step is predicted")
LLAMA_3B = str(CONFIGS / "llama-3.2-3b" / "config.json")
VIT_H = str(CONFIGS / "vit-huge-patch14-45" / "config.json")
VIT_L = str(CONFIGS / "vit-large-patch16-224" / "config.json")
ALL_LINEARS = "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"
TUNE_LINEARS = "q_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"   # torchtune: q, v, output proj + MLP
# torchtune's AdamW is fused: its configs set `fused: True` wherever they name torch.optim.AdamW, and the table's
# baseline (25.5 GiB, short unpacked sequences) is under the 29.9 GiB that weights, gradients and states take with
# foreach's parameter-sized temporary alone
TT3B = dict(model=LLAMA_3B, task="train", batch_size=2, seq_len=4096, precision="bf16", optimizer_impl="fused")
TT_FUSED = "AdamW fused, as torchtune's configs set it (foreach's temporary alone would exceed its 25.5 GiB baseline)"
# torchtune's CEWithChunkedOutputLoss: the model's head over 8 slices, every slice's bf16 logits kept, the float32
# upcast + cross-entropy compiled per slice
TT_CHUNKED = "chunked-ce:chunks=8,mode=upcast"
TT3B_LORA_TECHNIQUES = (TT_CHUNKED, "checkpointing:mode=offload")
TT_ADAPTERS = "adapter_dtype=model"   # torchtune's LoRA matrices in the model's bf16 (peft's default upcasts them)
VIT_H_RUN = dict(model=VIT_H, task="train", batch_size=8, seq_len=224, precision="bf16-mixed")
# torchtitan's Llama-3.1-8B pre-training: FSDP2 over 8 GPUs with MixedPrecisionPolicy (bf16 params, fp32 reduce),
# torchtitan's op-level selective checkpointing, fp32 AdamW states
TITAN8B = dict(model="llama-3.1-8b", task="train", batch_size=2, seq_len=8192, precision="bf16-mixed", world_size=8,
               techniques=("fsdp2", "checkpointing:mode=selective-op"))
TITAN_NOTE = "torchtitan's own Llama predicted as Hugging Face's (same shapes)"
GEN = dict(model="llama-3.1-8b", task="inference", batch_size=1, seq_len=6, new_tokens=100, precision="bf16")
GPT_FAST = ("the generation program itself (published_configs/gpt_fast.py: torchao's gpt-fast model and generate "
            "loop, as far as memory goes) traced with --step; prompt of 6 tokens, 100 new")
GENERATE = ("generate.py compiles its decode step with mode=reduce-overhead: the CUDA graph capture in the warm-up "
            "run empties the cache before the measured run (-t compile:mode=reduce-overhead)")
LIGER = "the benchmark's own step (published_configs/liger_ops.py) traced with --step"


def gpt_fast(step: str) -> dict:
    program = CONFIGS / "gpt_fast.py"
    return dict(model=f"{program}:llama_3_1_8b", inputs=f"{program}:prompt", step=f"{program}:{step}",
                task="inference", batch_size=1, seq_len=6, precision="bf16")


def liger(model: str, inputs: str, **shape) -> dict:
    program = CONFIGS / "liger_ops.py"
    return dict(model=f"{program}:{model}", inputs=f"{program}:{inputs}", step=f"{program}:forward_backward",
                task="inference", **shape)


def row(id, reported, unit, metric, gpu, workload=None, miss=None, notes=(), compiled: bool | str = False):
    """`compiled`: the published run used torch.compile (True, or its mode); memfit predicts it with -t compile
    (traced)."""
    return {"id": id, "reported_bytes": int(reported * unit), "metric": metric, "gpu": gpu, "workload": workload,
            "miss": miss, "notes": list(notes), "compiled": compiled}


ROWS = [
    row("tt3b-compile", 51.0, GiB, "alloc", "a100-80gb", TT3B, compiled=True, notes=[TT_FUSED]),
    row("tt3b-chunked", 42.9, GiB, "alloc", "a100-80gb", dict(TT3B, techniques=(TT_CHUNKED,)),
        compiled=True, notes=[TT_FUSED]),
    row("tt3b-ac", 24.9, GiB, "alloc", "a100-80gb",
        dict(TT3B, techniques=(TT_CHUNKED, "checkpointing")), compiled=True, notes=[TT_FUSED]),
    row("tt3b-optbwd", 23.1, GiB, "alloc", "a100-80gb",
        dict(TT3B, techniques=(TT_CHUNKED, "checkpointing", "optimizer-in-backward")), compiled=True,
        notes=[TT_FUSED]),
    row("tt3b-actoffload", 21.8, GiB, "alloc", "a100-80gb",
        dict(TT3B, techniques=(TT_CHUNKED, "checkpointing:mode=offload", "optimizer-in-backward")),
        compiled=True, notes=[TT_FUSED, "AC + activation offloading run as checkpointing:mode=offload (saved tensors "
                                        "to host)"]),
    row("tt3b-8bit", 17.6, GiB, "alloc", "a100-80gb",
        dict(TT3B, optimizer_impl=None, techniques=(TT_CHUNKED, "checkpointing:mode=offload",
                                                    "optimizer-in-backward", "adamw8bit")),
        compiled=True, notes=["AC + activation offloading run as checkpointing:mode=offload",
               "8-bit AdamW states in the allocator (bitsandbytes AdamW8bit): the README names the optimizer "
               "`AdamW8bit`, and the config's paged PagedAdamW8bit would leave about 10 GiB (the row before, 21.8 "
               "GiB, less 12 GiB of bf16 states), not 17.6"]),
    row("tt3b-lora", 8.5, GiB, "alloc", "a100-80gb",
        dict(TT3B, techniques=(f"lora:rank=64,alpha=128,targets={TUNE_LINEARS},{TT_ADAPTERS}", *TT3B_LORA_TECHNIQUES)),
        compiled=True, notes=["AC + activation offloading run as checkpointing:mode=offload"]),
    row("tt3b-qlora", 4.6, GiB, "alloc", "a100-80gb",
        dict(TT3B, techniques=(f"qlora:rank=64,alpha=128,targets={TUNE_LINEARS},{TT_ADAPTERS}", *TT3B_LORA_TECHNIQUES)),
        compiled=True, notes=["AC + activation offloading run as checkpointing:mode=offload"]),
    row("tt8b-4090-full", 18.9, GiB, "alloc", "rtx-4090",
        dict(model="llama-3.1-8b", task="train", batch_size=2, seq_len=2048, precision="bf16",
             techniques=("paged-adamw8bit", "optimizer-in-backward", "checkpointing", TT_CHUNKED)),
        compiled=True),
    row("tt8b-4090-qlora", 7.4, GiB, "alloc", "rtx-4090",
        dict(model="llama-3.1-8b", task="train", batch_size=2, seq_len=2048, precision="bf16", optimizer_impl="fused",
             techniques=(f"qlora:rank=8,alpha=16,targets={ALL_LINEARS},{TT_ADAPTERS}", "checkpointing",
                         TT_CHUNKED)),
        compiled=True),
    row("titan8b-fsdp8", 82.4, GiB, "reserved", "h100-96gb", TITAN8B, notes=[TITAN_NOTE]),
    row("titan8b-fsdp8-compile", 77.0, GiB, "reserved", "h100-96gb", TITAN8B, compiled=True, notes=[TITAN_NOTE]),
    row("ao8b-fsdp8", 47.65, GiB, "reserved", "h100-sxm-80gb", dict(TITAN8B, batch_size=1),
        compiled=True, notes=[TITAN_NOTE]),
    row("ao-vith-fused", 12.23, GB, "alloc", "rtx-4090", dict(VIT_H_RUN, optimizer_impl="fused"),
        compiled=True,
        notes=["RTX 4070 Ti SUPER predicted as an RTX 4090 (same kernels; the metric is the tensor peak)"]),
    row("ao-vith-8bit", 8.32, GB, "alloc", "rtx-4090", dict(VIT_H_RUN, techniques=("adamw8bit",)),
        compiled=True, notes=["RTX 4070 Ti SUPER predicted as an RTX 4090"]),
    row("ao-vith-4bit", 7.72, GB, "alloc", "rtx-4090", dict(VIT_H_RUN, techniques=("adamw4bit",)),
        compiled=True, notes=["RTX 4070 Ti SUPER predicted as an RTX 4090"]),
    row("tut-vitl", 6.0, GB, "alloc", "a100-80gb",
        dict(model=VIT_L, task="train", batch_size=1, seq_len=224, optimizer="adam", optimizer_impl="foreach"),
        notes=["the tutorial's figure is approximate (≈6 GB, read off a memory snapshot); its loss is out.sum()"]),
    row("tut-vitl-optbwd", 4.0, GB, "alloc", "a100-80gb",
        dict(model=VIT_L, task="train", batch_size=1, seq_len=224, optimizer="adam", optimizer_impl="foreach",
             techniques=("optimizer-in-backward",)),
        notes=["the tutorial's second figure (≈4 GB, approximate)"]),
    row("ao-llama3-8b-gen", 16.43, GB, "reserved", "a100-80gb", GEN, compiled="reduce-overhead",
        notes=["Meta-Llama-3-8B as llama-3.1-8b (same shapes); HF's growing KV cache for gpt-fast's "
               "static cache of prompt + 100 tokens", GENERATE]),
    row("ao-llama3-8b-int4", 6.88, GB, "reserved", "a100-80gb",
        dict(GEN, techniques=("int4-weight-only:group_size=64",)), compiled="reduce-overhead",
        notes=["torchao's int4 weight-only (tinygemm layout, groups of 64, the LM head included), quantized on the "
               "GPU after the bf16 model was loaded there, as generate.py does", GENERATE]),
    row("ao-kv-8k", 17.86, GB, "reserved", "a100-80gb", gpt_fast("generate_cache_8192"), notes=[GPT_FAST]),
    row("ao-kv-32k", 23.83, GB, "reserved", "a100-80gb", gpt_fast("generate_cache_32768"), notes=[GPT_FAST]),
    row("ao-kv-131k", 59.27, GB, "reserved", "a100-80gb", gpt_fast("generate_cache_131072"), notes=[GPT_FAST]),
    row("ao-kv-131k-linmask", 34.18, GB, "reserved", "a100-80gb",
        gpt_fast("generate_cache_131072_int8_linear_mask"), notes=[GPT_FAST]),
    row("liger-ce", 40960.1, MiB, "alloc", "a100-80gb",
        liger("cross_entropy", "logits", batch_size=8, seq_len=2048, precision="fp32"), notes=[LIGER]),
    row("liger-flce", 27582.5, MiB, "alloc", "a100-80gb",
        liger("lm_heads", "hidden_states", batch_size=1, seq_len=32768, precision="bf16"), notes=[LIGER]),
]


def predict(spec: dict) -> dict:
    """The estimate of the run as published: its own program traced (--step), a compiled run traced with -t compile
    (beside it the eager step's analytic estimate), anything else analytic."""
    gpu, fields = get_gpu(spec["gpu"]), spec["workload"]
    workload = Workload(**fields)
    started = time.perf_counter()
    found = {}
    if compile_modelled(spec):
        found["eager_bytes"] = metric_of(spec, estimate(workload, method="analytic", gpu=gpu))
        compile = "compile" if spec["compiled"] is True else f"compile:mode={spec['compiled']}"
        workload = Workload(**{**fields, "techniques": (*workload.techniques, compile)})
    method = "traced" if workload.step or any(t.startswith("compile") for t in workload.techniques) else "analytic"
    result = estimate(workload, method=method, gpu=gpu)
    return {**found, "predicted_bytes": metric_of(spec, result), "seconds": round(time.perf_counter() - started, 2),
            "method": result.method}


def compile_modelled(spec: dict) -> bool:
    """A compiled run memfit can trace compiled: not under selective checkpointing (memfit refuses that pair)."""
    techniques = spec["workload"].get("techniques", ())
    return spec["compiled"] and not any(t.startswith("checkpointing:mode=selective") for t in techniques)


def metric_of(spec: dict, result) -> int:
    """max_memory_allocated (the tensors and cuBLAS's workspaces) or max_memory_reserved, as predicted."""
    return result.allocator["allocated_bytes"] if spec["metric"] == "alloc" else result.reserved_bytes


def run() -> list[dict]:
    out = []
    for spec in ROWS:
        record = {"id": spec["id"], "metric": spec["metric"], "gpu": spec["gpu"],
                  "reported_bytes": spec["reported_bytes"], "predicted_bytes": None, "error": None,
                  "notes": list(spec["notes"])}
        if spec["compiled"]:
            record["notes"].insert(0, COMPILED if compile_modelled(spec) else COMPILE_UNDER_SAC)
        if spec["miss"]:
            record["notes"].insert(0, "miss: " + spec["miss"])
        else:
            try:
                record.update(predict(spec))
                record["error"] = round(record["predicted_bytes"] / spec["reported_bytes"] - 1, 4)
            except MemfitError as exc:
                record["notes"].insert(0, f"miss: memfit refused it: {exc}")
            record["workload"] = {k: shown(v) for k, v in spec["workload"].items()}
        print(f"{record['id']}: {record['error']}", file=sys.stderr)
        out.append(record)
    return out


def shown(value):
    """A workload field as the results show it: a file of this folder by its path from here, a config by its folder."""
    if not isinstance(value, str) or str(HERE) not in value:
        return value
    path = Path(value.partition(":")[0])
    if path.name == "config.json":
        return path.parent.name
    return value.replace(str(CONFIGS), CONFIGS.name)


def summary(records: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in records if r["error"] is not None]
    return {"rows": len(records), "reproduced": len(errors), "missed": len(records) - len(errors),
            "mean_abs_error": round(sum(errors) / len(errors), 4) if errors else None,
            "worst_abs_error": max(errors, default=None)}


def table_of(records: list[dict], totals: dict) -> Table:
    table = Table(title="memfit against published GPU runs (analytic estimate; traced with -t compile for a compiled "
                        "run, with --step for a program's own step; error = predicted / reported − 1; eager: the "
                        "analytic estimate of a compiled run's step without compile)",
                  title_justify="left")
    for column in ("row", "metric", "reported", "memfit", "error", "eager", "notes"):
        table.add_column(column, justify="left" if column in ("row", "metric", "notes") else "right")
    for r in records:
        table.add_row(r["id"], r["metric"], format_bytes(r["reported_bytes"]), bytes_or_dash(r["predicted_bytes"]),
                      f"{r['error']:+.1%}" if r["error"] is not None else "miss", bytes_or_dash(r.get("eager_bytes")),
                      escape("; ".join(r["notes"])))
    table.caption = (f"{totals['reproduced']} of {totals['rows']} rows reproduced; mean |error| "
                     f"{totals['mean_abs_error']:.1%}, worst {totals['worst_abs_error']:.1%}; "
                     f"{totals['missed']} misses")
    return table


def bytes_or_dash(value: int | None) -> str:
    return format_bytes(value) if value is not None else "—"


def main() -> int:
    records = run()
    totals = summary(records)
    write_results("published_gpu", totals, records, table_of(records, totals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
