"""Quantized weights for real (torchao int8, bitsandbytes 4-bit): predicted peaks against a real run, the
bytes per weight, and outputs close to float32's but not equal (lossy). QLoRA's training runs are in
test_techniques.py's MODES with the other training techniques."""
import pytest
import torch

import memfit
from memfit.core.errors import MemfitError
from memfit.measurement.training import text_batches
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import SHAPE, assert_analytic, predicted, rel

EMBEDDINGS = 4096 * 256 * 4     # tiny-llama's embeddings (and its untied head), float32
DOWN_PROJS = 4 * 688 * 256 * 4  # its MLPs' down projections: 688 inputs, which no int4 group size divides


@pytest.mark.parametrize("technique,kept,bytes_per_weight", [
    ("int8-weight-only", EMBEDDINGS, 1.0),          # torchao quantizes the head too
    ("int8-dynamic", EMBEDDINGS, 1.0),
    # + a float32 scale and zero per 64 inputs; torchao skips the linears the group does not divide
    ("int4-weight-only:group_size=64", EMBEDDINGS + DOWN_PROJS, 0.5 + 2 * 4 / 64),
    ("bnb-4bit", 2 * EMBEDDINGS, 0.5),              # bitsandbytes keeps the head (transformers' rule)
    ("bnb-4bit:format=fp4,double_quant=false", 2 * EMBEDDINGS, 0.5),
])
def test_quantized_inference_keeps_the_bytes_per_weight_predicted(technique, kept, bytes_per_weight, measured):
    run, base = measured((technique,), task="inference"), measured((), task="inference")
    peak = run.peak_bytes
    if technique == "int8-dynamic":
        # The CPU's integer matmul allocates scratch of its own, outside any tensor (3.4 % of the peak here):
        # the estimates count every tensor, which is what they are held to; the scratch stays small.
        peak = run.extra["tracked_peak_bytes"]
        assert run.extra["untracked_bytes"] < 0.05 * run.peak_bytes
    assert rel(predicted(run, "traced"), peak) < 0.03
    assert_analytic(run, peak)
    quantized_weights = (base.at_peak["parameters"] - kept) / 4
    per_weight = (run.at_peak["parameters"] - kept) / quantized_weights
    assert bytes_per_weight <= per_weight < bytes_per_weight * 1.1, per_weight
    assert run.peak_bytes < base.peak_bytes


def test_int8_weight_only_quantizes_a_mixture_of_experts_experts_too(measured):
    """Mixtral's experts are 3-D parameters, no nn.Linear: int8-weight-only quantizes them too, per expert and row
    (transformers' eager experts loop runs them), so nearly every weight takes a byte instead of 4. No routing is
    known before the run: both estimates take every token as routed to every expert, an upper bound on the loop's
    temporaries that a decode step of one sequence reaches; the weights to the byte."""
    decode = {**SHAPE, "batch_size": 1, "seq_len": 16}
    run, base = (measured(t, model="tiny-mixtral", task="inference", shape=decode) for t in (("int8-weight-only",), ()))
    for method in ("traced", "analytic"):
        assert run.extra["estimates"][method]["at_peak"]["parameters"] == run.at_peak["parameters"]
        assert rel(predicted(run, method), run.peak_bytes) < 0.01
    quantized_weights = (base.at_peak["parameters"] - EMBEDDINGS) / 4   # the embeddings stay float32
    assert 1.0 <= (run.at_peak["parameters"] - EMBEDDINGS) / quantized_weights < 1.1
    prefill = {**SHAPE, "batch_size": 2, "seq_len": 128}
    run = measured(("int8-weight-only",), model="tiny-mixtral", task="inference", shape=prefill)
    for method in ("traced", "analytic"):
        assert run.peak_bytes <= predicted(run, method) < 1.3 * run.peak_bytes


def test_quantized_encoder_embeds_real_sentences_nearly_as_float32():
    """The real pretrained all-MiniLM-L6-v2 on real held-out sentences: every format changes the embeddings
    (lossy), more bits change them less, and NF4 beats FP4 at the same 4 bits (the QLoRA paper's claim)."""
    from memfit.measurement.accuracy import embedding_agreement

    int8, dynamic, nf4, fp4 = (embedding_agreement([t]) for t in ("int8-weight-only", "int8-dynamic", "bnb-4bit",
                                                                  "bnb-4bit:format=fp4"))
    assert 0.99 < int8.mean_cosine < 1 and int8.top1_agreement > 0.9, int8
    assert 0.95 < dynamic.mean_cosine < int8.mean_cosine, dynamic   # the activations are rounded too
    assert 0.9 < nf4.mean_cosine < int8.mean_cosine and nf4.top1_agreement > 0.7, nf4
    assert fp4.mean_cosine < nf4.mean_cosine, (fp4, nf4)


def test_qat_trains_through_fake_quantization_and_converts_to_int8(measured, losses):
    """Fake quantization saves a rounded copy and a range mask source of every weight and input for
    backward: QAT costs memory (predicted); the trained model converts to real int8-dynamic with nearly
    the outputs it trained with."""
    from memfit.techniques.quantization import convert_qat_

    run, base = measured(("qat",)), measured(())
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    assert_analytic(run)
    assert run.peak_bytes > 1.2 * base.peak_bytes
    got = losses(("qat",))
    assert got[-1] < got[0] - 0.1 and got != losses(())
    torch.manual_seed(0)
    model = ResolvedWorkload(**SHAPE).source.build(device="cpu", dtype=torch.float32)
    setup = memfit.apply_(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ["qat"])
    for batch in text_batches(batch_size=2, seq_len=64, num_batches=3):
        setup.step(batch)
    ids = text_batches(batch_size=2, seq_len=64, num_batches=1, split="held-out")[0]["input_ids"]
    with torch.no_grad():
        trained = model.eval()(input_ids=ids).logits
        deployed = convert_qat_(model)(input_ids=ids).logits
    assert float((deployed - trained).norm() / trained.norm()) < 0.02
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"


def test_4bit_techniques_refuse_what_they_cannot_do():
    with pytest.raises(MemfitError, match="qlora"):
        ResolvedWorkload(**SHAPE, techniques=("bnb-4bit",))
    with pytest.raises(MemfitError, match="format"):
        ResolvedWorkload(**{**SHAPE, "task": "inference"}, techniques=("bnb-4bit:format=int3",))
    with pytest.raises(MemfitError, match="Conv1D"):
        ResolvedWorkload(**{**SHAPE, "model": "tiny-gpt2"}, techniques=("qlora",))
    with pytest.raises(MemfitError, match="fp16"):
        ResolvedWorkload(**SHAPE, precision="fp16-mixed", techniques=("qlora",))
    with pytest.raises(MemfitError, match="int8-dynamic"):
        ResolvedWorkload(**{**SHAPE, "task": "inference"}, techniques=("qat",))
    with pytest.raises(MemfitError, match="adapters freeze them"):
        ResolvedWorkload(**SHAPE, techniques=("qat", "lora"))
    with pytest.raises(MemfitError, match="qlora"):
        ResolvedWorkload(**SHAPE, techniques=("int4-weight-only",))
    inference = {**SHAPE, "task": "inference"}
    with pytest.raises(MemfitError, match="32, 64, 128, 256"):
        ResolvedWorkload(**inference, techniques=("int4-weight-only:group_size=48",))
    with pytest.raises(MemfitError, match="weights' own dtype"):
        ResolvedWorkload(**inference, precision="bf16-mixed", techniques=("int4-weight-only",))
    with pytest.raises(MemfitError, match="Conv1D"):
        ResolvedWorkload(**{**inference, "model": "tiny-gpt2"}, techniques=("int4-weight-only",))


def test_effect_carries_the_measured_accuracy_cost_with_its_source():
    import memfit
    from memfit.estimators.effects import effect

    workload = ResolvedWorkload(**{**SHAPE, "task": "inference", "new_tokens": 4})
    changed = effect("int8-weight-only", memfit.estimate(workload, method="analytic"), workload)
    encoder = [m for m in changed.extra["effect"]["accuracy"] if "all-MiniLM-L6-v2" in m["source"]]
    assert len(encoder) == 1 and 0.99 < encoder[0]["mean_cosine"] < 1
    plain = ResolvedWorkload(**SHAPE)
    lossless = effect("checkpointing", memfit.estimate(plain, method="analytic"), plain)
    assert lossless.extra["effect"]["accuracy"] is None


def test_int4_weight_only_says_that_cuda_takes_bfloat16_weights_only():
    def notes(precision):
        workload = memfit.Workload(model="tiny-llama", task="inference", precision=precision,
                                   techniques=("int4-weight-only",))
        return " ".join(memfit.estimate(workload, method="analytic").notes)

    assert "bfloat16 weights only" in notes("fp32") and "bfloat16 weights only" not in notes("bf16")
