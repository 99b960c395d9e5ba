"""memfit's llama.cpp buffers against real llama.cpp loads on this CPU (benchmarks/llamacpp_cpu_run.py's record):
the weights' bytes (llama_model_size, exact), the KV cache (its cells and MiB, exact to the log's 2 decimals), the
output buffer and the compute buffer (the log's 4 decimals at exit; target within 5 %).

    python benchmarks/llamacpp_cpu_check.py   # -> benchmarks/results/llamacpp_cpu_check.txt
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llamacpp_cpu_run import expand

from memfit.serving.gguf_file import GGUFModel, GGUFTensor, swa_pattern
from memfit.serving.llamacpp import LlamaCppSettings, estimate_llamacpp

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD = os.path.join(HERE, "results", "llamacpp_cpu_run.json")
OUT = os.path.join(HERE, "results", "llamacpp_cpu_check.txt")
MiB = 1 << 20


def model_of(run: dict) -> GGUFModel:
    """The model a recorded load read: its hyperparameters and its quantized file's tensor table."""
    h = run["hparams"]
    return GGUFModel(name=f"{run['model']}-{run['quant']}", arch=h["arch"], n_layer=h["n_layer"], n_embd=h["n_embd"],
                     n_head=h["n_head"], n_head_kv=[h["n_head_kv"]] * h["n_layer"],
                     head_dim_k=h.get("head_dim") or h["n_embd"] // h["n_head"],
                     head_dim_v=h.get("head_dim") or h["n_embd"] // h["n_head"], n_ff=h["n_ff"],
                     n_vocab=h["n_vocab"], n_ctx_train=4096, n_expert=h.get("n_expert", 0),
                     n_expert_used=h.get("n_expert_used", 0),
                     n_ff_exp=(h.get("n_ff_exp") or h["n_ff"]) if h.get("n_expert") else 0,
                     n_swa=h.get("n_swa", 0), swa_layers=swa_pattern(None, h["arch"], h["n_layer"]) if h.get("n_swa")
                     else [],
                     tensors=[GGUFTensor(name, kind, tuple(shape)) for name, kind, shape in run["tensors"]])


def settings_of(run: dict) -> LlamaCppSettings:
    s = run["settings"]
    return LlamaCppSettings(ctx_size=s["n_ctx"], n_batch=s.get("n_batch", 2048), n_ubatch=s.get("n_ubatch", 512),
                            cache_type_k=s.get("type_k", "f16"), cache_type_v=s.get("type_v", "f16"),
                            flash_attn=s.get("flash_attn", "off"), parallel=s.get("n_seq_max", 1),
                            kv_unified=s.get("kv_unified", False), swa_full=s.get("swa_full", False), n_gpu_layers=0,
                            cpu_avx512=run.get("cpu_avx512", False))


def compare(run: dict) -> dict:
    """memfit's figures beside the run's (MiB, as llama.cpp prints them)."""
    model = model_of(run)
    predicted = estimate_llamacpp(model, settings_of(run))
    cpu, swa = predicted.buffers["CPU"], run["kv"].get("swa", {})
    return {
        "case": f"{run['model']} {run['quant']} " + " ".join(f"{k}={v}" for k, v in run["settings"].items()),
        "weights": (predicted.weights_bytes, run["model_size_bytes"]),
        "kv_cells": ((predicted.kv.cells, predicted.kv.swa_cells), (run["kv"]["cells"], swa.get("cells", 0))),
        "kv_mib": (cache_mib(model, predicted), (run["kv"]["mib"], swa.get("mib", 0.0))),
        "output_mib": (round(cpu.output / MiB, 2), run["output_buffers_mib"]["CPU"]),
        "repack_mib": (round(cpu.repack / MiB, 2), run["model_buffers_mib"].get("CPU_REPACK", 0.0)),
        "compute_mib": (round(cpu.compute / MiB, 4), run["compute_buffers_mib"]["CPU"]),
    }


def cache_mib(model: GGUFModel, predicted) -> tuple[float, float]:
    """Each cache's MiB as llama.cpp prints it: the full-attention layers', the sliding-window layers' (0 if none)."""
    swa = sum(size for size, sliding in zip(predicted.kv.layer_bytes, model.swa_layers) if sliding)
    return round((predicted.kv.bytes - swa) / MiB, 2), round(swa / MiB, 2)


def load_record() -> dict:
    with open(RECORD) as fh:
        return json.load(fh)


def main() -> None:
    record = load_record()
    rows = [compare(run) for run in expand(record)]
    lines = [f"memfit against llama.cpp (llama-cpp-python {record['llama_cpp_python']}, CPU) loading tiny GGUF models "
             "here", "",
             f"{'case':<72} {'weights B':>10} {'KV cells':>9} {'KV MiB':>13} {'out MiB':>11} {'repack MiB':>11} "
             f"{'compute MiB':>21}"]
    errors = []
    for row in rows:
        w, cells, kv, out, repack, comp = (row[k] for k in ("weights", "kv_cells", "kv_mib", "output_mib", "repack_mib",
                                                            "compute_mib"))
        error = comp[0] / comp[1] - 1
        errors.append(abs(error))
        same = w[0] == w[1] and cells[0] == cells[1] and kv[0] == kv[1] and out[0] == out[1] and repack[0] == repack[1]
        same_w, same_cells = "=" if w[0] == w[1] else w[0], "=" if cells[0] == cells[1] else cells[0]
        kv = tuple(round(sum(part), 2) for part in kv)   # both caches together
        lines.append(f"{row['case']:<72} {same_w:>10} {same_cells:>9} {kv[0]:>6}/{kv[1]:<6} {out[0]:>5}/{out[1]:<5} "
                     f"{repack[0]:>5}/{repack[1]:<5} {comp[0]:>9.4f}/{comp[1]:<9.4f} {error:+.1%}"
                     f"{'' if same else '  MISMATCH'}")
    exact = sum(r["weights"][0] == r["weights"][1] and r["kv_mib"][0] == r["kv_mib"][1]
                and r["kv_cells"][0] == r["kv_cells"][1] for r in rows)
    repacked = sum(r["repack_mib"][0] == r["repack_mib"][1] for r in rows)
    lines += ["", f"weights and KV exact in {exact} of {len(rows)} loads; the CPU's repacked weights (CPU_REPACK) in "
                  f"{repacked}; compute buffer mean |error| {sum(errors) / len(errors):.1%}, worst {max(errors):.1%}"]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(OUT, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
