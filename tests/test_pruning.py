"""Pruning for real: structured pruning removes heads and channels (every estimate and the run shrink
together); unstructured pruning zeroes weights in place and saves nothing, which memfit says."""
import pytest
import torch

import memfit
from memfit.core.errors import MemfitError
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import SHAPE, assert_analytic, predicted, rel


def test_structured_pruning_shrinks_the_model_and_the_run_as_predicted(measured):
    run, base = measured(("prune-structured",), task="inference"), measured((), task="inference")
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    assert_analytic(run)
    # tiny-llama: 4 of 8 query heads (2 of 4 key/value heads) and 344 of 688 MLP channels per block remain
    block = 256 * (4 * 32 + 2 * 2 * 32) + 4 * 32 * 256 + 3 * 256 * 344 + 2 * 256
    assert run.at_peak["parameters"] == 4 * (2 * 4096 * 256 + 256 + 4 * block)     # float32
    assert run.peak_bytes < base.peak_bytes


def test_structured_pruning_of_a_bert_encoder_as_predicted(measured):
    run, base = measured(("prune-structured",), "tiny-bert"), measured((), "tiny-bert")
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    assert_analytic(run)
    assert run.at_peak["parameters"] < base.at_peak["parameters"] and run.peak_bytes < base.peak_bytes
    model = ResolvedWorkload(**{**SHAPE, "model": "tiny-bert"}).source.build(device="cpu", dtype=torch.float32)
    memfit.apply_(model, None, ["prune-structured"])
    attention = model.bert.encoder.layer[0].attention.self
    assert attention.query.out_features == attention.num_attention_heads * attention.attention_head_size
    assert attention.num_attention_heads == model.config.num_attention_heads // 2


def test_pruning_comes_before_quantization():
    """The issue's example: pruning scores full-precision weights, so it runs before int8 quantization."""
    shape = {**SHAPE, "model": "tiny-bert", "task": "inference"}
    both = memfit.estimate(ResolvedWorkload(**shape, techniques=("int8-dynamic", "prune-structured:ratio=0.5")))
    alone = memfit.estimate(ResolvedWorkload(**shape, techniques=("int8-dynamic",)))
    assert both.at_peak["parameters"] < alone.at_peak["parameters"]


def test_structured_pruning_removes_the_weakest_groups_and_keeps_generating():
    torch.manual_seed(0)
    model = ResolvedWorkload(**SHAPE).source.build(device="cpu", dtype=torch.float32).eval()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():   # make key/value group 1 (query heads 2 and 3) the strongest by far
        for linear, rows in ((attn.q_proj, slice(64, 128)), (attn.k_proj, slice(32, 64)), (attn.v_proj, slice(32, 64))):
            linear.weight[rows] *= 10
        kept = attn.k_proj.weight[32:64].clone()
    memfit.apply_(model, None, ["prune-structured:part=heads"])
    assert attn.k_proj.out_features == 64 and attn.q_proj.out_features == 128
    assert any(torch.equal(attn.k_proj.weight[i:i + 32], kept) for i in (0, 32)), "the strongest group stays"
    assert model.config.num_key_value_heads == 2 and model.model.layers[0].mlp.down_proj.in_features == 688
    out = model.generate(torch.randint(0, 256, (1, 8)), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 12)


def test_unstructured_pruning_saves_nothing_while_the_weights_stay_dense(measured):
    run, base = measured(("prune-unstructured:sparsity=0.7",)), measured(())
    assert run.peak_bytes == base.peak_bytes, "zeros in dense tensors take the same bytes"
    assert predicted(run, "analytic") == predicted(base, "analytic")
    assert predicted(run, "traced") == predicted(base, "traced")
    model = ResolvedWorkload(**SHAPE).source.build(device="cpu", dtype=torch.float32)
    memfit.apply_(model, None, ["prune-unstructured:sparsity=0.7"])
    weight = model.model.layers[0].mlp.up_proj.weight
    assert abs(float((weight == 0).float().mean()) - 0.7) < 0.001 and not hasattr(model.model.layers[0].mlp.up_proj,
                                                                                     "weight_orig")
    assert float((model.lm_head.weight == 0).float().mean()) == 0, "the LM head stays whole"


def test_pruning_refuses_bad_input():
    for spec, match in (("prune-structured:ratio=1.0", "between 0 and 1"), ("prune-structured:part=ffn", "part"),
                        ("prune-unstructured:sparsity=0", "between 0 and 1")):
        with pytest.raises(MemfitError, match=match):
            ResolvedWorkload(**SHAPE, techniques=(spec,))
    with pytest.raises(MemfitError, match="removes heads and channels"):
        ResolvedWorkload(**{**SHAPE, "model": "tiny-t5"}, techniques=("prune-structured",))
