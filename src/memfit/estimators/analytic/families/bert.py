"""BERT for masked LM: word + token-type + position embeddings, post-LN encoder layers with SDPA and
dropout, erf GELU, the prediction head (dense, GELU, LayerNorm, tied decoder) and CrossEntropyLoss on
the raw logits (no float upcast)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from memfit.estimators.analytic import ops
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.families.common import asks_for_eager, dense, eager_attention
from memfit.estimators.analytic.symbols import Sym, View

FAMILIES = ("bert",)


@dataclass(frozen=True)
class BertSpec:
    causal: ClassVar[bool] = False   # an encoder: every token attends to every other
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    positions: int
    type_vocab: int
    hidden_dropout: float
    attn_dropout: float
    head_dim: int
    eager: bool = False            # eager attention (scores materialised) instead of SDPA
    period: int = 1

    @property
    def width(self) -> int:
        """The attention's inner width (hidden, unless prune-structured removed heads)."""
        return self.heads * self.head_dim

    @classmethod
    def from_config(cls, cfg) -> BertSpec:
        return cls(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                   intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, positions=cfg.max_position_embeddings,
                   type_vocab=cfg.type_vocab_size, hidden_dropout=cfg.hidden_dropout_prob,
                   attn_dropout=cfg.attention_probs_dropout_prob,
                   head_dim=cfg.hidden_size // cfg.num_attention_heads,
                   eager=asks_for_eager(cfg))


def declare_params(e: Engine, d: BertSpec, num_layers: int) -> None:
    h, inter, w = d.hidden, d.intermediate, d.width
    for name, shape in (("word", (d.vocab, h)), ("position", (d.positions, h)), ("token_type", (d.type_vocab, h)),
                        ("emb_ln.w", (h,)), ("emb_ln.b", (h,))):
        e.param(name, shape)
    for i in range(num_layers):
        p = f"layer.{i}."
        for name, shape in (("q.w", (w, h)), ("q.b", (w,)), ("k.w", (w, h)), ("k.b", (w,)), ("v.w", (w, h)),
                            ("v.b", (w,)), ("attn_out.w", (h, w)), ("attn_out.b", (h,)), ("attn_ln.w", (h,)),
                            ("attn_ln.b", (h,)), ("inter.w", (inter, h)), ("inter.b", (inter,)),
                            ("out.w", (h, inter)), ("out.b", (h,)), ("out_ln.w", (h,)), ("out_ln.b", (h,))):
            e.param(p + name, shape)
    for name, shape in (("head.w", (h, h)), ("head.b", (h,)), ("head_ln.w", (h,)), ("head_ln.b", (h,)),
                        ("decoder.b", (d.vocab,))):
        e.param(name, shape)


def declare_buffers(e: Engine, d: BertSpec) -> list[Sym]:
    return [e.new(d.positions, "int64", category="buffers"), e.new(d.positions, "int64", category="buffers")]


def embeddings(e: Engine, d: BertSpec, ids: Sym, batch: int, seq: int) -> Sym:
    inputs_embeds = ops.embedding(e, ids, e.params["word"], d.hidden)
    token_types = e.new(seq, "int64")                        # gather from the token_type_ids buffer
    token_type_embeds = ops.embedding(e, View(token_types, batch * seq), e.params["token_type"], d.hidden)
    x = ops.add(e, inputs_embeds, token_type_embeds)
    position_embeds = ops.embedding(e, e.new(seq, "int64"), e.params["position"], d.hidden)
    x = ops.add(e, x, position_embeds)
    x = ops.layer_norm(e, x, e.params["emb_ln.w"], e.params["emb_ln.b"], d.hidden)
    return ops.dropout(e, x, d.hidden_dropout)


def self_attention(e: Engine, x: Sym, d: BertSpec, i: int, batch: int, seq: int) -> Sym:
    """q, k, v (separate projections) live until the method returns."""
    p = f"layer.{i}."
    q, k, v = (dense(e, x, p + n, d.width) for n in ("q", "k", "v"))
    shape: dict[str, Any] = dict(batch=batch, heads=d.heads, q_len=seq, kv_len=seq, head_dim=d.head_dim,
                 dropout_p=d.attn_dropout if e.policy.train else 0.0)
    if d.eager:
        return eager_attention(e, q, k, v, **shape)[0]
    return ops.sdpa(e, q, k, v, **shape)


def _output(e: Engine, x: Sym, residual: Sym, d: BertSpec, name: str, ln: str) -> Sym:
    """dense, dropout, LayerNorm(hidden + input)."""
    x = dense(e, x, name, d.hidden)
    x = ops.dropout(e, x, d.hidden_dropout)
    x = ops.add(e, x, residual)
    return ops.layer_norm(e, x, e.params[ln + ".w"], e.params[ln + ".b"], d.hidden)


def layer(e: Engine, x: Sym, d: BertSpec, i: int, batch: int, seq: int) -> Sym:
    p = f"layer.{i}."
    attention_output = self_attention(e, x, d, i, batch, seq)
    attention_output = _output(e, attention_output, x, d, p + "attn_out", p + "attn_ln")
    intermediate = dense(e, attention_output, p + "inter", d.intermediate)
    intermediate = ops.unary_saving_input(e, intermediate)   # erf GELU
    return _output(e, intermediate, attention_output, d, p + "out", p + "out_ln")


def forward(e: Engine, d: BertSpec, num_layers: int, *, batch: int, seq: int, labels: bool) -> Sym:
    ids = e.input(batch * seq, "int64")
    e.segment = "pre"
    x = embeddings(e, d, ids, batch, seq)
    for i in range(num_layers):
        e.segment = (0, i)
        x = e.block(i, partial(layer, e, d=d, i=i, batch=batch, seq=seq), x)
    e.segment = "post"
    sequence_output = x
    del x
    h = dense(e, sequence_output, "head", d.hidden)
    h = ops.unary_saving_input(e, h)
    h = ops.layer_norm(e, h, e.params["head_ln.w"], e.params["head_ln.b"], d.hidden)
    scores = ops.linear(e, h, e.params["word"], d.vocab, e.params["decoder.b"])
    del h
    if not labels:
        return scores
    e.input(batch * seq, "int64")
    loss = ops.cross_entropy(e, scores, batch=batch, seq=seq, shift=False, upcast=False)
    del scores, sequence_output
    return loss


def train(e: Engine, d: BertSpec, num_layers: int, batch: int, seq: int) -> Sym:
    return forward(e, d, num_layers, batch=batch, seq=seq, labels=True)


def inference(e: Engine, d: BertSpec, num_layers: int, batch: int, seq: int, new_tokens: int) -> None:
    e.set_phase("forward")
    scores = forward(e, d, num_layers, batch=batch, seq=seq, labels=False)
    del scores
