"""Measures the accuracy cost of the lossy inference techniques on real weights and real text, and writes
it where `memfit.techniques.effects` reads it (src/memfit/data/accuracy.json), so the planner quotes a
measured figure with its source.

    python benchmarks/accuracy_costs.py     # about a minute on 2 CPU cores

Subject: the pretrained all-MiniLM-L6-v2 sentence encoder (memfit.measurement.accuracy) on 64 held-out
sentences of the bundled corpus: mean and worst cosine similarity of each sentence's embedding to the
float32 model's, and how often its nearest other sentence stays the same.
"""
from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

from memfit.measurement.accuracy import embedding_agreement

TECHNIQUES = ("bf16", "int8-weight-only", "int8-dynamic", "bnb-4bit", "bnb-4bit:format=fp4")


def main() -> None:
    rows = {}
    print(f"{'technique':<24} {'mean cos':>9} {'min cos':>9} {'top-1 same':>11}")
    for technique in TECHNIQUES:
        result = embedding_agreement([technique])
        rows[technique] = {"metric": "sentence-embedding cosine to float32", "mean_cosine": round(result.mean_cosine, 5),
                           "min_cosine": round(result.min_cosine, 5),
                           "top1_agreement": round(result.top1_agreement, 4), "source": result.source,
                           "command": "python benchmarks/accuracy_costs.py"}
        print(f"{technique:<24} {result.mean_cosine:>9.5f} {result.min_cosine:>9.5f} {result.top1_agreement:>10.1%}",
              flush=True)
    path = Path(str(resources.files("memfit.data").joinpath("accuracy.json")))
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"written: {path.name}", file=sys.stderr)


if __name__ == "__main__":
    main()
