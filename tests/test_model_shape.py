"""One home per model fact: `ModelSource.shape`, read from the config, is what every consumer outside a family's
program reads; each analytic family's own spec (its symbolic program's parametrisation) must agree with it."""
from __future__ import annotations

import dataclasses

import pytest

from memfit.estimators.analytic.families import registry
from memfit.specs.model_source import catalog, resolve_source
from memfit.techniques.resolve import ResolvedWorkload


def spec_facts(spec) -> dict:
    """The family spec's fields under the shape's names (each family names them its own way)."""
    hidden = getattr(spec, "hidden", None) or spec.d_model
    layers = spec.layers + getattr(spec, "decoder_layers", 0)
    window, pattern = getattr(spec, "sliding_window", None), getattr(spec, "sliding_pattern", (False,))
    windows = tuple(window if pattern[i % len(pattern)] else None for i in range(spec.layers)) if window else ()
    return dict(hidden=hidden, heads=spec.heads, kv_heads=getattr(spec, "kv_heads", spec.heads),
                head_dim=getattr(spec, "head_dim", None) or getattr(spec, "d_kv", None) or hidden // spec.heads,
                layers=layers, vocab=getattr(spec, "vocab", 0), causal=spec.causal,
                # (T5's `inner` is its attention's width; GPT-2's, its MLP's)
                intermediate=spec.d_ff if hasattr(spec, "d_ff") else getattr(spec, "intermediate", None) or spec.inner,
                experts=getattr(spec, "experts", 0), top_k=getattr(spec, "top_k", 0), windows=windows)


ANALYTIC = [name for name in catalog()
            if resolve_source(name).model_type in registry.supported_model_types()]


@pytest.mark.parametrize("name", ANALYTIC)
def test_every_analytic_family_spec_agrees_with_the_shape_read_from_the_config(name):
    source = resolve_source(name)
    _, spec = registry.family_of(source)
    assert dataclasses.asdict(source.shape) == spec_facts(spec)


def test_the_shape_reads_the_configs_after_the_techniques_overrides():
    shape = dict(model="qwen2.5-7b", task="train", seq_len=512)
    plain, windowed = ResolvedWorkload(**shape), ResolvedWorkload(**shape, techniques=("sliding-window:window=256",))
    assert plain.source.shape.windows == ()
    assert windowed.source.shape.windows == (256,) * 28


def test_the_shape_of_families_only_the_trace_models():
    from memfit.specs.model_source import ModelSource

    qwen3_moe = ModelSource("qwen3-moe", "hf-config", hf_config=dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=256, intermediate_size=512,
        moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        num_experts=16, num_experts_per_tok=4, vocab_size=1000))
    shape = qwen3_moe.shape
    assert (shape.head_dim, shape.kv_width, shape.experts, shape.top_k, shape.intermediate) == (64, 128, 16, 4, 128)
    assert shape.causal and shape.attn_width == 512
