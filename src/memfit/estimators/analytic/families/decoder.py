"""Decoder-only LLMs with rotary attention: LLaMA, Mistral, Qwen2, Mixtral (MoE), Phi-3, Gemma-2.

Mirrors transformers 5.x: RMSNorm computed in float32, q/k/v projections (fused for Phi-3), rotary
embeddings, SDPA with grouped-query attention (eager attention with logit soft-capping for
Gemma-2), SwiGLU/GeGLU MLP or top-k routed experts (grouped_mm path), a final norm, the LM head
and Hugging Face's causal-LM loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar, cast

from memfit.estimators.analytic import ops
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.families.common import (
    CachedKV,
    asks_for_eager,
    chunked_lm_loss,
    generate,
    grow_cache,
    lm_head,
    replace_cache,
)
from memfit.estimators.analytic.families.moe import experts
from memfit.estimators.analytic.symbols import Sym, View


@dataclass(frozen=True)
class Variant:
    """How an architecture's decoder differs from Llama's (transformers' modeling_<model_type>.py)."""

    fused_projections: bool = False   # q/k/v in one qkv_proj, gate/up in one gate_up_proj; rotary copies (Phi-3)
    qkv_bias: bool = False            # q, k and v projections carry a bias, o does not (Qwen2)
    window_opt_in: bool = False       # the sliding window applies only with use_sliding_window (Qwen2)
    alternating_window: bool = False  # every other layer slides its window (Gemma-2)
    sandwich_norms: bool = False      # a norm after attention and around the MLP too (Gemma-2)
    unit_offset_norm: bool = False    # RMSNorm scales by (1 + weight) in float32, then casts (Gemma-2)
    scaled_embeddings: bool = False   # embeddings * sqrt(hidden) (Gemma-2)
    softcap: bool = False             # tanh soft-capping of attention scores and final logits (Gemma-2)
    eager_only: bool = False          # soft-capped attention runs eagerly, with float masks (Gemma-2)


# The model types this family runs, each with its variant (the families registry reads FAMILIES)
VARIANTS = {
    "llama": Variant(), "mistral": Variant(), "mixtral": Variant(),
    "qwen2": Variant(qkv_bias=True, window_opt_in=True),
    "phi3": Variant(fused_projections=True),
    "gemma2": Variant(alternating_window=True, sandwich_norms=True, unit_offset_norm=True, scaled_embeddings=True,
                      softcap=True, eager_only=True),
}
FAMILIES = tuple(VARIANTS)
# Hugging Face module names -> this program's parameter names (LoRA targets, techniques/adapters.py)
MODULE_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
                "down_proj": "down", "qkv_proj": "qkv", "gate_up_proj": "gate_up"}


@dataclass(frozen=True)
class DecoderSpec:
    causal: ClassVar[bool] = True   # a decoder: each token attends to those before it
    variant: Variant
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    experts: int = 0
    top_k: int = 0
    sliding_window: int | None = None
    sliding_pattern: tuple[bool, ...] = (False,)   # per layer in a period: uses the sliding window
    attn_dropout: float = 0.0
    eager: bool = False                            # eager attention (scores materialised) instead of SDPA

    @classmethod
    def from_config(cls, cfg) -> DecoderSpec:
        variant = VARIANTS[cfg.model_type]
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        window = getattr(cfg, "sliding_window", None)
        if variant.window_opt_in and not getattr(cfg, "use_sliding_window", False):
            window = None
        pattern: tuple[bool, ...] = (False,)
        if variant.alternating_window:
            pattern = (True, False)
        elif window:
            pattern = (True,)
        bias = getattr(cfg, "attention_bias", False)
        return cls(
            variant=variant, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
            intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, tied=bool(cfg.tie_word_embeddings),
            qkv_bias=bias or variant.qkv_bias, o_bias=bias and not variant.qkv_bias,
            mlp_bias=getattr(cfg, "mlp_bias", False),
            experts=getattr(cfg, "num_local_experts", 0) or 0, top_k=getattr(cfg, "num_experts_per_tok", 0) or 0,
            sliding_window=window, sliding_pattern=pattern,
            attn_dropout=getattr(cfg, "attention_dropout", 0.0) or 0.0,
            eager=variant.eager_only or asks_for_eager(cfg),
        )

    @property
    def period(self) -> int:
        return len(self.sliding_pattern)


# ---- parameters -------------------------------------------------------------------------------
def declare_params(e: Engine, d: DecoderSpec, num_layers: int) -> None:
    """Every parameter in the model's own order (the optimizer walks them in this order)."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    e.param("embed", (d.vocab, h))
    for i in range(num_layers):
        p = f"layers.{i}."
        if d.variant.fused_projections:
            e.param(p + "qkv", (q + 2 * kv, h))
        else:
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                e.param(p + name, (size, h))
                if d.qkv_bias:
                    e.param(p + name + ".bias", (size,))
        e.param(p + "o", (h, q))
        if d.o_bias:
            e.param(p + "o.bias", (h,))
        if d.experts:
            e.param(p + "router", (d.experts, h))
            e.param(p + "experts.gate_up", (d.experts, 2 * d.intermediate, h))
            e.param(p + "experts.down", (d.experts, h, d.intermediate))
        elif d.variant.fused_projections:
            e.param(p + "gate_up", (2 * d.intermediate, h))
            e.param(p + "down", (h, d.intermediate))
        else:
            e.param(p + "gate", (d.intermediate, h))
            e.param(p + "up", (d.intermediate, h))
            e.param(p + "down", (h, d.intermediate))
            if d.mlp_bias:
                for name, size in (("gate.bias", d.intermediate), ("up.bias", d.intermediate), ("down.bias", h)):
                    e.param(p + name, (size,))
        for norm in _norm_names(d):
            e.param(p + norm, (h,))
    e.param("norm", (h,))
    if not d.tied:
        e.param("lm_head", (d.vocab, h))


def _norm_names(d: DecoderSpec) -> tuple[str, ...]:
    if d.variant.sandwich_norms:
        return ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm")
    return ("input_norm", "post_attn_norm")


# ---- building blocks ----------------------------------------------------------------------------
def rms_norm(e: Engine, x: Sym, w, d: DecoderSpec) -> Sym:
    """x.float() * rsqrt(mean(x.float() ** 2) + eps), then weight * normed.to(x.dtype); Gemma-2 scales by
    (1 + weight.float()) and casts back afterwards."""
    x32 = ops.cast(e, x, "float32")
    r = ops.unary_saving_output(e, ops.shift(e, ops.reduce_last(e, ops.pow_scalar(e, x32), d.hidden)), "rsqrt")
    normed = ops.mul(e, x32, r)
    del r, x32
    if d.variant.unit_offset_norm:
        scale = ops.shift(e, ops.cast(e, w, "float32"))
        return ops.cast(e, ops.mul(e, normed, scale), x.dtype)
    return ops.mul(e, w, ops.cast(e, normed, x.dtype))


def rotary(e: Engine, x: Sym, cos: Sym, sin: Sym, passthrough: bool) -> Sym:
    """q * cos + rotate_half(q) * sin; rotate_half is cat(-x[..., d/2:], x[..., :d/2])."""
    with_cos = ops.mul(e, x, cos)
    rotated = ops.cat(e, [ops.scalar_op(e, View(x, x.numel // 2)), View(x, x.numel // 2)])
    with_sin = ops.mul(e, rotated, sin)
    del rotated
    out = ops.add(e, with_cos, with_sin)
    if passthrough:   # cat([rotated, pass-through]) copies even when nothing passes through
        out = ops.cat(e, [out])
    return out


def attention(e: Engine, x: Sym, cos: Sym, sin: Sym, d: DecoderSpec, layer: int, batch: int, q_len: int,
              cache: dict | None, kv_len: int, masks: dict) -> tuple[Sym, Sym | None]:
    p = f"layers.{layer}."
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
    q = rotary(e, q, cos, sin, d.variant.fused_projections)
    k = rotary(e, k, cos, sin, d.variant.fused_projections)
    if cache is not None:
        k, v = _cache_update(e, cache, layer, k, v, d, batch, kv_len)
    mask = masks.get("sliding" if _is_sliding(d, layer) else "full")
    masked = mask is not None
    weights = None
    if d.eager:
        out, weights = _eager_attention(e, q, k, v, d, batch, q_len, kv_len, mask)
    else:
        kv_heads = d.kv_heads
        if d.kv_heads != d.heads and (masked or d.head_dim > 256) and q_len > 1:
            k = ops.copy(e, View(k, k.numel * (d.heads // d.kv_heads)))   # repeat_kv
            v = ops.copy(e, View(v, v.numel * (d.heads // d.kv_heads)))
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
    if not _is_sliding(d, layer):
        return grow_cache(e, cache, layer, k, v, width, kv_len)
    old = cache.pop(layer, None)   # both cats first, then the views replace the old tensors
    tokens = k.numel // width
    if old is not None:
        tokens += min(old.tokens, cast(int, d.sliding_window) - 1)   # sliding: a window is set
    new = cache[layer] = CachedKV(width, tokens, (k.dtype, v.dtype))
    new.store(e)
    del old
    return new.for_attention(e)


def _is_sliding(d: DecoderSpec, layer: int) -> bool:
    return bool(d.sliding_window) and d.sliding_pattern[layer % d.period]


def _eager_attention(e: Engine, q: Sym, k: Sym, v: Sym, d: DecoderSpec, batch: int, q_len: int, kv_len: int,
                     mask: Sym | None) -> tuple[Sym, Sym]:
    """transformers' eager attention: repeat_kv, scores (tanh soft-capped for Gemma-2), float32 softmax,
    weights @ v. Returns (output, attention weights): the caller keeps the weights until its layer returns."""
    groups = d.heads // d.kv_heads
    k_r = ops.copy(e, View(k, k.numel * groups)) if groups > 1 else k
    v_r = ops.copy(e, View(v, v.numel * groups)) if groups > 1 else v
    rows = batch * d.heads * q_len
    k_t = ops.copy(e, k_r)                      # key.transpose(2, 3) made contiguous for the batched matmul
    scores = ops.matmul(e, q, k_t, rows * kv_len)
    del k_t
    scores = ops.scalar_op(e, scores)           # * scaling
    if d.variant.softcap:
        scores = ops.scalar_op(e, scores)           # / softcap
        scores = ops.unary_saving_output(e, scores, "tanh")
        scores = ops.scalar_op(e, scores)           # * softcap
    if mask is not None:
        scores = ops.add(e, scores, mask)
    weights = ops.cast(e, ops.softmax(e, scores, "softmax", dtype="float32"), q.dtype)
    del scores
    out = ops.matmul(e, weights, v_r, rows * d.head_dim)
    del v_r, k_r
    return ops.copy(e, out), weights            # transpose(1, 2).contiguous()


def mlp(e: Engine, x: Sym, d: DecoderSpec, layer: int, tokens: int) -> Sym:
    p = f"layers.{layer}."
    if d.experts:
        return experts(e, x, d, layer, tokens)
    if d.variant.fused_projections:
        gate_up = ops.linear(e, x, e.params[p + "gate_up"], 2 * d.intermediate)
        del x
        act = ops.unary_saving_input(e, View(gate_up, gate_up.numel // 2))
        hidden = ops.mul(e, View(gate_up, gate_up.numel // 2), act)
        del act, gate_up
    else:
        gate = ops.linear(e, x, e.params[p + "gate"], d.intermediate, e.params.get(p + "gate.bias"))
        act = ops.unary_saving_input(e, gate)
        del gate
        up = ops.linear(e, x, e.params[p + "up"], d.intermediate, e.params.get(p + "up.bias"))
        del x
        hidden = ops.mul(e, act, up)
        del act, up
    return ops.linear(e, hidden, e.params[p + "down"], d.hidden, e.params.get(p + "down.bias"))


def decoder_layer(e: Engine, x: Sym, cos: Sym, sin: Sym, d: DecoderSpec, layer: int, batch: int, q_len: int,
                  cache: dict | None, kv_len: int, masks: dict) -> Sym:
    p = f"layers.{layer}."
    residual = x
    h = rms_norm(e, x, e.params[p + "input_norm"], d)
    del x
    h, _weights = attention(e, h, cos, sin, d, layer, batch, q_len, cache, kv_len, masks)  # held till return
    if d.variant.sandwich_norms:
        h = rms_norm(e, h, e.params[p + "post_attn_norm"], d)
    h = ops.add(e, residual, h)
    residual = h
    h = rms_norm(e, h, e.params[p + ("pre_ff_norm" if d.variant.sandwich_norms else "post_attn_norm")], d)
    h = mlp(e, h, d, layer, batch * q_len)
    if d.variant.sandwich_norms:
        h = rms_norm(e, h, e.params[p + "post_ff_norm"], d)
    return ops.add(e, residual, h)


def attention_masks(e: Engine, d: DecoderSpec, batch: int, q_len: int, kv_len: int, dtype: str) -> dict:
    """Masks built once per forward. SDPA models rely on is_causal and need none, except a sliding
    window shorter than the keys (a boolean mask); Gemma-2's eager attention adds float masks."""
    masks = {}
    if d.eager:
        if q_len > 1 or d.variant.eager_only:
            masks["full"] = e.new(batch * q_len * kv_len, dtype)
        if d.sliding_window:
            masks["sliding"] = e.new(batch * q_len * kv_len, dtype)
        return masks
    if d.sliding_window and kv_len >= d.sliding_window and q_len > 1:
        masks["sliding"] = e.new(batch * q_len * kv_len, "bool")
    return masks


def forward(e: Engine, d: DecoderSpec, num_layers: int, *, batch: int, q_len: int, labels: bool,
            cache: dict | None = None, kv_len: int | None = None, logits_to_keep: int = 0,
            first: bool = True, last: bool = True, stage_outputs: list | None = None) -> Sym:
    """The model's forward; returns the loss (training) or the logits (inference). A pipeline stage
    (techniques/pipeline.py) that is not the `first` takes the previous rank's hidden states instead of
    the embeddings; one that is not the `last` returns its hidden states; the last keeps its logits (the
    stage's output, which the schedule holds until the micro-batch's backward) in `stage_outputs`."""
    kv_len = kv_len or q_len
    e.segment = "pre"
    if first:
        ids = e.input(batch * q_len, "int64")
        x = ops.embedding(e, ids, e.params["embed"], d.hidden)
    else:   # received from the previous rank, a leaf whose gradient is sent back
        x = e.new(batch * q_len * d.hidden, e.policy.param_dtype, grad=True)
    if d.variant.scaled_embeddings:
        x = ops.scalar_op(e, x)   # embeddings * sqrt(hidden)
    inputs_embeds = x              # the model's forward keeps its embeddings until it returns
    compute = x.dtype
    cos, sin = e.new(q_len * d.head_dim, compute), e.new(q_len * d.head_dim, compute)
    masks = attention_masks(e, d, batch, q_len, kv_len, compute)
    for layer in range(num_layers):
        e.segment = (0, layer)
        x = e.block(layer, partial(decoder_layer, e, cos=cos, sin=sin, d=d, layer=layer, batch=batch, q_len=q_len,
                                   cache=cache, kv_len=kv_len, masks=masks), x)
    e.segment = "post"
    if not last:
        return x
    hidden = rms_norm(e, x, e.params["norm"], d)
    del x, cos, sin, masks, inputs_embeds
    if labels and e.policy.loss_chunks:
        e.input(batch * q_len, "int64")   # labels
        loss = chunked_lm_loss(e, hidden, _head(e), d.vocab, batch=batch, seq=q_len,
                               chunks=e.policy.loss_chunks, softcap=d.variant.softcap)
        del hidden
        return loss
    logits = lm_head(e, hidden, _head(e), d.vocab, batch=batch, q_len=q_len,
                     logits_to_keep=logits_to_keep)
    if d.variant.softcap:   # final logit soft-capping: / cap, tanh, * cap
        logits = ops.scalar_op(e, logits)
        logits = ops.unary_saving_output(e, logits, "tanh")
        logits = ops.scalar_op(e, logits)
    if not labels:
        return logits
    e.input(batch * q_len, "int64")   # labels
    loss = ops.cross_entropy(e, logits, batch=batch, seq=q_len, shift=True)
    if stage_outputs is not None:
        stage_outputs.append(logits)
    del logits, hidden
    return loss


def _head(e: Engine):
    """The LM head's weight: its own, or the embeddings' when tied (quantization gives a tied head its own)."""
    return e.params["lm_head"] if "lm_head" in e.params else e.params["embed"]


def declare_buffers(e: Engine, d: DecoderSpec) -> list[Sym]:
    # rotary inv_freq and original_inv_freq: head_dim / 2 floats each
    return [e.new(d.head_dim // 2, "float32", category="buffers") for _ in range(2)]


def train(e: Engine, d: DecoderSpec, num_layers: int, batch: int, seq: int, *, first: bool = True,
          last: bool = True, stage_outputs: list | None = None) -> Sym:
    return forward(e, d, num_layers, batch=batch, q_len=seq, labels=True, first=first, last=last,
                   stage_outputs=stage_outputs)


def inference(e: Engine, d: DecoderSpec, num_layers: int, batch: int, seq: int, new_tokens: int) -> None:
    """Prefill, the first decode step (a sliding-window cache still holds the prefill's storage) and the
    last one (the longest cache)."""
    def run(cache, q_len, kv_len, keep):
        return forward(e, d, num_layers, batch=batch, q_len=q_len, labels=False, cache=cache, kv_len=kv_len,
                       logits_to_keep=keep)

    def resize(cache, tokens):
        # a sliding-window layer holds the storage of the previous step's cat: its window plus one token
        replace_cache(e, cache, {layer: min(tokens - 1, d.sliding_window - 1) + 1 if _is_sliding(d, layer) else tokens
                                 for layer in range(num_layers)})

    generate(e, run, batch=batch, seq=seq, new_tokens=new_tokens, resize_cache=resize)
