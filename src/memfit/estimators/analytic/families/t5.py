"""T5 encoder-decoder: shared embeddings, RMS-style T5LayerNorm, relative position bias computed by
the first block and added to the scores (as an SDPA float mask), ReLU feed-forward with dropout,
cross-attention to the encoder output, tied LM head scaled by d_model**-0.5, CrossEntropyLoss."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from memfit.estimators.analytic import ops
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.families.common import asks_for_eager, eager_attention, grow_cache, replace_cache
from memfit.estimators.analytic.symbols import Sym, View

FAMILIES = ("t5",)
_BUCKET_TEMPS = 5   # int64 (q, k) tensors alive at once while _relative_position_bucket runs


@dataclass(frozen=True)
class T5Spec:
    causal: ClassVar[bool] = False   # counted as bidirectional (its decoder's causal half is not told apart)
    d_model: int
    d_kv: int
    d_ff: int
    layers: int
    decoder_layers: int
    heads: int
    vocab: int
    buckets: int
    dropout: float
    tied: bool
    gated: bool
    eager: bool = False            # eager attention: the bias added to materialised scores, a float causal mask
    period: int = 1

    @classmethod
    def from_config(cls, cfg) -> T5Spec:
        return cls(d_model=cfg.d_model, d_kv=cfg.d_kv, d_ff=cfg.d_ff, layers=cfg.num_layers,
                   decoder_layers=cfg.num_decoder_layers, heads=cfg.num_heads, vocab=cfg.vocab_size,
                   buckets=cfg.relative_attention_num_buckets, dropout=cfg.dropout_rate,
                   tied=bool(cfg.tie_word_embeddings), gated=bool(getattr(cfg, "is_gated_act", False)),
                   eager=asks_for_eager(cfg))

    @property
    def inner(self) -> int:
        return self.heads * self.d_kv


def declare_params(e: Engine, d: T5Spec, num_layers: int) -> None:
    h, inner = d.d_model, d.inner
    e.param("shared", (d.vocab, h))
    for stack, cross in (("encoder", False), ("decoder", True)):
        for i in range(num_layers):
            p = f"{stack}.{i}."
            for name in ("q", "k", "v"):
                e.param(p + "self." + name, (inner, h))
            e.param(p + "self.o", (h, inner))
            if i == 0:
                e.param(p + "self.bias", (d.buckets, d.heads))
            e.param(p + "self.ln", (h,))
            if cross:
                for name in ("q", "k", "v"):
                    e.param(p + "cross." + name, (inner, h))
                e.param(p + "cross.o", (h, inner))
                e.param(p + "cross.ln", (h,))
            e.param(p + "wi", (d.d_ff, h))
            e.param(p + "wo", (h, d.d_ff))
            e.param(p + "ff.ln", (h,))
        e.param(stack + ".final_ln", (h,))
    if not d.tied:
        e.param("lm_head", (d.vocab, h))


def declare_buffers(e: Engine, d: T5Spec) -> list[Sym]:
    return []


def layer_norm(e: Engine, x: Sym, w) -> Sym:
    """T5LayerNorm: variance in float32, x * rsqrt(variance + eps), cast to a half weight's dtype, * weight."""
    var = ops.reduce_last(e, ops.pow_scalar(e, ops.cast(e, x, "float32")), x.numel)
    r = ops.unary_saving_output(e, ops.shift(e, var), "rsqrt")
    del var
    h = ops.mul(e, x, r)
    del r
    if w.dtype != h.dtype and w.dtype in ("bfloat16", "float16"):
        h = ops.cast(e, h, w.dtype)
    return ops.mul(e, w, h)


def relative_bias(e: Engine, d: T5Spec, q_len: int, kv_len: int, name: str) -> Sym:
    """compute_bias: bucket the relative positions, embed them: (1, heads, q, k) as a permuted view."""
    relative = e.new(q_len * kv_len, "int64")
    temps = [e.new(q_len * kv_len, "int64") for _ in range(_BUCKET_TEMPS - 1)]
    del temps
    buckets = e.new(q_len * kv_len, "int64")
    del relative
    values = ops.embedding(e, buckets, e.params[name], d.heads)
    return View(values, values.numel)


def position_mask(e: Engine, bias: Sym, q_len: int, kv_len: int, causal: bool, contiguous: bool) -> Sym:
    """create_position_bias_mask: the bias (with -inf above the diagonal when causal), made contiguous."""
    if causal:
        allowed = e.new(q_len * kv_len, "bool")
        mask = e.record(e.new(bias.numel, bias.dtype), [bias], [allowed])   # torch.where(causal, bias, min)
        return mask
    return bias if contiguous else ops.copy(e, bias)


def attention(e: Engine, x: Sym, source: Sym, d: T5Spec, p: str, *, batch: int, q_len: int, kv_len: int,
              bias: Sym | None, causal: bool, cache: dict | None, cache_key,
              causal_mask: Sym | None) -> tuple[Sym, Sym]:
    """T5Attention; `causal_mask`: eager attention's float causal mask (decoder self-attention), else None."""
    q = ops.linear(e, x, e.params[p + "q"], d.inner)
    if cache is not None and cache_key[0] == "cross" and cache_key in cache:
        k, v = cache[cache_key].for_attention(e)
    else:
        k = ops.linear(e, source, e.params[p + "k"], d.inner)
        v = ops.linear(e, source, e.params[p + "v"], d.inner)
        if cache is not None:
            k, v = grow_cache(e, cache, cache_key, k, v, batch * d.inner, kv_len)
    fresh = bias is None
    if bias is None:
        if (p + "bias") in e.params:
            bias = relative_bias(e, d, q_len, kv_len, p + "bias")
        else:
            bias = e.new(d.heads * q_len * kv_len, q.dtype)   # zeros: no relative bias in cross-attention
    shape: dict[str, Any] = dict(batch=batch, heads=d.heads, q_len=q_len, kv_len=kv_len, head_dim=d.d_kv,
                 dropout_p=d.dropout if e.policy.train else 0.0)
    if d.eager:
        out = eager_attention(e, q, k, v, **shape, masks=(bias,) if causal_mask is None else (bias, causal_mask))[0]
    else:
        mask = position_mask(e, bias, q_len, kv_len, causal and q_len > 1,
                             contiguous=not (fresh and (p + "bias") in e.params))
        out = ops.sdpa(e, q, k, v, **shape, mask=mask)
        del mask
    del q, k, v
    return ops.linear(e, out, e.params[p + "o"], d.d_model), bias


def feed_forward(e: Engine, x: Sym, d: T5Spec, p: str) -> Sym:
    normed = layer_norm(e, x, e.params[p + "ff.ln"])
    h = ops.linear(e, normed, e.params[p + "wi"], d.d_ff)
    h = ops.unary_saving_output(e, h, "relu")
    h = ops.dropout(e, h, d.dropout)
    wo = e.params[p + "wo"]
    if h.dtype != wo.dtype:   # T5DenseActDense casts to wo's dtype before wo
        h = ops.cast(e, h, wo.dtype)
    h = ops.linear(e, h, wo, d.d_model)
    del normed
    return ops.add(e, x, ops.dropout(e, h, d.dropout))


def block(e: Engine, x: Sym, d: T5Spec, stack: str, i: int, *, batch: int, q_len: int, enc_len: int,
          bias: Sym | None, cross_bias: Sym | None, encoder_out: Sym | None, cache: dict | None, kv_len: int,
          causal_mask: Sym | None):
    p = f"{stack}.{i}."
    normed = layer_norm(e, x, e.params[p + "self.ln"])
    attn, bias = attention(e, normed, normed, d, p + "self.", batch=batch, q_len=q_len, kv_len=kv_len, bias=bias,
                           causal=stack == "decoder", cache=cache, cache_key=("self", i),
                           causal_mask=causal_mask)
    del normed
    x = ops.add(e, x, ops.dropout(e, attn, d.dropout))
    del attn
    if encoder_out is not None:
        normed = layer_norm(e, x, e.params[p + "cross.ln"])
        attn, cross_bias = attention(e, normed, encoder_out, d, p + "cross.", batch=batch, q_len=q_len,
                                     kv_len=enc_len, bias=cross_bias, causal=False, cache=cache,
                                     cache_key=("cross", i), causal_mask=None)
        del normed
        x = ops.add(e, x, ops.dropout(e, attn, d.dropout))
        del attn
    return feed_forward(e, x, d, p), bias, cross_bias


def run_stack(e: Engine, d: T5Spec, stack: str, num_layers: int, ids: Sym, *, batch: int, q_len: int,
              encoder_out: Sym | None = None, enc_len: int = 0, cache: dict | None = None,
              kv_len: int | None = None) -> Sym:
    inputs_embeds = ops.embedding(e, ids, e.params["shared"], d.d_model)
    kv_len = kv_len or q_len
    causal = d.eager and stack == "decoder" and q_len > 1    # create_causal_mask: a float mask for eager attention
    causal_mask = e.new(batch * q_len * kv_len, inputs_embeds.dtype) if causal else None
    x = ops.dropout(e, inputs_embeds, d.dropout)
    bias = cross_bias = None
    for i in range(num_layers):
        e.segment = (stack, i)
        x, bias, cross_bias = e.block(i, partial(block, e, d=d, stack=stack, i=i, batch=batch, q_len=q_len,
                                                 enc_len=enc_len, bias=bias, cross_bias=cross_bias,
                                                 encoder_out=encoder_out, cache=cache, kv_len=kv_len,
                                                 causal_mask=causal_mask), x)
    e.segment = "post" if stack == "decoder" else "mid"
    x = layer_norm(e, x, e.params[stack + ".final_ln"])
    del bias, cross_bias, inputs_embeds, causal_mask
    return ops.dropout(e, x, d.dropout)


def train(e: Engine, d: T5Spec, num_layers: int, batch: int, seq: int) -> Sym:
    ids = e.input(batch * seq, "int64")
    e.input(batch * seq, "int64")   # labels
    e.segment = "pre"
    encoder_out = run_stack(e, d, "encoder", num_layers, ids, batch=batch, q_len=seq)
    decoder_ids = e.new(batch * seq, "int64")   # _shift_right(labels)
    decoder_out = run_stack(e, d, "decoder", num_layers, decoder_ids, batch=batch, q_len=seq,
                            encoder_out=encoder_out, enc_len=seq)
    if d.tied:
        decoder_out = ops.scalar_op(e, decoder_out)   # * d_model ** -0.5
    logits = ops.linear(e, decoder_out, e.params["shared" if d.tied else "lm_head"], d.vocab)
    loss = ops.cross_entropy(e, logits, batch=batch, seq=seq, shift=False, upcast=False)
    del logits, decoder_out, encoder_out, decoder_ids
    return loss


def inference(e: Engine, d: T5Spec, num_layers: int, batch: int, seq: int, new_tokens: int) -> None:
    """The encoder and the first decoder token (prefill), then decoder steps with the self- and
    cross-attention caches; the last step holds the longest self-attention cache."""
    ids = e.input(batch * seq, "int64")
    e.set_phase("prefill")
    encoder_out = run_stack(e, d, "encoder", num_layers, ids, batch=batch, q_len=seq)
    cache: dict = {}

    def decode(tokens: int):
        token = e.new(batch, "int64")
        out = run_stack(e, d, "decoder", num_layers, token, batch=batch, q_len=1, encoder_out=encoder_out,
                        enc_len=seq, cache=cache, kv_len=tokens)
        if d.tied:
            out = ops.scalar_op(e, out)
        return ops.linear(e, out, e.params["shared" if d.tied else "lm_head"], d.vocab)

    logits = decode(1)
    del logits
    if new_tokens:
        e.set_phase("decode")
        logits = decode(2)
        del logits
        if new_tokens > 1:
            replace_cache(e, cache, {("self", i): new_tokens for i in range(num_layers)})
            logits = decode(new_tokens + 1)
            del logits
