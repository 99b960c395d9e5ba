"""A decoder LM as a serving engine loads it, read from its Hugging Face config alone (no torch, no weights): every
weight tensor with the way tensor parallel splits it, and every attention layer with what its KV cache keeps.

The inventory is written per architecture from the config's fields, as the engines' model code declares its
parameters; tests/test_serving.py holds it to the parameter count of the model transformers builds from the same
config, for every bundled decoder. A config memfit has no inventory for is refused in one line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.core.errors import MemfitError
from memfit.specs.hub import looks_like_hub_id
from memfit.specs.model_configs import FoundConfig

# How tensor parallel stores a weight on each rank (vLLM's parallel layers; SGLang and TGI split alike):
#   vocab     VocabParallelEmbedding / ParallelLMHead: rows padded to VOCAB_PADDING, then split
#   column    ColumnParallelLinear (q, gate/up, a mixture's experts' gate/up): output rows split
#   kv        QKVParallelLinear's key/value heads: split while there are more heads than ranks, else one head
#             per rank (replicated)
#   row       RowParallelLinear (o, down, a mixture's experts' down): input columns split
#   replicated  norms, routers, biases of row-parallel layers, MLA's low-rank projections
SPLITS = ("vocab", "column", "kv", "row", "replicated")
VOCAB_PADDING = 64    # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Weight:
    name: str
    shape: tuple[int, ...]     # (out, in) for a linear, (experts, out, in) for a mixture's experts
    split: str                 # SPLITS
    linear: bool = False       # a quantized checkpoint stores it in its format (embeddings, norms, routers stay dense)
    split_dim: int = -2        # the dimension "column"/"kv" split (out) — "row" splits the last (in)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class AttentionLayer:
    kind: str                  # "full", "sliding" (keeps `window` tokens) or "mla" (one latent per token)
    window: int | None = None


@dataclass(frozen=True)
class ServedModel:
    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int          # the dense MLP's inner width (a mixture's dense layers)
    max_positions: int
    dtype: str                 # the checkpoint's torch_dtype: what "auto" serves in
    attention: tuple[AttentionLayer, ...]
    weights: tuple[Weight, ...]
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    mla_latent: int = 0        # MLA: kv_lora_rank + qk_rope_head_dim, one per token and layer
    extra_parameters: dict | None = None   # a vision tower the engine loads beside the text model (bundled models)
    quantization: dict | None = None       # the checkpoint's quantization_config
    note: str | None = None    # how the name was read (a post-trained variant took the bundled shapes)
    hub_id: str = ""           # what the engine's command line names (the catalog's reference, else the name)
    rotary_dim: int = 0        # the rotated width of each head (MLA: qk_rope_head_dim)
    ropes: int = 1             # distinct rotary embeddings (Gemma 3: a local one for its sliding layers)

    @property
    def moe_layers(self) -> int:
        return sum(1 for w in self.weights if w.name.endswith("experts.down"))


DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "half": "float16", "float": "float32"}


def served_model(found: FoundConfig) -> ServedModel:
    """The model `found` names, as a serving engine loads it, or a one-line MemfitError."""
    config = dict(found.hf_config)
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:   # a multimodal checkpoint: its language model
        config = {**text, "quantization_config": config.get("quantization_config"),
                  "torch_dtype": text.get("torch_dtype") or config.get("torch_dtype") or config.get("dtype")}
    model_type = config.get("model_type", "")
    if model_type not in INVENTORIES:
        raise MemfitError(f"{found.where}: memfit models serving for the decoder architectures "
                          f"{', '.join(sorted(INVENTORIES))}, not {model_type!r}.")
    try:
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MemfitError(f"{found.where} lacks a field a decoder's config has: {exc}.") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    experts = int(config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0)
    dims = _Dims(config, hidden, layers, heads, kv_heads, head_dim, vocab, experts)
    weights = tuple(INVENTORIES[model_type](dims))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    mla = int(config.get("kv_lora_rank") or 0) + int(config.get("qk_rope_head_dim") or 0) \
        if model_type in MLA_TYPES else 0
    return ServedModel(
        name=found.name, model_type=model_type, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, vocab=vocab, intermediate=dims.intermediate, max_positions=_max_positions(config),
        dtype=DTYPES.get(dtype, "bfloat16"), attention=_attention_layers(config, layers, mla), weights=weights,
        experts=experts, top_k=int(config.get("num_experts_per_tok") or 0) if experts else 0,
        expert_intermediate=dims.expert_intermediate, mla_latent=mla,
        extra_parameters={part: n for part, n in (found.doc.get("published_includes") or {}).items()
                          if "vision" in part} or None,
        quantization=config.get("quantization_config") or found.doc.get("checkpoint_quantization_config") or None,
        rotary_dim=int(config.get("qk_rope_head_dim") or 0) if mla else int(
            head_dim * float(config.get("partial_rotary_factor") or 1.0)),
        ropes=2 if config.get("rope_local_base_freq") else 1, hub_id=_hub_id(found),
        note=found.note)


def _hub_id(found: FoundConfig) -> str:
    """What `vllm serve` takes for this model: the hub id or folder the user named, else the bundled model's hub id,
    else its name."""
    if found.kind == "hf-config" or looks_like_hub_id(found.asked):
        return found.asked or found.name
    reference = str(found.doc.get("reference") or "")
    return reference if looks_like_hub_id(reference) else found.name


def _max_positions(config: dict) -> int:
    """The context the engine allows without an override: max_position_embeddings (a rope scaling's factor is
    already in it for the configs that use one)."""
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)


def _attention_layers(config: dict, layers: int, mla: int) -> tuple[AttentionLayer, ...]:
    """Per layer, what its attention keeps: the config's layer_types where it lists them, else each architecture's
    rule (Gemma 2 alternates from a sliding first layer, Gemma 3 makes every sliding_window_pattern-th layer full,
    Qwen's use_sliding_window applies from max_window_layers on), else one window for every layer where the config
    sets one (Mistral 7B v0.1, Phi-3)."""
    if mla:
        return (AttentionLayer("mla"),) * layers
    window = config.get("sliding_window")
    kinds = config.get("layer_types")
    model_type = config.get("model_type", "")
    if not window or (model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
                      and not config.get("use_sliding_window")):
        return (AttentionLayer("full"),) * layers
    if kinds:
        sliding = [kind == "sliding_attention" for kind in kinds[:layers]]
    elif model_type == "gemma2":
        sliding = [i % 2 == 0 for i in range(layers)]
    elif model_type == "gemma3_text":
        pattern = int(config.get("sliding_window_pattern") or 6)
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    elif model_type.startswith("qwen"):
        first = int(config.get("max_window_layers") or 0)
        sliding = [i >= first for i in range(layers)]
    else:
        sliding = [True] * layers
    return tuple(AttentionLayer("sliding", int(window)) if s else AttentionLayer("full") for s in sliding)


class _Dims:
    """The config's widths, as the inventories read them."""

    def __init__(self, config: dict, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 vocab: int, experts: int) -> None:
        self.config, self.hidden, self.layers, self.heads, self.kv_heads = config, hidden, layers, heads, kv_heads
        self.head_dim, self.vocab, self.experts = head_dim, vocab, experts
        self.intermediate = int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden)
        self.expert_intermediate = int(config.get("moe_intermediate_size") or self.intermediate) if experts else 0
        self.tied = bool(config.get("tie_word_embeddings", False))


def _linear(name: str, out: int, inp: int, split: str, bias: bool = False) -> list[Weight]:
    weight = Weight(name, (out, inp), split, linear=True)
    if not bias:
        return [weight]
    # a column-parallel layer's bias is split with its rows; a row-parallel one's is added once, whole on each rank
    return [weight, Weight(f"{name}.bias", (out,), "replicated" if split == "row" else split, split_dim=-1)]


def _norm(name: str, width: int, bias: bool = False) -> list[Weight]:
    return [Weight(name, (width,), "replicated")] + ([Weight(f"{name}.bias", (width,), "replicated")] if bias else [])


def _embeddings(d: _Dims, head_bias: bool = False) -> tuple[list[Weight], list[Weight]]:
    """The embedding (first) and the LM head with the final norm's weights left to the caller (last)."""
    embed = [Weight("embed_tokens", (d.vocab, d.hidden), "vocab")]
    head = [] if d.tied else [Weight("lm_head", (d.vocab, d.hidden), "vocab")]
    if head_bias:
        head.append(Weight("lm_head.bias", (d.vocab,), "vocab", split_dim=-1))
    return embed, head


def _gqa(d: _Dims, i: int, qkv_bias: bool, o_bias: bool) -> list[Weight]:
    p, h, hd = f"layers.{i}.attn", d.hidden, d.head_dim
    return (_linear(f"{p}.q", d.heads * hd, h, "column", qkv_bias)
            + _linear(f"{p}.k", d.kv_heads * hd, h, "kv", qkv_bias)
            + _linear(f"{p}.v", d.kv_heads * hd, h, "kv", qkv_bias) + _linear(f"{p}.o", h, d.heads * hd, "row", o_bias))


def _gated_mlp(name: str, hidden: int, inner: int, bias: bool = False) -> list[Weight]:
    return (_linear(f"{name}.gate", inner, hidden, "column", bias)
            + _linear(f"{name}.up", inner, hidden, "column", bias)
            + _linear(f"{name}.down", hidden, inner, "row", bias))


def _experts(name: str, d: _Dims, bias: bool = False) -> list[Weight]:
    e, inner, h = d.experts, d.expert_intermediate, d.hidden
    weights = [Weight(f"{name}.experts.gate_up", (e, 2 * inner, h), "column", linear=True),
               Weight(f"{name}.experts.down", (e, h, inner), "row", linear=True)]
    if bias:
        weights += [Weight(f"{name}.experts.gate_up.bias", (e, 2 * inner), "column", split_dim=-1),
                    Weight(f"{name}.experts.down.bias", (e, h), "replicated")]
    return weights


def _llama_like(d: _Dims) -> list[Weight]:
    """Llama, Mistral, Mixtral, Qwen2/3 (dense and MoE), Phi-3, Gemma 1-3, OLMo 2, gpt-oss: GQA attention, gated
    MLPs or a mixture, RMS norms."""
    c, model_type = d.config, d.config["model_type"]
    qkv_bias = bool(c.get("attention_bias")) or model_type in ("qwen2", "qwen2_moe")
    o_bias = bool(c.get("attention_bias")) and model_type not in ("qwen2", "qwen2_moe")
    norms_per_layer = {"gemma2": 4, "gemma3_text": 4, "olmo2": 2}.get(model_type, 2)
    embed, head = _embeddings(d)
    weights = list(embed)
    sparse_step = int(c.get("decoder_sparse_step") or 1)
    dense_layers = set(c.get("mlp_only_layers") or ())
    for i in range(d.layers):
        p = f"layers.{i}"
        weights += _gqa(d, i, qkv_bias, o_bias)
        if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
            weights += _norm(f"{p}.attn.q_norm", d.head_dim) + _norm(f"{p}.attn.k_norm", d.head_dim)
        elif model_type == "olmo2":
            weights += _norm(f"{p}.attn.q_norm", d.heads * d.head_dim) + _norm(f"{p}.attn.k_norm",
                                                                               d.kv_heads * d.head_dim)
        if model_type == "gpt_oss":
            weights.append(Weight(f"{p}.attn.sinks", (d.heads,), "column", split_dim=-1))
        for n in range(norms_per_layer):
            weights += _norm(f"{p}.norm{n}", d.hidden)
        moe = d.experts and i not in dense_layers and (i + 1) % sparse_step == 0
        if moe:
            weights.append(Weight(f"{p}.mlp.router", (d.experts, d.hidden), "replicated"))
            if model_type == "gpt_oss":
                weights.append(Weight(f"{p}.mlp.router.bias", (d.experts,), "replicated"))
            weights += _experts(f"{p}.mlp", d, bias=model_type == "gpt_oss")
            shared = int(c.get("shared_expert_intermediate_size") or 0)
            if shared:   # Qwen2-MoE: one shared expert and its sigmoid gate
                weights += _gated_mlp(f"{p}.mlp.shared", d.hidden, shared)
                weights.append(Weight(f"{p}.mlp.shared_gate", (1, d.hidden), "replicated"))
        else:
            weights += _gated_mlp(f"{p}.mlp", d.hidden, d.intermediate, bool(c.get("mlp_bias")))
    return weights + _norm("norm", d.hidden) + head


def _phi(d: _Dims) -> list[Weight]:
    """Phi-1/1.5/2: one LayerNorm per block feeding attention and MLP in parallel, biases everywhere, a
    non-gated GELU MLP, the head with a bias."""
    embed, head = _embeddings(d, head_bias=True)
    weights = list(embed)
    for i in range(d.layers):
        p = f"layers.{i}"
        weights += _gqa(d, i, True, True) + _norm(f"{p}.norm", d.hidden, bias=True)
        weights += _linear(f"{p}.mlp.fc1", d.intermediate, d.hidden, "column", True)
        weights += _linear(f"{p}.mlp.fc2", d.hidden, d.intermediate, "row", True)
    return weights + _norm("norm", d.hidden, bias=True) + head


def _deepseek(d: _Dims) -> list[Weight]:
    """DeepSeek V2/V3 (and Kimi K2): multi-head latent attention and a mixture with shared experts after the first
    first_k_dense_replace dense layers."""
    c, h = d.config, d.hidden
    q_rank, kv_rank = int(c.get("q_lora_rank") or 0), int(c["kv_lora_rank"])
    nope, rope, v_dim = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    embed, head = _embeddings(d)
    weights = list(embed)
    for i in range(d.layers):
        p = f"layers.{i}.attn"
        if q_rank:
            weights += (_linear(f"{p}.q_a", q_rank, h, "replicated") + _norm(f"{p}.q_a_norm", q_rank)
                        + _linear(f"{p}.q_b", d.heads * (nope + rope), q_rank, "column"))
        else:
            weights += _linear(f"{p}.q", d.heads * (nope + rope), h, "column")
        weights += (_linear(f"{p}.kv_a", kv_rank + rope, h, "replicated") + _norm(f"{p}.kv_a_norm", kv_rank)
                    + _linear(f"{p}.kv_b", d.heads * (nope + v_dim), kv_rank, "column")
                    + _linear(f"{p}.o", h, d.heads * v_dim, "row"))
        weights += _norm(f"layers.{i}.norm0", h) + _norm(f"layers.{i}.norm1", h)
        if i < int(c.get("first_k_dense_replace") or 0):
            weights += _gated_mlp(f"layers.{i}.mlp", h, d.intermediate)
        else:
            weights.append(Weight(f"layers.{i}.mlp.router", (d.experts, h), "replicated"))
            weights += _experts(f"layers.{i}.mlp", d)
            weights += _gated_mlp(f"layers.{i}.mlp.shared", h, int(c.get("n_shared_experts") or 0)
                                  * d.expert_intermediate)
    return weights + _norm("norm", h) + head


LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma2",
              "gemma3_text", "olmo2", "gpt_oss", "granite")
MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
INVENTORIES = {**{t: _llama_like for t in LLAMA_LIKE}, **{t: _deepseek for t in MLA_TYPES}, "phi": _phi}
