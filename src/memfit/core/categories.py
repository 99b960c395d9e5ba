"""Memory categories and step phases: the vocabulary of every breakdown memfit prints.

parameters        model weights (and their half-precision copies in pure half training)
gradients         `.grad` of parameters, as accumulated by autograd
optimizer_states  optimizer state tensors (Adam m and v, momentum, Adafactor factors, step counters)
activations       tensors created by the forward pass (saved for backward, or returned)
temporaries       short-lived tensors of backward and of the optimizer step, and allocator-level
                  scratch that no tensor accounts for
kv_cache          key/value cache of autoregressive decoding
buffers           module buffers (position ids, rotary frequencies, norms' running stats)
inputs            the batch: token ids, labels, pixels
"""
from __future__ import annotations

CATEGORIES: tuple[str, ...] = (
    "parameters", "gradients", "optimizer_states", "activations",
    "temporaries", "kv_cache", "buffers", "inputs",
)
MODEL_STATE_CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_states")
TRAIN_PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")
INFERENCE_PHASES: tuple[str, ...] = ("prefill", "decode")
PHASES: tuple[str, ...] = TRAIN_PHASES + INFERENCE_PHASES

# Where a number came from (DESIGN.md): every figure memfit prints carries one of these.
SOURCES: tuple[str, ...] = ("analytic", "traced", "measured", "assumed")


def zero_categories() -> dict[str, int]:
    return {name: 0 for name in CATEGORIES}
