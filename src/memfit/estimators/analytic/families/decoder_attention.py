"""The attention of the decoder family (decoder.py): RMSNorm and rotary as each variant computes them, the KV cache
update, SDPA or eager attention (Gemma 2's soft-capping, gpt-oss's sinks), and DeepSeek's multi-head latent attention
(its sizes: `Latent`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from memfit.estimators.analytic import ops
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.families.common import CachedKV, grow_cache
from memfit.estimators.analytic.symbols import Param, Sym, View

if TYPE_CHECKING:
    from memfit.estimators.analytic.families.decoder import DecoderSpec


@dataclass(frozen=True)
class Latent:
    """DeepSeek's multi-head latent attention: queries through a rank-`q_rank` bottleneck (0: one projection), keys
    and values expanded from a cached rank-`kv_rank` latent plus one shared rotary key of `rope` elements; each
    head's key is `nope` + `rope` wide, its value `v_dim`."""

    q_rank: int
    kv_rank: int
    nope: int
    rope: int
    v_dim: int
    interleave: bool   # rotary over even/odd pairs (config.rope_interleave)

    @property
    def qk(self) -> int:
        return self.nope + self.rope

    @classmethod
    def of(cls, cfg) -> Latent | None:
        if not getattr(cfg, "kv_lora_rank", None):
            return None
        return cls(q_rank=cfg.q_lora_rank or 0, kv_rank=cfg.kv_lora_rank, nope=cfg.qk_nope_head_dim,
                   rope=cfg.qk_rope_head_dim, v_dim=cfg.v_head_dim, interleave=bool(getattr(cfg, "rope_interleave",
                                                                                          False)))


def declare_latent(e: Engine, d: DecoderSpec, p: str, lat: Latent) -> None:
    h, bias = d.hidden, d.o_bias   # attention_bias: the down projections and o carry one
    if lat.q_rank:
        e.param(p + "q_a", (lat.q_rank, h))
        if bias:
            e.param(p + "q_a.bias", (lat.q_rank,))
        e.param(p + "q_a_norm", (lat.q_rank,))
        e.param(p + "q_b", (d.heads * lat.qk, lat.q_rank))
    else:
        e.param(p + "q", (d.heads * lat.qk, h))
    e.param(p + "kv_a", (lat.kv_rank + lat.rope, h))
    if bias:
        e.param(p + "kv_a.bias", (lat.kv_rank + lat.rope,))
    e.param(p + "kv_a_norm", (lat.kv_rank,))
    e.param(p + "kv_b", (d.heads * (lat.nope + lat.v_dim), lat.kv_rank))
    e.param(p + "o", (h, d.heads * lat.v_dim))


def rms_norm(e: Engine, x: Sym, w, d: DecoderSpec, width: int | None = None) -> Sym:
    """x.float() * rsqrt(mean(x.float() ** 2) + eps), then weight * normed.to(x.dtype) over the last `width`
    (default: hidden) elements; Gemma scales by (1 + weight.float()) and casts back afterwards, OLMo 2 casts
    weight * normed."""
    x32 = ops.cast(e, x, "float32")
    r = ops.unary_saving_output(e, ops.shift(e, ops.reduce_last(e, ops.pow_scalar(e, x32), width or d.hidden)),
                                "rsqrt")
    normed = ops.mul(e, x32, r)
    del r, x32
    if d.variant.unit_offset_norm:
        scale = ops.shift(e, ops.cast(e, w, "float32"))
        return ops.cast(e, ops.mul(e, normed, scale), x.dtype)
    if d.variant.norm_casts_product:
        return ops.cast(e, ops.mul(e, w, normed), x.dtype)
    return ops.mul(e, w, ops.cast(e, normed, x.dtype))


def rotary(e: Engine, x: Sym, cos: Sym, sin: Sym, passthrough: bool, halves: bool = False) -> Sym:
    """q * cos + rotate_half(q) * sin; rotate_half is cat(-x[..., d/2:], x[..., :d/2]). `halves` (gpt-oss): tables of
    half the head, cat(first * cos - second * sin, second * cos + first * sin)."""
    if halves:
        first, second = View(x, x.numel // 2), View(x, x.numel // 2)
        out_first = ops.add(e, ops.mul(e, first, cos), ops.mul(e, second, sin))
        out_second = ops.add(e, ops.mul(e, second, cos), ops.mul(e, first, sin))
        return ops.cat(e, [out_first, out_second])
    with_cos = ops.mul(e, x, cos)
    rotated = ops.cat(e, [ops.scalar_op(e, View(x, x.numel // 2)), View(x, x.numel // 2)])
    with_sin = ops.mul(e, rotated, sin)
    del rotated
    out = ops.add(e, with_cos, with_sin)
    if passthrough:   # cat([rotated, pass-through]) copies even when nothing passes through
        out = ops.cat(e, [out])
    return out


def latent_attention(e: Engine, x: Sym, cos: Sym, sin: Sym, d: DecoderSpec, lat: Latent, layer: int, batch: int,
                     q_len: int, cache: dict | None, kv_len: int, masks: dict) -> Sym:
    """DeepseekV3Attention: queries through the rank-q bottleneck (its RMSNorm between), the latent and the shared
    rotary key from one projection (the latent normed), rotary on the queries' and the key's rotary parts, the cache
    updated with the compressed latent and rotary key, the query rebuilt by cat, keys and values expanded from the
    whole cache (kv_b over every cached token, keys copied into a new tensor), SDPA with values narrower than keys,
    then o."""
    p = f"layers.{layer}."
    tokens, width = batch * q_len, d.heads * lat.qk
    if lat.q_rank:
        a = ops.linear(e, x, e.params[p + "q_a"], lat.q_rank, e.params.get(p + "q_a.bias"))
        a = rms_norm(e, a, e.params[p + "q_a_norm"], d, lat.q_rank)
        q = ops.linear(e, a, e.params[p + "q_b"], width)
        del a
    else:
        q = ops.linear(e, x, e.params[p + "q"], width)
    compressed = ops.linear(e, x, e.params[p + "kv_a"], lat.kv_rank + lat.rope, e.params.get(p + "kv_a.bias"))
    del x
    latent = rms_norm(e, View(compressed, tokens * lat.kv_rank), e.params[p + "kv_a_norm"], d, lat.kv_rank)
    q_rot = rotary(e, View(q, tokens * d.heads * lat.rope), cos, sin, False, lat.interleave)
    k_rot = rotary(e, View(compressed, tokens * lat.rope), cos, sin, False, lat.interleave)
    del compressed
    if cache is not None:   # the cache holds the latent (keys) and the rotary key (values)
        latent, k_rot = grow_cache(e, cache, layer, latent, k_rot, batch * lat.kv_rank, kv_len, batch * lat.rope)
    query = ops.cat(e, [View(q, tokens * d.heads * lat.nope), q_rot])
    del q, q_rot
    cached = batch * kv_len
    kv = ops.linear(e, latent, e.params[p + "kv_b"], d.heads * (lat.nope + lat.v_dim))
    key = e.new(cached * width, kv.dtype, grad=True)             # new_empty, filled by copy_ of k_nope and k_rot
    key = e.record(key, [kv, k_rot], [], passthrough=True)
    value = View(kv, cached * d.heads * lat.v_dim)
    del latent, k_rot, kv
    if d.eager:
        out, _weights = _eager_attention(e, query, key, value, d, batch, q_len, kv_len, masks.get("full"),
                                         out_dim=lat.v_dim)
    else:
        out = ops.sdpa(e, query, key, value, batch=batch, heads=d.heads, q_len=q_len, kv_len=kv_len, head_dim=lat.qk,
                       dropout_p=d.attn_dropout if e.policy.train else 0.0, causal=q_len > 1,
                       value_head_dim=lat.v_dim)
    del query, key, value
    return ops.linear(e, out, e.params[p + "o"], d.hidden, e.params.get(p + "o.bias"))


def attention(e: Engine, x: Sym, cos: Sym, sin: Sym, d: DecoderSpec, layer: int, batch: int, q_len: int,
              cache: dict | None, kv_len: int, masks: dict) -> tuple[Sym, Sym | None]:
    p = f"layers.{layer}."
    if d.latent:
        return latent_attention(e, x, cos, sin, d, d.latent, layer, batch, q_len, cache, kv_len, masks), None
    q_size, kv_size = d.heads * d.head_dim, d.kv_heads * d.head_dim
    q: Sym
    k: Sym
    v: Sym
    if d.variant.fused_projections:
        qkv = ops.linear(e, x, e.params[p + "qkv"], q_size + 2 * kv_size)
        tokens = qkv.numel // (q_size + 2 * kv_size)
        q, k, v = View(qkv, tokens * q_size), View(qkv, tokens * kv_size), View(qkv, tokens * kv_size)
        del x, qkv
    else:
        q = ops.linear(e, x, e.params[p + "q"], q_size, e.params.get(p + "q.bias"))
        k = ops.linear(e, x, e.params[p + "k"], kv_size, e.params.get(p + "k.bias"))
        v = ops.linear(e, x, e.params[p + "v"], kv_size, e.params.get(p + "v.bias"))
        del x
    if d.variant.qk_norm:
        per_head = d.variant.qk_norm == "head"
        q = rms_norm(e, q, e.params[p + "q_norm"], d, d.head_dim if per_head else q_size)
        k = rms_norm(e, k, e.params[p + "k_norm"], d, d.head_dim if per_head else kv_size)
    q_dtype, k_dtype = q.dtype, k.dtype
    q = rotary(e, q, cos, sin, d.variant.fused_projections, d.variant.rotary_halves)
    k = rotary(e, k, cos, sin, d.variant.fused_projections, d.variant.rotary_halves)
    if d.variant.float32_rotary:
        q, k = ops.cast(e, q, q_dtype), ops.cast(e, k, k_dtype)
    if cache is not None:
        k, v = _cache_update(e, cache, layer, k, v, d, batch, kv_len)
    mask = masks.get("sliding" if is_sliding(d, layer) else "full")
    masked = mask is not None
    weights = None
    if d.eager:
        out, weights = _eager_attention(e, q, k, v, d, batch, q_len, kv_len, mask, e.params.get(p + "sinks"))
    else:
        kv_heads = d.kv_heads
        if d.kv_heads != d.heads and (masked or d.head_dim > 256) and q_len > 1:
            # repeat_kv: expand, then reshape, which copies unless a single key/value head lets it stay a view
            repeat = (lambda t: View(t, t.numel * d.heads)) if d.kv_heads == 1 else (
                lambda t: ops.copy(e, View(t, t.numel * (d.heads // d.kv_heads))))
            k, v = repeat(k), repeat(v)
            kv_heads = d.heads
        out = ops.sdpa(e, q, k, v, batch=batch, heads=d.heads, q_len=q_len, kv_len=kv_len, head_dim=d.head_dim,
                       dropout_p=d.attn_dropout if e.policy.train else 0.0, mask=mask, kv_heads=kv_heads)
    del q, k, v
    return ops.linear(e, out, e.params[p + "o"], d.hidden, e.params.get(p + "o.bias")), weights


def _cache_update(e: Engine, cache: dict, layer: int, k: Sym, v: Sym, d: DecoderSpec, batch: int, kv_len: int):
    """DynamicCache: keys = cat([keys, new]) allocates the grown cache; the old one is then freed.
    A sliding-window layer keeps a view of its last window - 1 tokens, so after the prefill its
    cache stops growing: each step allocates window tokens."""
    width = batch * d.kv_heads * d.head_dim
    if not is_sliding(d, layer):
        return grow_cache(e, cache, layer, k, v, width, kv_len)
    old = cache.pop(layer, None)   # both cats first, then the views replace the old tensors
    tokens = k.numel // width
    if old is not None:
        tokens += min(old.tokens, cast(int, d.sliding_window) - 1)   # sliding: a window is set
    new = cache[layer] = CachedKV(width, tokens, (k.dtype, v.dtype))
    new.store(e)
    del old
    return new.for_attention(e)


def is_sliding(d: DecoderSpec, layer: int) -> bool:
    return bool(d.sliding_window) and d.sliding_pattern[layer % d.period]


def _eager_attention(e: Engine, q: Sym, k: Sym, v: Sym, d: DecoderSpec, batch: int, q_len: int, kv_len: int,
                     mask: Sym | None, sinks: Param | None = None, out_dim: int | None = None) -> tuple[Sym, Sym]:
    """transformers' eager attention: repeat_kv, scores (tanh soft-capped for Gemma-2), float32 softmax (gpt-oss:
    the sinks joined as one more column, the row maximum subtracted, softmax in the logits' dtype, the sink column
    dropped), weights @ v. Returns (output, attention weights): the caller keeps the weights until its layer
    returns."""
    groups = d.heads // d.kv_heads
    k_r = ops.copy(e, View(k, k.numel * groups)) if groups > 1 else k
    v_r = ops.copy(e, View(v, v.numel * groups)) if groups > 1 else v
    rows = batch * d.heads * q_len
    k_t = ops.copy(e, k_r)                      # key.transpose(2, 3) made contiguous for the batched matmul
    scores = ops.matmul(e, q, k_t, rows * kv_len)
    del k_t
    scores = ops.scalar_op(e, scores)           # * scaling
    if d.variant.attention_softcap:
        scores = ops.scalar_op(e, scores)           # / softcap
        scores = ops.unary_saving_output(e, scores, "tanh")
        scores = ops.scalar_op(e, scores)           # * softcap
    if mask is not None:
        scores = ops.add(e, scores, mask)
    logits = None   # gpt-oss's combined logits: a local variable until the function returns
    if sinks is not None:
        weights, logits = _softmax_with_sinks(e, scores, sinks, rows, kv_len, v.dtype)
    else:
        weights = ops.cast(e, ops.softmax(e, scores, "softmax", dtype="float32"), q.dtype)
    del scores
    out = ops.matmul(e, weights, v_r, rows * (out_dim or d.head_dim))
    del v_r, k_r
    out = ops.copy(e, out)                      # transpose(1, 2).contiguous()
    del logits
    return out, weights


def _softmax_with_sinks(e: Engine, scores: Sym, sinks: Param, rows: int, kv_len: int, dtype: str) -> tuple[Sym, Sym]:
    """gpt-oss: cat([scores, sinks expanded]) (promoted to the wider dtype), minus its row maximum, softmax in that
    dtype, the sink column sliced off and cast to the values' dtype. Returns (weights, the shifted logits)."""
    if e.autocast_on:   # autocast promotes cat's inputs to the widest first: the scores to the float32 sinks'
        scores = ops.cast(e, scores, ops.promote(scores.dtype, sinks.dtype))
    combined = ops.cat(e, [scores, View(sinks, rows)])
    top, where = e.new(rows, combined.dtype), e.new(rows, "int64")
    top = e.record(top, [combined], [where])                    # max(dim=-1).values: backward scatters to the index
    shifted = ops.add(e, combined, top)                          # combined - max
    del combined, top, where
    probs = ops.softmax(e, shifted, "softmax", dtype=shifted.dtype)
    return ops.cast(e, View(probs, rows * kv_len), dtype), shifted
