"""GPT-2 (and GPT-3-shaped models): learned positions, LayerNorm, Conv1D projections, the tanh GELU
written out in Python (NewGELU), dropout after embeddings, attention and MLP, tied LM head."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from memfit.core.errors import MemfitError
from memfit.estimators.analytic import ops
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.families.common import (
    asks_for_eager,
    chunked_lm_loss,
    eager_attention,
    generate,
    grow_cache,
    lm_head,
    replace_cache,
)
from memfit.estimators.analytic.symbols import Sym, View

FAMILIES = ("gpt2",)


@dataclass(frozen=True)
class GPT2Spec:
    causal: ClassVar[bool] = True   # a decoder: each token attends to those before it
    hidden: int
    layers: int
    heads: int
    inner: int
    vocab: int
    positions: int
    embd_pdrop: float
    resid_pdrop: float
    attn_pdrop: float
    tied: bool
    eager: bool = False            # eager attention (scores materialised, a float causal mask) instead of SDPA
    period: int = 1

    @classmethod
    def from_config(cls, cfg) -> GPT2Spec:
        if cfg.activation_function != "gelu_new":
            raise MemfitError(f"the analytic GPT-2 model covers activation gelu_new, not {cfg.activation_function!r}; "
                              "use --method traced.")
        return cls(hidden=cfg.n_embd, layers=cfg.n_layer, heads=cfg.n_head, inner=cfg.n_inner or 4 * cfg.n_embd,
                   vocab=cfg.vocab_size, positions=cfg.n_positions, embd_pdrop=cfg.embd_pdrop,
                   resid_pdrop=cfg.resid_pdrop, attn_pdrop=cfg.attn_pdrop, tied=bool(cfg.tie_word_embeddings),
                   eager=asks_for_eager(cfg))


def declare_params(e: Engine, d: GPT2Spec, num_layers: int) -> None:
    h = d.hidden
    e.param("wte", (d.vocab, h))
    e.param("wpe", (d.positions, h))
    for i in range(num_layers):
        p = f"h.{i}."
        for name, shape in (("ln_1.w", (h,)), ("ln_1.b", (h,)), ("c_attn.w", (h, 3 * h)), ("c_attn.b", (3 * h,)),
                            ("attn.c_proj.w", (h, h)), ("attn.c_proj.b", (h,)), ("ln_2.w", (h,)), ("ln_2.b", (h,)),
                            ("c_fc.w", (h, d.inner)), ("c_fc.b", (d.inner,)), ("mlp.c_proj.w", (d.inner, h)),
                            ("mlp.c_proj.b", (h,))):
            e.param(p + name, shape)
    e.param("ln_f.w", (h,))
    e.param("ln_f.b", (h,))
    if not d.tied:
        e.param("lm_head", (d.vocab, h))


def declare_buffers(e: Engine, d: GPT2Spec) -> list[Sym]:
    return []


def new_gelu(e: Engine, x: Sym) -> Sym:
    """0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3.0)))), evaluated left to right."""
    half = ops.scalar_op(e, x)
    cubed = ops.pow_scalar(e, x)
    inner = ops.scalar_op(e, cubed)
    del cubed
    inner = ops.add(e, x, inner)
    inner = ops.scalar_op(e, inner)
    t = ops.unary_saving_output(e, inner, "tanh")
    del inner
    t = ops.shift(e, t)
    return ops.mul(e, half, t)


def attention(e: Engine, x: Sym, d: GPT2Spec, i: int, batch: int, q_len: int, cache: dict | None, kv_len: int,
              mask: Sym | None) -> tuple[Sym, Sym | None]:
    """GPT2Attention: q, k, v are views of c_attn's output and live until the method returns; returns the
    output and the eager attention weights (the block holds them until it returns)."""
    p, params = f"h.{i}.", e.params
    qkv = ops.linear(e, x, params[p + "c_attn.w"], 3 * d.hidden, params[p + "c_attn.b"])
    k: Sym
    v: Sym
    q, k, v = (View(qkv, qkv.numel // 3) for _ in range(3))
    del qkv
    if cache is not None:
        k, v = grow_cache(e, cache, i, k, v, batch * d.hidden, kv_len)
    shape: dict[str, Any] = dict(batch=batch, heads=d.heads, q_len=q_len, kv_len=kv_len, head_dim=d.hidden // d.heads,
                 dropout_p=d.attn_pdrop if e.policy.train else 0.0)
    weights = None
    if d.eager:   # the weights cast to the value's dtype (mixed precision: from float32)
        out, weights = eager_attention(e, q, k, v, **shape, masks=(mask,) if mask is not None else (),
                                       weights_dtype=v.dtype)
    else:
        out = ops.sdpa(e, q, k, v, **shape, causal=q_len > 1)
    out = ops.linear(e, out, params[p + "attn.c_proj.w"], d.hidden, params[p + "attn.c_proj.b"])
    return ops.dropout(e, out, d.resid_pdrop), weights


def mlp(e: Engine, x: Sym, d: GPT2Spec, i: int) -> Sym:
    p, params = f"h.{i}.", e.params
    h = ops.linear(e, x, params[p + "c_fc.w"], d.inner, params[p + "c_fc.b"])
    h = new_gelu(e, h)
    h = ops.linear(e, h, params[p + "mlp.c_proj.w"], d.hidden, params[p + "mlp.c_proj.b"])
    return ops.dropout(e, h, d.resid_pdrop)


def block(e: Engine, x: Sym, d: GPT2Spec, i: int, batch: int, q_len: int, cache: dict | None, kv_len: int,
          mask: Sym | None) -> Sym:
    """GPT2Block, with its variables' lifetimes: ln_1's output lives until the residual add."""
    p, params = f"h.{i}.", e.params
    residual = x
    hidden = ops.layer_norm(e, x, params[p + "ln_1.w"], params[p + "ln_1.b"], d.hidden)
    attn_output, _weights = attention(e, hidden, d, i, batch, q_len, cache, kv_len, mask)   # held till return
    hidden = ops.add(e, attn_output, residual)   # attn_output stays referenced until the block returns
    residual = hidden
    hidden = ops.layer_norm(e, hidden, params[p + "ln_2.w"], params[p + "ln_2.b"], d.hidden)
    feed_forward = mlp(e, hidden, d, i)
    return ops.add(e, residual, feed_forward)


def forward(e: Engine, d: GPT2Spec, num_layers: int, *, batch: int, q_len: int, labels: bool,
            cache: dict | None = None, kv_len: int | None = None, logits_to_keep: int = 0) -> Sym:
    kv_len = kv_len or q_len
    ids = e.input(batch * q_len, "int64")
    e.segment = "pre"
    inputs_embeds = ops.embedding(e, ids, e.params["wte"], d.hidden)
    positions = e.new(q_len, "int64")                     # arange(...) + past length
    position_embeds = ops.embedding(e, positions, e.params["wpe"], d.hidden)
    x = ops.add(e, inputs_embeds, position_embeds)
    x = ops.dropout(e, x, d.embd_pdrop)
    mask = e.new(batch * q_len * kv_len, x.dtype) if d.eager and q_len > 1 else None   # create_causal_mask
    for i in range(num_layers):
        e.segment = (0, i)
        x = e.block(i, partial(block, e, d=d, i=i, batch=batch, q_len=q_len, cache=cache, kv_len=kv_len,
                               mask=mask), x)
    e.segment = "post"
    hidden = ops.layer_norm(e, x, e.params["ln_f.w"], e.params["ln_f.b"], d.hidden)
    del x, inputs_embeds, position_embeds, positions, mask
    if labels and e.policy.loss_chunks:
        e.input(batch * q_len, "int64")   # labels
        loss = chunked_lm_loss(e, hidden, e.params["wte" if d.tied else "lm_head"], d.vocab, batch=batch, seq=q_len,
                               chunks=e.policy.loss_chunks, softcap=False)
        del hidden
        return loss
    logits = lm_head(e, hidden, e.params["wte" if d.tied else "lm_head"], d.vocab, batch=batch, q_len=q_len,
                     logits_to_keep=logits_to_keep)
    if not labels:
        return logits
    e.input(batch * q_len, "int64")
    loss = ops.cross_entropy(e, logits, batch=batch, seq=q_len, shift=True)
    del logits, hidden
    return loss


def train(e: Engine, d: GPT2Spec, num_layers: int, batch: int, seq: int) -> Sym:
    return forward(e, d, num_layers, batch=batch, q_len=seq, labels=True)


def inference(e: Engine, d: GPT2Spec, num_layers: int, batch: int, seq: int, new_tokens: int) -> None:
    def run(cache, q_len, kv_len, keep):
        return forward(e, d, num_layers, batch=batch, q_len=q_len, labels=False, cache=cache, kv_len=kv_len,
                       logits_to_keep=keep)

    def resize(cache, tokens):
        replace_cache(e, cache, dict.fromkeys(range(num_layers), tokens))

    generate(e, run, batch=batch, seq=seq, new_tokens=new_tokens, resize_cache=resize)
