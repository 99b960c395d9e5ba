"""Decoder-only LLMs with rotary attention: Llama, Mistral, Qwen2 and 3, Mixtral and Qwen3-MoE, Phi-3, Gemma 2 and 3,
OLMo 2, gpt-oss and DeepSeek-V3, each a `Variant` of one program.

Mirrors transformers 5.x: RMSNorm computed in float32, q/k/v projections (fused for Phi-3), rotary embeddings, SDPA
with grouped-query attention or eager attention, multi-head latent attention for DeepSeek (decoder_attention.py),
SwiGLU/GeGLU MLP or top-k routed experts (grouped_mm path, moe.py), a final norm, the LM head and Hugging Face's
causal-LM loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import ClassVar

from memfit.estimators.analytic import ops
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.families.common import (
    asks_for_eager,
    chunked_lm_loss,
    generate,
    lm_head,
    replace_cache,
)
from memfit.estimators.analytic.families.decoder_attention import (
    Latent,
    attention,
    declare_latent,
    is_sliding,
    rms_norm,
)
from memfit.estimators.analytic.families.moe import Router, expert_params, experts
from memfit.estimators.analytic.symbols import Sym, View


@dataclass(frozen=True)
class Variant:
    """How an architecture's decoder differs from Llama's (transformers' modeling_<model_type>.py). Which layers slide
    their window is the config's `layer_types` (Gemma 2 and 3, Qwen2 and 3), else every layer when it sets one."""

    fused_projections: bool = False   # q/k/v in one qkv_proj, gate/up in one gate_up_proj; rotary copies (Phi-3)
    qkv_bias: bool = False            # q, k and v projections carry a bias, o does not (Qwen2)
    norms: str = "pre"                # RMSNorms: "pre" before attention and MLP (Llama); "sandwich" before and after
    #                                   each (Gemma 2 and 3); "post" after each, none before (OLMo 2)
    qk_norm: str = ""                 # RMSNorm of queries and keys: "head" over each head's width (Qwen3, Gemma 3),
    #                                   "projection" over the projection's (OLMo 2)
    unit_offset_norm: bool = False    # RMSNorm scales by (1 + weight) in float32, then casts (Gemma 2 and 3)
    norm_casts_product: bool = False  # RMSNorm returns (weight * normed).to(dtype) (OLMo 2), not weight * normed.to()
    float32_rotary: bool = False      # cos and sin stay float32, the rotated queries and keys are cast back (OLMo 2)
    scaled_embeddings: bool = False   # embeddings * sqrt(hidden) (Gemma 2 and 3)
    attention_softcap: bool = False   # tanh soft-capping of attention scores (Gemma 2)
    eager_only: bool = False          # soft-capped attention runs eagerly, with float masks (Gemma 2)
    rope_per_layer_type: bool = False  # sliding and full layers have rotary tables of their own (Gemma 3)
    attention_sinks: bool = False     # a learned logit per head joins the eager softmax (gpt-oss)
    rotary_halves: bool = False       # rotary tables of half the head; each half rotated on its own (gpt-oss)


# The model types this family runs, each with its variant (the families registry reads FAMILIES)
_GEMMA = Variant(norms="sandwich", unit_offset_norm=True, scaled_embeddings=True)
VARIANTS = {
    "llama": Variant(), "mistral": Variant(), "mixtral": Variant(),
    "qwen2": Variant(qkv_bias=True),
    "qwen3": Variant(qk_norm="head"), "qwen3_moe": Variant(qk_norm="head"),
    "olmo2": Variant(norms="post", qk_norm="projection", norm_casts_product=True, float32_rotary=True),
    "phi3": Variant(fused_projections=True),
    "gemma2": replace(_GEMMA, attention_softcap=True, eager_only=True),
    "gemma3_text": replace(_GEMMA, qk_norm="head", rope_per_layer_type=True),
    "gpt_oss": Variant(norm_casts_product=True, attention_sinks=True, eager_only=True, rotary_halves=True),
    "deepseek_v3": Variant(),   # multi-head latent attention, shared experts: DecoderSpec.latent, .shared_experts
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
    router: Router = field(default_factory=Router)
    dense_intermediate: int = 0                    # a mixture's dense layers' MLP width (Qwen3-MoE's mlp_only_layers;
    #                                                0: `intermediate`, a dense model's)
    sliding_window: int | None = None
    # per layer in a period: uses the sliding window; runs the experts (a mixture: False for its dense layers)
    sliding_pattern: tuple[bool, ...] = (False,)
    experts_pattern: tuple[bool, ...] = (True,)
    attn_dropout: float = 0.0
    eager: bool = False                            # eager attention (scores materialised) instead of SDPA
    logit_softcap: bool = False                    # tanh soft-capping of the final logits (Gemma 2)
    latent: Latent | None = None                   # multi-head latent attention (DeepSeek-V3)
    shared_experts: int = 0                        # experts every token runs besides its routed ones (DeepSeek-V3)
    router_groups: int = 1                         # DeepSeek-V3's router: expert groups, and how many it keeps
    router_top_groups: int = 1

    @classmethod
    def from_config(cls, cfg) -> DecoderSpec:
        variant = VARIANTS[cfg.model_type]
        heads, layers = cfg.num_attention_heads, cfg.num_hidden_layers
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        window = getattr(cfg, "sliding_window", None)
        kinds = getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * layers
        sliding = [bool(window) and kind == "sliding_attention" for kind in kinds[:layers]]
        window = window if any(sliding) else None
        experts = getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0) or 0
        sparse_step, dense_layers = getattr(cfg, "decoder_sparse_step", 1) or 1, getattr(cfg, "mlp_only_layers", ())
        first_sparse = getattr(cfg, "first_k_dense_replace", 0) or 0   # DeepSeek's dense first layers
        runs_experts = [bool(experts) and i not in dense_layers and (i + 1) % sparse_step == 0 and i >= first_sparse
                        for i in range(layers)]
        sliding_pattern, experts_pattern = _periodic(sliding, runs_experts)
        bias = getattr(cfg, "attention_bias", False)
        return cls(
            variant=variant, hidden=cfg.hidden_size, layers=layers, heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
            intermediate=(getattr(cfg, "moe_intermediate_size", None) if experts else None) or cfg.intermediate_size,
            dense_intermediate=cfg.intermediate_size if experts else 0, vocab=cfg.vocab_size,
            tied=bool(cfg.tie_word_embeddings),
            qkv_bias=bias or variant.qkv_bias, o_bias=bias and not variant.qkv_bias,
            mlp_bias=getattr(cfg, "mlp_bias", False),
            experts=experts, top_k=(getattr(cfg, "num_experts_per_tok", 0) or 0) if experts else 0,
            router=Router.of(cfg),
            sliding_window=window, sliding_pattern=sliding_pattern, experts_pattern=experts_pattern,
            attn_dropout=getattr(cfg, "attention_dropout", 0.0) or 0.0,
            eager=variant.eager_only or asks_for_eager(cfg),
            logit_softcap=bool(getattr(cfg, "final_logit_softcapping", None)),
            latent=Latent.of(cfg), shared_experts=(getattr(cfg, "n_shared_experts", 0) or 0) if experts else 0,
            router_groups=getattr(cfg, "n_group", 1) or 1, router_top_groups=getattr(cfg, "topk_group", 1) or 1,
        )

    @property
    def period(self) -> int:
        return len(self.sliding_pattern)


def _periodic(*per_layer: list[bool]) -> tuple[tuple[bool, ...], ...]:
    """Per-layer lists cut to their shortest common period (the whole stack when none repeats): the depth
    extrapolation samples whole periods."""
    layers = list(zip(*per_layer))
    period = next(p for p in range(1, len(layers) + 1) if all(layers[i] == layers[i % p] for i in range(len(layers))))
    return tuple(tuple(column) for column in zip(*layers[:period]))


# ---- parameters -------------------------------------------------------------------------------
def declare_params(e: Engine, d: DecoderSpec, num_layers: int) -> None:
    """Every parameter in the model's own order (the optimizer walks them in this order)."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    e.param("embed", (d.vocab, h))
    for i in range(num_layers):
        p = f"layers.{i}."
        if d.variant.attention_sinks:
            e.param(p + "sinks", (d.heads,))
        if d.latent:
            declare_latent(e, d, p, d.latent)
        elif d.variant.fused_projections:
            e.param(p + "qkv", (q + 2 * kv, h))
        else:
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                e.param(p + name, (size, h))
                if d.qkv_bias:
                    e.param(p + name + ".bias", (size,))
        if not d.latent:
            e.param(p + "o", (h, q))
        if d.o_bias:
            e.param(p + "o.bias", (h,))
        if d.variant.qk_norm:
            e.param(p + "q_norm", (d.head_dim if d.variant.qk_norm == "head" else q,))
            e.param(p + "k_norm", (d.head_dim if d.variant.qk_norm == "head" else kv,))
        if _runs_experts(d, i):
            for name, shape, dtype in expert_params(d):
                e.param(p + name, shape, dtype=dtype)
        elif d.variant.fused_projections:
            e.param(p + "gate_up", (2 * d.intermediate, h))
            e.param(p + "down", (h, d.intermediate))
        else:
            inter = d.dense_intermediate or d.intermediate
            e.param(p + "gate", (inter, h))
            e.param(p + "up", (inter, h))
            e.param(p + "down", (h, inter))
            if d.mlp_bias:
                for name, size in (("gate.bias", inter), ("up.bias", inter), ("down.bias", h)):
                    e.param(p + name, (size,))
        for norm in _norm_names(d):
            e.param(p + norm, (h,))
    e.param("norm", (h,))
    if not d.tied:
        e.param("lm_head", (d.vocab, h))


def _norm_names(d: DecoderSpec) -> tuple[str, ...]:
    return {"pre": ("input_norm", "post_attn_norm"), "post": ("post_attn_norm", "post_ff_norm"),
            "sandwich": ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm")}[d.variant.norms]


def _runs_experts(d: DecoderSpec, layer: int) -> bool:
    return bool(d.experts) and d.experts_pattern[layer % d.period]


def mlp(e: Engine, x: Sym, d: DecoderSpec, layer: int, tokens: int) -> Sym:
    p = f"layers.{layer}."
    if _runs_experts(d, layer):
        return experts(e, x, d, layer, tokens)
    if d.variant.fused_projections:
        gate_up = ops.linear(e, x, e.params[p + "gate_up"], 2 * d.intermediate)
        del x
        act = ops.unary_saving_input(e, View(gate_up, gate_up.numel // 2))
        hidden = ops.mul(e, View(gate_up, gate_up.numel // 2), act)
        del act, gate_up
    else:
        inter = d.dense_intermediate or d.intermediate
        gate = ops.linear(e, x, e.params[p + "gate"], inter, e.params.get(p + "gate.bias"))
        act = ops.unary_saving_input(e, gate)
        del gate
        up = ops.linear(e, x, e.params[p + "up"], inter, e.params.get(p + "up.bias"))
        del x
        hidden = ops.mul(e, act, up)
        del act, up
    return ops.linear(e, hidden, e.params[p + "down"], d.hidden, e.params.get(p + "down.bias"))


def decoder_layer(e: Engine, x: Sym, rope: dict, d: DecoderSpec, layer: int, batch: int, q_len: int,
                  cache: dict | None, kv_len: int, masks: dict) -> Sym:
    """Llama's pre-norm layer, Gemma's sandwich of norms, or OLMo 2's norms after attention and MLP only."""
    p = f"layers.{layer}."
    norms = d.variant.norms
    cos, sin = rope["sliding" if d.variant.rope_per_layer_type and is_sliding(d, layer) else "full"]
    residual = x
    h = x if norms == "post" else rms_norm(e, x, e.params[p + "input_norm"], d)
    del x
    h, _weights = attention(e, h, cos, sin, d, layer, batch, q_len, cache, kv_len, masks)  # held till return
    if norms != "pre":
        h = rms_norm(e, h, e.params[p + "post_attn_norm"], d)
    h = ops.add(e, residual, h)
    residual = h
    if norms != "post":
        h = rms_norm(e, h, e.params[p + ("pre_ff_norm" if norms == "sandwich" else "post_attn_norm")], d)
    h = mlp(e, h, d, layer, batch * q_len)
    if norms != "pre":
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
    masks = attention_masks(e, d, batch, q_len, kv_len, compute)
    # cos and sin, per layer type where each has its own rotary table (Gemma 3 computes the full layers' first)
    rope_dtype = "float32" if d.variant.float32_rotary else compute
    width = d.head_dim // 2 if d.variant.rotary_halves else d.head_dim
    rope = {kind: (e.new(q_len * width, rope_dtype), e.new(q_len * width, rope_dtype)) for kind in _rope_kinds(d)}
    for layer in range(num_layers):
        e.segment = (0, layer)
        x = e.block(layer, partial(decoder_layer, e, rope=rope, d=d, layer=layer, batch=batch, q_len=q_len,
                                   cache=cache, kv_len=kv_len, masks=masks), x)
    e.segment = "post"
    if not last:
        return x
    hidden = rms_norm(e, x, e.params["norm"], d)
    del x, rope, masks, inputs_embeds
    if labels and e.policy.loss_chunks:
        e.input(batch * q_len, "int64")   # labels
        loss = chunked_lm_loss(e, hidden, _head(e), d.vocab, batch=batch, seq=q_len,
                               chunks=e.policy.loss_chunks, softcap=d.logit_softcap)
        del hidden
        return loss
    logits = lm_head(e, hidden, _head(e), d.vocab, batch=batch, q_len=q_len,
                     logits_to_keep=logits_to_keep)
    if d.logit_softcap:   # final logit soft-capping: / cap, tanh, * cap
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


def _rope_kinds(d: DecoderSpec) -> tuple[str, ...]:
    return ("full", "sliding") if d.variant.rope_per_layer_type else ("full",)


def declare_buffers(e: Engine, d: DecoderSpec) -> list[Sym]:
    # rotary inv_freq and original_inv_freq (per layer type where each has its own): head_dim / 2 floats each;
    # DeepSeek-V3's routers' e_score_correction_bias: a float per expert in each mixture layer
    rotary = [e.new(d.head_dim // 2, "float32", category="buffers") for _ in range(2 * len(_rope_kinds(d)))]
    routers = [e.new(d.experts, "float32", category="buffers") for layer in range(d.layers)
               if d.router.grouped_sigmoid and _runs_experts(d, layer)]
    return routers + rotary


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
        replace_cache(e, cache, {layer: min(tokens - 1, d.sliding_window - 1) + 1 if is_sliding(d, layer) else tokens
                                 for layer in range(num_layers)})

    generate(e, run, batch=batch, seq=seq, new_tokens=new_tokens, resize_cache=resize)
