"""Measures the accuracy cost of the lossy weight techniques on real weights and real text, and writes it
where `memfit.estimators.effects` reads it (src/memfit/data/accuracy.json), so the planner quotes a
measured figure with its source.

    python benchmarks/accuracy_costs.py [--finetune-steps 40]

Two subjects (memfit.measurement.accuracy):
  - the pretrained all-MiniLM-L6-v2 sentence encoder on 64 held-out sentences of the bundled corpus: mean
    and worst cosine similarity of each sentence's embedding to the float32 model's, and how often its
    nearest other sentence stays the same;
  - a small causal LM memfit trains on the corpus's training part (about 10 minutes on 2 CPU cores the
    first time, then cached): perplexity on the held-out part with the technique applied, against float32.
    Structured pruning rows also report the perplexity after a short fine-tune of the pruned model.
Writes benchmarks/results/accuracy_costs.txt beside the data file.
"""
from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
warnings.filterwarnings("ignore")

import docs_sync  # noqa: E402   # benchmarks/docs_sync.py: the docs show these results
import torch  # noqa: E402

from memfit.measurement import accuracy  # noqa: E402
from memfit.measurement.training import text_batches, train_run  # noqa: E402
from memfit.specs.workload import Workload  # noqa: E402
from memfit.techniques.resolve import resolve  # noqa: E402

ENCODER_ROWS = ("bf16", "int8-weight-only", "int8-dynamic", "bnb-4bit", "bnb-4bit:format=fp4")
LM_ROWS = ENCODER_ROWS + ("prune-unstructured:sparsity=0.5", "prune-unstructured:sparsity=0.8",
                          "prune-structured:ratio=0.25", "prune-structured")
COMMAND = "python benchmarks/accuracy_costs.py"


def finetuned_perplexity(techniques: tuple[str, ...], steps: int) -> float:
    """The pretrained LM with `techniques` fine-tuned `steps` steps on the training text, then its held-out
    perplexity (without techniques: the same fine-tune of the whole model, to compare with)."""
    workload = Workload(model=accuracy.LM_MODEL, task="train", batch_size=accuracy.LM_BATCH,
                        seq_len=accuracy.LM_SEQ, techniques=techniques)
    batches = text_batches(batch_size=accuracy.LM_BATCH, seq_len=accuracy.LM_SEQ, num_batches=steps, seed=3)
    run = train_run(workload, batches, lr=1e-3, start_from=accuracy.pretrained_lm(), keep_parameters=True)
    model = resolve(Workload(model=accuracy.LM_MODEL, task="inference")).source.build(device="cpu",
                                                                                    dtype=torch.float32)
    import memfit

    model = memfit.apply_(model, None, techniques).model     # the pruned shape, then the fine-tuned weights
    model.load_state_dict(run.parameters)
    return accuracy.held_out_perplexity(model=model.eval())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finetune-steps", type=int, default=40, help="recovery fine-tune of pruned models")
    args = parser.parse_args()
    lines = [f"# {COMMAND} --finetune-steps {args.finetune_steps}", "",
             f"encoder: {accuracy.ENCODER} on {accuracy.SENTENCES}",
             f"{'technique':<34} {'mean cos':>9} {'min cos':>9} {'top-1 same':>11}"]
    print("\n".join(lines), flush=True)
    for technique in ENCODER_ROWS:
        r = accuracy.embedding_agreement([technique])
        accuracy.record_accuracy(technique, {
            "metric": "sentence-embedding cosine to float32", "mean_cosine": round(r.mean_cosine, 5),
            "min_cosine": round(r.min_cosine, 5), "top1_agreement": round(r.top1_agreement, 4), "source": r.source,
            "command": COMMAND})
        lines.append(f"{technique:<34} {r.mean_cosine:>9.5f} {r.min_cosine:>9.5f} {r.top1_agreement:>10.1%}")
        print(lines[-1], flush=True)
    accuracy.pretrained_lm(progress=print)
    base = accuracy.held_out_perplexity()
    tuned = finetuned_perplexity((), args.finetune_steps)
    lines += ["", f"causal LM: {accuracy.LM_SOURCE}; held-out perplexity, float32 {base:.3f}; the same model "
                  f"fine-tuned {args.finetune_steps} more steps unpruned: {tuned:.3f}",
              f"{'technique':<34} {'ppl':>8} {'Δ':>9} {'after fine-tune (Δ vs the unpruned fine-tune)':>48}"]
    print("\n".join(lines[-3:]), flush=True)
    for technique in LM_ROWS:
        ppl = accuracy.held_out_perplexity([technique])
        entry = {"metric": "held-out perplexity change", "perplexity": round(ppl, 4), "float32": round(base, 4),
                 "change": round(ppl / base - 1, 5), "source": accuracy.LM_SOURCE, "command": COMMAND}
        recovered = ""
        if technique.startswith("prune-structured"):   # unstructured zeros would grow back in a plain fine-tune
            after = finetuned_perplexity((technique,), args.finetune_steps)
            entry |= {"after_finetune": round(after, 4), "unpruned_after_finetune": round(tuned, 4),
                      "finetune_steps": args.finetune_steps}
            recovered = f"{after:.3f} ({100 * (after / tuned - 1):+.1f} %)"
        accuracy.record_accuracy(technique, entry)
        lines.append(f"{technique:<34} {ppl:>8.3f} {100 * (ppl / base - 1):>+8.2f}% {recovered:>48}")
        print(lines[-1], flush=True)
    Path(__file__).parent.joinpath("results", "accuracy_costs.txt").write_text("\n".join(lines) + "\n")
    docs_sync.sync()


if __name__ == "__main__":
    main()
