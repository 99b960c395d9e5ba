"""The host memory llama.cpp really takes here, against memfit's host figure: a 250M-parameter llama-shaped model
(llamacpp_cpu_speed.py's) in several file types, loaded by llama.cpp on this CPU, its context filled ubatch by ubatch
(every weight read, the cache written, the last ubatch's graph against the whole cache); the growth of the process's
resident size (VmRSS) beside memfit's host buffers (mapped weights, KV, compute, output) and the CPU's repacked
copies (CPU_REPACK), whose source pages stay resident as page cache after the copy.

    bash scripts/setup_llamacpp.sh                                 # once: ./.venv-llama
    .venv-llama/bin/python benchmarks/llamacpp_cpu_rss.py         # -> benchmarks/results/llamacpp_cpu_rss.{json,txt}
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
RESULTS = os.path.join(HERE, "results", "llamacpp_cpu_rss")
MiB = 2**20
# (file type, llama.cpp's context settings)
CASES = [
    ("F16", dict(n_ctx=2048, flash_attn="on")),
    ("Q8_0", dict(n_ctx=2048, flash_attn="on")),
    ("Q4_0", dict(n_ctx=2048, flash_attn="on")),
    ("Q4_K_M", dict(n_ctx=4096, flash_attn="on", type_k="q8_0", type_v="q8_0")),
    ("Q8_0", dict(n_ctx=2048, flash_attn="off")),
]


def record() -> list[dict]:
    from llamacpp_cpu_run import run_case
    from llamacpp_cpu_speed import MODEL

    with tempfile.TemporaryDirectory(prefix="memfit-rss-") as folder:
        runs = []
        for quant, settings in CASES:
            print(f"{quant} {settings}", file=sys.stderr, flush=True)
            run = run_case(folder, "rss", quant, settings, resident=True, models={"rss": MODEL})
            runs.append({key: run[key] for key in ("quant", "settings", "resident_growth_bytes", "model_size_bytes")}
                        | {"tensors": run["tensors"], "hparams": run["hparams"], "model": "rss"})
    return runs


def rows(runs: list[dict]) -> list[dict]:
    from llamacpp_cpu_check import model_of, settings_of

    from memfit.serving.llamacpp import estimate_llamacpp

    out = []
    for run in runs:
        cpu = estimate_llamacpp(model_of(run), settings_of(run)).buffers["CPU"]
        with_pages = cpu.total + cpu.repack
        out.append({"quant": run["quant"], "settings": run["settings"],
                    "measured_mib": run["resident_growth_bytes"] / MiB, "host_mib": cpu.total / MiB,
                    "repack_mib": cpu.repack / MiB, "predicted_mib": with_pages / MiB,
                    "error": run["resident_growth_bytes"] / with_pages - 1})
    return out


def main() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit("run with .venv-llama/bin/python (bash scripts/setup_llamacpp.sh builds it)") from None
    runs = record()
    with open(RESULTS + ".json", "w") as fh:
        json.dump({"runs": runs}, fh)
        fh.write("\n")
    # memfit runs in its own environment (the gguf package and memfit itself)
    child = subprocess.run([os.path.join(os.path.dirname(HERE), ".venv", "bin", "python"), __file__, "--table"],
                           capture_output=True, text=True)
    print(child.stdout, child.stderr, end="")


def table() -> None:
    with open(RESULTS + ".json") as fh:
        data = rows(json.load(fh)["runs"])
    lines = ["llama.cpp on this CPU: the process's resident size grown by the load and a full context (MiB), against",
             "memfit's host buffers (mapped weights + KV + compute + output) and the repacked weights' copies",
             f"{'type':<7} {'settings':<62} {'host':>8} {'repack':>7} {'memfit':>8} {'measured':>9} {'error':>7}"]
    for row in data:
        settings = " ".join(f"{k}={v}" for k, v in row["settings"].items())
        lines.append(f"{row['quant']:<7} {settings:<62} {row['host_mib']:>8.1f} {row['repack_mib']:>7.1f} "
                     f"{row['predicted_mib']:>8.1f} {row['measured_mib']:>9.1f} {row['error']:>+7.1%}")
    mean = sum(abs(r["error"]) for r in data) / len(data)
    lines.append(f"mean |error| {mean:.1%}, worst {max(data, key=lambda r: abs(r['error']))['error']:+.1%}; without "
                 "flash attention the CPU backend's work buffer (the attention scores converted for the product with "
                 "V) is in the process but in no buffer llama.cpp prints")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(RESULTS + ".txt", "w") as fh:
        fh.write(text)
    import docs_sync  # the docs show these results

    docs_sync.sync()


if __name__ == "__main__":
    table() if sys.argv[1:] == ["--table"] else main()
