"""A Hugging Face model's shape, read from its config in one place (`ModelSource.shape`): what code outside a family's
symbolic program reads of the model — the step-time model's FLOPs and bytes, the attention kernel's head size,
tensor parallel's head counts — so that no consumer derives heads, widths, experts or causality again. The config
object's own aliases (GPT-2's n_embd, T5's d_model) and the lists transformers fills in (layer_types) are read
through transformers' config classes, with the techniques' config overrides applied. The analytic families' specs
agree with it field for field (tests/test_model_shape.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    heads: int
    kv_heads: int             # key/value heads (grouped-query attention: fewer than heads)
    head_dim: int
    layers: int               # every block (an encoder-decoder's two stacks together)
    vocab: int                # 0 for a classifier without a vocabulary (a ViT)
    causal: bool              # each token attends only to those before it (attention FLOPs: half the square)
    intermediate: int         # the MLP's inner width (a mixture's: one expert's)
    experts: int = 0          # a mixture of experts: experts per layer ...
    top_k: int = 0            # ... and how many each token runs
    windows: tuple[int | None, ...] = ()   # per block: the sliding window its attention keeps (None: every token);
    #                                        () when no block has one

    @property
    def attn_width(self) -> int:
        """The queries' width: heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """One token's keys (or values): kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config, *, causal: bool) -> ModelShape:
        """From a transformers config object (the source's, overrides applied); `causal`: its head is a causal
        LM's (ModelSource.head)."""
        hidden, heads = config.hidden_size, config.num_attention_heads
        encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        layers = config.num_hidden_layers + ((getattr(config, "num_decoder_layers", 0) or 0) if encoder_decoder else 0)
        experts = _first(config, "num_local_experts", "num_experts", "n_routed_experts")
        intermediate = (_first(config, "moe_intermediate_size") if experts else 0) or _first(
            config, "intermediate_size", "n_inner", "d_ff") or 4 * hidden
        if getattr(config, "multi_query", False):
            kv_heads = 1
        else:
            kv_heads = _first(config, "num_key_value_heads", "num_kv_heads") or heads
        return cls(hidden=hidden, heads=heads, kv_heads=kv_heads,
                   head_dim=_first(config, "head_dim") or hidden // heads, layers=layers,
                   vocab=_first(config, "vocab_size"),
                   causal=causal,
                   intermediate=intermediate, experts=experts,
                   top_k=_first(config, "num_experts_per_tok") if experts else 0,
                   windows=_windows(config, config.num_hidden_layers))


def _first(config, *names: str) -> int:
    """The first of `names` the config sets to a number (0 if none)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value:
            return value
    return 0


def _windows(config, layers: int) -> tuple[int | None, ...]:
    """Per layer, its sliding window: as `layer_types` lists them where transformers fills the list in (Gemma 2 and
    3, Qwen2 with use_sliding_window, gpt-oss), else every layer's when the config sets one (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if not window:
        return ()
    if kinds:
        windows = tuple(window if kind == "sliding_attention" else None for kind in kinds[:layers])
        return windows if any(windows) else ()
    return (window,) * layers
