"""memfit's llama.cpp buffers against published load logs: every row of the calibration set (published_llamacpp.md,
copied from the shared data) typed in as llama.cpp's settings, memfit's figure beside the logged one (MiB).

    python benchmarks/published_llamacpp.py     # writes benchmarks/results/published_llamacpp.{txt,json}

Rows {id, metric, reported, predicted, error, notes}; error = predicted / reported - 1. The GGUF is the one llama.cpp's
converter and quantizer write for the row's model and file type (memfit's recipe); the release is the row's build
date (Ollama's: the llama.cpp it vendored, where its log shows which). A row memfit cannot express (a model it has no
config or recipe for, sliding-window or mixture-of-experts models it does not replay) is a miss with its reason.
Ollama's own estimate (its log's memory.* fields, which chose num_gpu: serving/ollama.py) is compared field by field
as its log prints it (0.1 GiB or MiB). The summary: mean and worst |error| of the weights and KV rows (target: mean
<= 0.5 %) and of the compute-buffer rows (target: mean <= 10 %).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from memfit.core.errors import MemfitError
from memfit.serving.gguf_recipe import from_config, quantize
from memfit.serving.llamacpp import LlamaCppSettings, estimate_llamacpp
from memfit.serving.ollama import OllamaGPU, schedule_ollama
from memfit.serving.ollama_layout import layout_ollama
from memfit.serving.ollama_releases import OllamaRelease
from memfit.specs.model_configs import find_config

sys.path.insert(0, str(Path(__file__).parent))
from published_table import rows_table, write_results

MiB = 1 << 20
OLLAMA_OUTPUT = "Ollama's runner asks for embeddings too: its output buffer holds n_embd floats a slot as well"
OPEN_LLAMA = "open-llama 7B v2 has LLaMA-7B's shapes: llama-2-7b's config"

# id, model, file type, settings, config changes, {metric: logged MiB}, notes
ROWS = [
    ("R01", "llama-3.1-8b", "Q4_K_M", dict(ctx_size=8192, parallel=4, n_batch=512, flash_attn="off",
                                          engine_version="2024-12", embeddings=True), {},
     {"gpu_model": 4403.49, "cpu_model": 281.81, "kv": 1024.00, "gpu_compute": 560.00, "host_compute": 24.01,
      "output": 2.02}, ("Ollama 0.5.4: 4 slots x 2048, one unified cache", OLLAMA_OUTPUT)),
    ("R02", "llama-3.1-8b", "Q4_0", dict(ctx_size=8192, parallel=4, n_batch=512, flash_attn="off",
                                        engine_version="2024-08-30", embeddings=True), {},
     {"gpu_model": 4156.00, "cpu_model": 281.81, "kv": 1024.00, "gpu_compute": 560.00, "host_compute": 24.01,
      "output": 2.02}, ("Ollama ~0.3.8 (llama.cpp 1e6f655)", OLLAMA_OUTPUT)),
    ("R03", "llama-3.1-8b", "Q4_K_M", dict(ctx_size=8192, parallel=4, n_batch=512, flash_attn="off",
                                          engine_version="2025-06", embeddings=True), {},
     {"gpu_model": 4403.49, "cpu_model": 281.81, "kv": 1024.00, "gpu_compute": 560.00, "host_compute": 24.01,
      "output": 2.02}, ("DeepSeek-R1-Distill-Llama-8B: Llama-3.1-8B's shapes", OLLAMA_OUTPUT)),
    ("R06", "llama-2-7b", "F16", dict(ctx_size=2048, n_batch=512, flash_attn="off", engine_version="2024-03-18"),
     {"rope_scaling": None},
     {"gpu_model": 12603.02, "cpu_model": 250.00, "kv": 1024.00, "gpu_compute": 164.00, "host_compute": 12.00,
      "output": 62.50}, (OPEN_LLAMA, "b2459: the output buffer holds n_batch rows")),
    ("R07", "llama-2-7b", "Q8_0", dict(ctx_size=512, n_batch=512, flash_attn="off", engine_version="2024-03-18"),
     {"rope_scaling": None},
     {"gpu_model": 6695.84, "cpu_model": 132.81, "kv": 256.00, "gpu_compute": 70.50, "host_compute": 9.00,
      "output": 62.50}, (OPEN_LLAMA,)),
    ("R10", "mistral-7b", "Q4_K_M", dict(ctx_size=1024, n_batch=1024, n_ubatch=1024, flash_attn="off",
                                        engine_version="2025-02"), {},
     {"gpu_model": 4095.05, "cpu_model": 70.31, "kv": 128.00, "gpu_compute": 164.01, "host_compute": 20.01,
      "output": 0.12}, ("ipex-llm's llama.cpp fork on SYCL (release date assumed)",)),
    ("R11", "qwen2.5-7b", "Q4_K_M", dict(ctx_size=4096, flash_attn="on", engine_version="2025-12", embeddings=True),
     {}, {"gpu_model": 4168.09, "cpu_model": 292.36, "kv": 224.00, "gpu_compute": 304.00, "host_compute": 15.01,
          "output": 0.59},
     ("Ollama 2026-05: the llama.cpp it vendors predates PR 18898 (its host buffer has no embeddings input; "
      "2025-12 assumed)", OLLAMA_OUTPUT)),
    ("R13", "qwen2.5-7b", "Q4_K_M", dict(ctx_size=4096, engine_version="2026-09"), {},
     {"gpu_model": 4168.09, "cpu_model": 292.36, "kv": 224.00, "gpu_compute": 304.00},
     ("Vulkan; --fit kept every layer",)),
    ("R14", "qwen2.5-7b", "Q4_K_M", dict(ctx_size=8192, n_gpu_layers=27, engine_version="2026-09"), {},
     {"gpu_model": 3883.68, "cpu_model": 576.77, "gpu_kv": 416.00, "cpu_kv": 32.00, "gpu_compute": 304.00},
     ("--fit moved 2 layers to the CPU (memfit's fit replays it: tests/test_llamacpp_fit.py; -ngl 27 given here); "
      "the GPU's part of the split graph",)),
    ("R15", "qwen2.5-7b", "Q4_K_M", dict(ctx_size=8192, flash_attn="on", cache_type_k="q8_0", cache_type_v="q8_0"),
     {}, {"kv": 238.0}, ("the KV the author derived from nvidia-smi (q8_0, 8192, one slot)",)),
    ("R16", "qwen2.5-7b", "Q4_K_M", dict(ctx_size=8192, flash_attn="on", cache_type_k="q4_0", cache_type_v="q4_0"),
     {}, {"kv": 126.0}, ("as R15 with q4_0",)),
    ("R22", "qwen2.5-32b", "Q4_K_M", dict(ctx_size=8192, gpus=4), {},
     {"gpu0_model": 4844.72, "gpu1_model": 4366.53, "gpu2_model": 4366.53, "gpu3_model": 4930.57,
      "cpu_model": 417.66},
     ("DeepSeek-R1-Distill-Qwen-32B: Qwen2.5-32B's shapes; 4 GPUs (the layers split equally: free memory assumed "
      "equal)",)),
    ("R23", "qwen2.5-32b", "Q4_K_M", dict(ctx_size=4096), {}, {"gpu_model": 18508.35},
     ("ROCm; the fit's projection and the OOM at the compute reservation are not compared",)),
    ("R24", "llama-3.1-70b", "Q4_0", dict(ctx_size=4096, n_batch=2048, gpus=2, flash_attn="off", pipeline=False,
                                          engine_version="2025-08-20"), {},
     {"gpu0_model": 18821.56, "gpu1_model": 18725.42, "cpu_model": 563.62, "gpu0_kv": 656.00, "gpu1_kv": 624.00,
      "gpu0_compute": 588.01, "gpu1_compute": 588.01, "host_compute": 28.01},
     ("2 RPC workers (b6209), split as two GPUs (equally); their RPC servers had no events then: no pipeline",)),
    ("R25", "llama-3.1-70b", "Q4_K_S", dict(ctx_size=8192, gpus=2, flash_attn="off", pipeline=False,
                                           engine_version="2024-11"),
     {"vocab_size": 128262},
     {"gpu0_model": 19142.56, "gpu1_model": 18764.46, "cpu_model": 563.65, "gpu0_compute": 1104.00,
      "gpu1_compute": 1104.00, "host_compute": 32.01},
     ("Reflection-Llama-3.1-70B: Llama-3.1-70B with 6 more tokens (vocab 128262); the RPC worker first, then CUDA0 "
      "(llama.cpp puts RPC devices at the front of its list), split as two GPUs; equal compute buffers: no pipeline "
      "(its RPC server had no events then); late 2024: the release assumed 2024-11",)),
    ("R37", "gpt-oss-20b", "MXFP4_MOE", dict(ctx_size=131072, n_batch=2048, n_ubatch=2048, flash_attn="on"), {},
     {"kv": 3126.00, "gpu_compute": 1672.08},
     ("Apple M5 (Metal: its host buffer, 1064.59 MiB, is not llama.cpp's CUDA one and is not compared)",)),
    ("R38", "gpt-oss-120b", "Q8_0", dict(ctx_size=65535, parallel=4, kv_unified=True), {}, {"kv": 2340.00},
     ("4 slots in one cache: the window cache holds 4 x 128 + 512 cells, padded to 1024",)),
    ("R43", "gemma-2-9b", "Q4_K_M", dict(ctx_size=8192, flash_attn="off", engine_version="2024-09"), {},
     {"kv": 2688.00, "gpu_compute": 507.00, "host_compute": 39.01, "output": 0.98},
     ("SYCL, b3805 (2024-09): before the window layers' own cache, every layer holds the whole context; the file "
      "type is not stated (its weights are not compared)",)),
    ("R45", "gpt-oss-20b", "MXFP4_MOE", dict(ctx_size=131072, n_gpu_layers=0, flash_attn="on"), {},
     {"cpu_model": 11536.18}, ("LM Studio 0.3.23: every layer on the CPU (0/25), the whole file mapped",)),
    ("R32", "mistral-small-24b", "Q8_0", dict(ctx_size=4096), {}, {"cpu_model": 680.0},
     ("Ollama's mistral3 file also holds the vision encoder; its GPUs' weights: the layout row below",)),
    ("R35", "llama-2-7b", "Q4_0", dict(ctx_size=8192, parallel=2, n_batch=1024, flash_attn="off",
                                      engine_version="2025-07", embeddings=True), {"rope_scaling": None},
     {"gpu_model": 3577.57, "cpu_model": 70.31, "kv": 4096.00, "gpu_compute": 560.00, "host_compute": 24.01,
      "output": 0.28},
     ("Ollama ~0.11 on Metal (its mapped buffer is page-aligned; vendored llama.cpp before set_rows, 2025-07 "
      "assumed)", OLLAMA_OUTPUT)),
]
MISSES = [
    ("R08", "Command-R 35B: no config bundled, and offline"),
    ("R09", "Qwen2.5-14B: no config bundled, and offline"),
    ("R17", "Gemma 4 (sliding-window layers): not modelled"), ("R18", "Gemma 4: not modelled"),
    ("R19", "Gemma 4: not modelled"), ("R20", "Gemma 4: not modelled"),
    ("R28", "Mixtral of March 2024: its converter's F16 router and -ngl's rule then (N repeating layers, the head on "
            "the CPU) are not release rules memfit has (their dates unknown); with both, its GPU and file figures to "
            "the hundredth (tests/test_llamacpp.py)"),
    ("R29", "Mixtral in an imatrix type of January 2024 not named (62030 MiB), -ngl's rule then: not expressible"),
    ("R30", "DeepSeek-V3 (MLA, experts): not modelled"),
    ("R34", "Phi-3 (phi3 architecture): no recipe"),

    ("R39", "Qwen3-Coder-Next (hybrid, experts): not modelled"), ("R40", "Qwen3-Coder-Next: not modelled"),
    ("R41", "Qwen3-Coder-Next: not modelled"), ("R42", "Gemma 4: not modelled"),
    ("R44", "Qwen2-14B distill: no config bundled"),
    ("R46", "Qwen3.6 MoE with MTP: not modelled"),
    ("R47", "Qwen3.5 MoE: not modelled"),
]
# Ollama's own estimate (its log's "offload to cuda" line): id, model, file type, config changes, release (or the
# date it was built), each GPU's free GiB, num_ctx (None: the release's default), {field: as logged}, notes. The
# slots are left to Ollama's scheduler (none of these logs set OLLAMA_NUM_PARALLEL, as far as they show).
OLLAMA_ROWS = [
    ("R01", "llama-3.1-8b", "Q4_K_M", {}, "0.5.4", [23.3], None,
     {"layers.offload": "33", "memory.required.full": "6.5 GiB", "memory.required.partial": "6.5 GiB",
      "memory.required.kv": "1.0 GiB", "memory.required.allocations": "[6.5 GiB]",
      "memory.weights.total": "4.9 GiB", "memory.weights.repeating": "4.5 GiB",
      "memory.weights.nonrepeating": "411.0 MiB", "memory.graph.full": "560.0 MiB",
      "memory.graph.partial": "677.5 MiB"}, ("the LoRA adapter is outside Ollama's estimate",)),
    ("R02", "llama-3.1-8b", "Q4_0", {}, "0.3.8", [14.6], None,
     {"layers.offload": "33", "memory.required.full": "6.2 GiB", "memory.required.partial": "6.2 GiB",
      "memory.required.kv": "1.0 GiB", "memory.required.allocations": "[6.2 GiB]",
      "memory.weights.total": "4.7 GiB", "memory.weights.repeating": "4.3 GiB",
      "memory.weights.nonrepeating": "411.0 MiB", "memory.graph.full": "560.0 MiB",
      "memory.graph.partial": "677.5 MiB"}, ()),
    ("R26", "llama-3.3-70b", "Q8_0", {}, "2025-02-18", [22.0] * 4, 64000,
     {"layers.offload": "44", "layers.split": "11,11,11,11", "memory.required.full": "127.4 GiB",
      "memory.required.partial": "87.1 GiB", "memory.required.kv": "19.5 GiB",
      "memory.required.allocations": "[21.8 GiB 21.8 GiB 21.8 GiB 21.8 GiB]", "memory.weights.total": "87.3 GiB",
      "memory.weights.repeating": "86.2 GiB", "memory.weights.nonrepeating": "1.0 GiB",
      "memory.graph.full": "8.2 GiB", "memory.graph.partial": "8.2 GiB"},
     ("an 80-layer Llama-3.x-70B in Q8_0 (the issue names no file; 3.1 and 3.3 share the shapes)",)),
    ("R27", "llama-3.2-3b", "Q4_K_M", {}, "2024-12-15", [78.6], None,
     {"layers.offload": "29", "memory.required.full": "3.7 GiB", "memory.required.partial": "3.7 GiB",
      "memory.required.kv": "896.0 MiB", "memory.required.allocations": "[3.7 GiB]",
      "memory.weights.total": "2.4 GiB", "memory.weights.repeating": "2.1 GiB",
      "memory.weights.nonrepeating": "308.2 MiB", "memory.graph.full": "424.0 MiB",
      "memory.graph.partial": "570.7 MiB"}, ()),
    ("R31", "gemma-3-12b", "Q4_K_M", {"vocab_size": 262144}, "2025-08-22", [11.1], 8192,
     {"layers.offload": "48", "memory.required.full": "11.4 GiB", "memory.required.partial": "8.9 GiB",
      "memory.required.kv": "992.0 MiB", "memory.required.allocations": "[8.9 GiB]",
      "memory.weights.total": "6.8 GiB", "memory.weights.repeating": "6.0 GiB",
      "memory.weights.nonrepeating": "787.5 MiB", "memory.graph.full": "519.5 MiB",
      "memory.graph.partial": "1.3 GiB", "projector.weights": "795.9 MiB", "projector.graph": "1.0 GiB"},
     ("Ollama's gemma3 file: 262144 tokens (its tokenizer's; the Hugging Face config pads to 262208), and its "
      "image encoder (the v.* tensors, with the output layer: one layer slot short of all)",)),
]
# Ollama's layout (0.12.11 to 0.2x; R32 is its own engine's, which lays out the same way on the tensors' bytes): id,
# model, file type, release, each GPU's free GiB, num_ctx, {log line's device: as logged}, notes
LAYOUT_ROWS = [
    ("R32", "mistral-small-24b", "Q8_0", "0.12.11", [22.0, 22.0], 4096, {"model weights CUDA0": "11.5 GiB"},
     ("PR 11090's layout (2025-07), as 0.12.11 has it",
      "two GPUs of 24 GB assumed (their free memory is not in the log; 30 GiB each would hold it on one)",
      "CUDA1's 11.9 GiB holds the vision encoder with the output layer (not modelled): not compared")),
]
WEIGHTS_KV = ("gpu_model", "cpu_model", "kv", "gpu_kv", "cpu_kv", "output")


def predicted(model: str, quant: str, settings: dict, changes: dict) -> dict[str, float]:
    found = find_config(model)
    assert found is not None, model
    config = {**found.hf_config, **changes}
    gguf = quantize(from_config(found.name, config, found.where), quant)
    settings = dict(settings)
    gpus = settings.pop("gpus", 1)
    result = estimate_llamacpp(gguf, LlamaCppSettings(**settings), gpus=gpus)
    cpu, devices = result.buffers["CPU"], [b for name, b in result.buffers.items() if name != "CPU"]
    each = {f"gpu{i}_{part}": getattr(b, part) for i, b in enumerate(devices) for part in ("model", "kv", "compute")}
    gpu_kv = sum(b.kv for b in devices)
    return {"gpu_model": sum(b.model for b in devices), "cpu_model": cpu.model, "kv": gpu_kv + cpu.kv,
            "gpu_kv": gpu_kv, "cpu_kv": cpu.kv, "gpu_compute": devices[0].compute, "host_compute": cpu.compute,
            "output": cpu.output, **each}


def as_mib(text: str) -> float:
    """A figure of Ollama's log in MiB (the sum of a list's), or a count."""
    units = {"GiB": 1024.0, "MiB": 1.0, "KiB": 1 / 1024, "B": 1 / MiB}
    sizes = re.findall(r"([\d.]+) (GiB|MiB|KiB|B)\b", text)
    if sizes:
        return sum(float(n) * units[unit] for n, unit in sizes)
    return float(sum(int(n) for n in text.split(",")))


def catalog_gguf(model: str, quant: str, changes: dict):
    """The catalog model's GGUF in `quant` (its image encoder too, where it has one), with config changes."""
    found = find_config(model)
    assert found is not None, model
    vision = {"vision_config": found.doc["vision_config"]} if "vision_config" in found.doc else {}
    return quantize(from_config(found.name, {**found.hf_config, **vision, **changes}, found.where), quant)


def ollama_records() -> list[dict]:
    records = []
    for row_id, model, quant, changes, version, free, num_ctx, logged, notes in OLLAMA_ROWS:
        gguf = catalog_gguf(model, quant, changes)
        release = OllamaRelease.at(version) if "-" in version else OllamaRelease.parse(version)
        estimate, _, _ = schedule_ollama(gguf, [OllamaGPU(int(g * 1024 * MiB)) for g in free], release=release,
                                         num_ctx=num_ctx)
        fields = estimate.fields()
        for i, (name, text) in enumerate(logged.items()):
            records.append({"id": row_id, "metric": f"ollama {name}", "reported": as_mib(text),
                            "predicted": as_mib(fields[name]), "error": as_mib(fields[name]) / as_mib(text) - 1,
                            "printed": fields[name], "logged": text,
                            "notes": "; ".join((f"Ollama {release.name}",) + notes) if i == 0 else ""})
    return records


def layout_records() -> list[dict]:
    records = []
    for row_id, model, quant, version, free, num_ctx, logged, notes in LAYOUT_ROWS:
        gguf = catalog_gguf(model, quant, {})
        lines = layout_ollama(gguf, [OllamaGPU(int(g * 1024 * MiB)) for g in free],
                              release=OllamaRelease.parse(version), num_ctx=num_ctx).log_lines()
        for i, (name, text) in enumerate(logged.items()):
            label, device = name.rsplit(" ", 1)
            printed = next(line.split('size="')[1].rstrip('"') for line in lines
                           if f'msg="{label}" device={device} ' in line)
            records.append({"id": row_id, "metric": f"ollama layout {name}", "reported": as_mib(text),
                            "predicted": as_mib(printed), "error": as_mib(printed) / as_mib(text) - 1,
                            "printed": printed, "logged": text, "notes": "; ".join(notes) if i == 0 else ""})
    return records


def run() -> list[dict]:
    records = []
    for row_id, model, quant, settings, changes, reported, notes in ROWS:
        try:
            figures = predicted(model, quant, settings, changes)
        except MemfitError as exc:
            records.append({"id": row_id, "metric": "-", "notes": str(exc)})
            continue
        for i, (metric, logged) in enumerate(reported.items()):   # the row's notes on its first figure
            value = round(figures[metric] / MiB, 2)
            records.append({"id": row_id, "metric": metric, "reported": logged, "predicted": value,
                            "error": value / logged - 1, "notes": "; ".join(notes) if i == 0 else ""})
    records += ollama_records() + layout_records()
    records += [{"id": row_id, "metric": "-", "notes": reason} for row_id, reason in MISSES]
    return records


def summary(records: list[dict]) -> dict:
    ollama = [r for r in records if r["metric"].startswith("ollama ")]
    compared = [r for r in records if r["metric"] != "-" and r not in ollama]
    weights_kv = [r for r in compared if r["metric"] in WEIGHTS_KV or re.fullmatch(r"gpu\d+_(model|kv)", r["metric"])]
    groups = {"weights_and_kv": weights_kv, "compute": [r for r in compared if r not in weights_kv]}
    totals: dict = {"rows": len({r["id"] for r in records}), "misses": sum(r["metric"] == "-" for r in records)}
    for name, group in groups.items():
        errors = [abs(r["error"]) for r in group]
        totals[name] = {"figures": len(group), "mean_abs_error": sum(errors) / len(errors), "worst": max(errors)}
    totals["ollama_estimate"] = {"fields": len(ollama), "as_printed": sum(r["printed"] == r["logged"] for r in ollama),
                                 "worst": max(abs(r["error"]) for r in ollama)}
    return totals


def main() -> int:
    records = run()
    totals = summary(records)
    title = (f"memfit against published llama.cpp load logs (MiB): weights and KV mean |error| "
             f"{totals['weights_and_kv']['mean_abs_error']:.2%}, worst {totals['weights_and_kv']['worst']:.2%} "
             f"({totals['weights_and_kv']['figures']} figures); compute buffers mean "
             f"{totals['compute']['mean_abs_error']:.1%}, worst {totals['compute']['worst']:.1%} "
             f"({totals['compute']['figures']}); Ollama's own estimate and layout: "
             f"{totals['ollama_estimate']['as_printed']} of "
             f"{totals['ollama_estimate']['fields']} fields as its log prints them; {totals['misses']} rows missed, "
             "with their reason")
    write_results("published_llamacpp", totals, records, rows_table(title, records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
