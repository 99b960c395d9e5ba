"""memfit's llama.cpp speed model (serving/llamacpp_speed.py) against published llama-bench results
(benchmarks/published_llamabench.md): every row whose model, file type and GPU memfit knows, with the whole model on
the GPU, generating (tg) or reading a prompt (pp). Rows of other devices (P40, Apple, CPUs), partial offloads with no
GPU named and ubatch sweeps are listed as misses with their reason.

    python benchmarks/published_llamabench.py   # -> benchmarks/results/published_llamabench.{txt,json}
"""
from __future__ import annotations

import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from memfit.serving.llamacpp import LlamaCppSettings, estimate_llamacpp, gguf_model  # noqa: E402
from memfit.serving.llamacpp_speed import CALIBRATION_ROWS, HOST_BANDWIDTH_GBPS, speed  # noqa: E402
from memfit.specs.hardware import get_gpu  # noqa: E402

SOURCE = os.path.join(HERE, "published_llamabench.md")
RESULTS = os.path.join(HERE, "results", "published_llamabench")
# llama-bench's model names (architecture and size), as bundled configs of the same shapes
MODELS = {"llama 7B": "llama-2-7b", "llama 8B": "llama-3.1-8b", "llama 70B": "llama-3.1-70b",
          "qwen2 7B": "qwen2.5-7b"}
# llama-bench's file-type names, as llama-quantize names them
TYPES = {"F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q5_0": "Q5_0", "Q4_0": "Q4_0",
         "Q4_1": "Q4_1", "Q2_K": "Q2_K", "Q3_K_S": "Q3_K_S", "Q4_K_S": "Q4_K_S", "Q4_K - Medium": "Q4_K_M",
         "Q4_K - Small": "Q4_K_S", "Q5_K - Medium": "Q5_K_M", "Q3_K - Medium": "Q3_K_M"}
GPUS = {"RTX 4090": "rtx-4090", "RTX 3090": "rtx-3090", "RTX 4080": "rtx-4080", "RTX A6000": "rtx-a6000",
        "A100 80GB PCIe": "a100-80gb", "H100 PCIe": "h100-pcie-80gb", "RTX 5090": "rtx-5090", "RTX 3060": "rtx-3060"}
TEST = re.compile(r"^(pp|tg) ?(\d+)$")


def rows() -> list[dict]:
    with open(SOURCE) as fh:
        text = fh.read()
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 12 and re.fullmatch(r"L\d+", cells[0]):
            keys = ("id", "build", "backend", "device", "model", "size", "params", "ngl", "fa", "test", "tps", "source")
            out.append(dict(zip(keys, cells)))
    return out


def predict(row: dict) -> tuple[float | None, str]:
    """memfit's tokens/s for a row, or None and why not."""
    gpu = next((name for label, name in GPUS.items() if row["device"].endswith(label) or row["device"] == label),
               None)
    model = next((name for label, name in MODELS.items() if row["model"].startswith(label + " ")), None)
    kind = TYPES.get(row["model"].split(" ", 2)[-1]) if model else None
    test = TEST.match(row["test"])
    if row["backend"] != "CUDA" or gpu is None:
        return None, f"{row['backend']} on {row['device']}: not a GPU memfit's catalog has"
    if model is None or kind is None:
        return None, f"{row['model']}: no bundled model or file type"
    if test is None or row["ngl"] not in ("99", "—", "all (-1 in README)"):
        return None, f"{row['test']} at -ngl {row['ngl']}: not a full offload's pp/tg at the defaults"
    gguf = gguf_model(model, kind)
    tokens = int(test[2])
    estimate = estimate_llamacpp(gguf, LlamaCppSettings(ctx_size=tokens, flash_attn="off"), gpus=1)
    decode, prompt = speed(estimate, gguf, get_gpu(gpu), HOST_BANDWIDTH_GBPS)
    return (decode if test[1] == "tg" else prompt), f"{model} {kind} on {gpu}"


def run() -> list[dict]:
    records = []
    for row in rows():
        predicted, what = predict(row)
        measured = float(row["tps"]) if re.fullmatch(r"[\d.]+", row["tps"]) else None
        record = {"id": row["id"], "test": row["test"], "device": row["device"], "model": row["model"],
                  "measured": measured, "predicted": predicted, "as": what}
        if predicted is not None and measured:
            record["error"] = predicted / measured - 1
        records.append(record)
    return records


def summary(records: list[dict]) -> dict:
    """Mean and worst error of generating (on the rows the model was calibrated on, and on the rest) and of reading
    a prompt."""
    groups = {f"{test}_{part}": (lambda r, test=test, part=part: r["test"].startswith(test) and (
        r["id"] in CALIBRATION_ROWS) == (part == "calibrated")) for test in ("tg", "pp")
        for part in ("calibrated", "held_out")}
    out: dict = {}
    for name, member in groups.items():
        errors = [r["error"] for r in records if "error" in r and member(r)]
        out[name] = {"rows": len(errors), "mean_abs_error": sum(map(abs, errors)) / len(errors),
                     "mean_error": sum(errors) / len(errors), "worst": max(errors, key=abs)}
    out["misses"] = sum("error" not in r for r in records)
    return out


def main() -> None:
    records = run()
    totals = summary(records)
    lines = ["memfit's llama.cpp speed model against published llama-bench runs (benchmarks/published_llamabench.md)",
             "", f"{'id':<4} {'test':<7} {'model':<24} {'as':<34} {'t/s':>9} {'memfit':>9} {'error':>7}"]
    for r in records:
        if "error" in r:
            lines.append(f"{r['id']:<4} {r['test']:<7} {r['model'][:24]:<24} {r['as'][:34]:<34} {r['measured']:9.1f} "
                         f"{r['predicted']:9.1f} {r['error']:+7.0%}")
    lines.append("")
    for group, name in (("tg_calibrated", "generating, the rows its figures were read off"),
                        ("tg_held_out", "generating, the other rows"),
                        ("pp_calibrated", "reading a prompt, the rows its figures were read off"),
                        ("pp_held_out", "reading a prompt, the other rows")):
        t = totals[group]
        lines.append(f"{name}: {t['rows']} rows, mean error {t['mean_error']:+.0%}, mean |error| "
                     f"{t['mean_abs_error']:.0%}, worst {t['worst']:+.0%}")
    lines.append(f"{totals['misses']} rows not expressible (other devices, partial offloads, ubatch sweeps): their "
                 "reasons in the JSON")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(RESULTS + ".txt", "w") as fh:
        fh.write(text)
    with open(RESULTS + ".json", "w") as fh:
        json.dump({"summary": totals, "rows": records}, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
