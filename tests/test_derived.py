"""The analytic program derived from a model's traced block (issue 39, B's general path): decoders without a
written family, at micro-batches and depths the derivation never traced, against their full traces."""
import json

import pytest

from memfit import Workload, estimate
from memfit.core.errors import NotModelled
from memfit.specs.hardware import get_gpu

NEOX = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=64, intermediate_size=256,
            num_hidden_layers=5, num_attention_heads=4, vocab_size=512, max_position_embeddings=256, rotary_pct=0.25,
            use_parallel_residual=True, tie_word_embeddings=False)
FALCON = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=64, num_attention_heads=4,
              num_hidden_layers=3, vocab_size=512, new_decoder_architecture=False, multi_query=True,
              parallel_attn=True, bias=False, max_position_embeddings=256)
BIGCODE = dict(model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"], n_embd=64, n_head=4, n_layer=3,
               vocab_size=512, n_positions=256, multi_query=True)
LONGFORMER = dict(model_type="longformer", architectures=["LongformerForMaskedLM"], hidden_size=64,
                  num_attention_heads=4, num_hidden_layers=3, intermediate_size=128, vocab_size=500,
                  max_position_embeddings=258, type_vocab_size=1, pad_token_id=1, attention_window=[16] * 3)


def _config(tmp_path, fields) -> str:
    path = tmp_path / f"{fields['model_type']}.json"
    path.write_text(json.dumps(fields))
    return str(path)


@pytest.mark.parametrize("fields, precision, gpu, techniques", [
    (NEOX, "fp32", None, ()),
    (NEOX, "bf16-mixed", "h100", ("checkpointing",)),
    (FALCON, "bf16-mixed", "h100", ()),
    (BIGCODE, "bf16", None, ()),
], ids=["neox-fp32-cpu", "neox-bf16-mixed-h100-checkpointed", "falcon-bf16-mixed-h100", "bigcode-bf16-cpu"])
def test_a_derived_program_matches_the_full_trace(tmp_path, fields, precision, gpu, techniques):
    """Derived from one layer at micro-batches 2 and 3, run at every layer and at micro-batch 4: within 0.1 % of
    the trace of the whole model, and it says which program it used."""
    target = get_gpu(gpu) if gpu else None
    workload = Workload(model=_config(tmp_path, fields), task="train", batch_size=4, seq_len=48, precision=precision,
                        techniques=techniques)
    derived = estimate(workload, gpu=target, method="analytic")
    traced = estimate(workload, gpu=target, method="traced")
    assert derived.peak_bytes == pytest.approx(traced.peak_bytes, rel=1e-3)
    assert any("derived from the model's traced block" in note for note in derived.notes)


def test_a_chunked_loss_is_traced_into_the_program(tmp_path):
    """chunked-ce replaces the loss: it is recorded with the block, its checkpointed chunks' recomputation carried
    from the node that runs it to the node that frees it; within 2 % of the full trace (the check's bar)."""
    workload = Workload(model=_config(tmp_path, NEOX), task="train", batch_size=4, seq_len=48, precision="bf16-mixed",
                        techniques=("chunked-ce", "checkpointing"))
    derived = estimate(workload, gpu=get_gpu("h100"), method="analytic")
    traced = estimate(workload, gpu=get_gpu("h100"), method="traced")
    assert derived.peak_bytes == pytest.approx(traced.peak_bytes, rel=0.02)
    assert any("derived from the model's traced block" in note for note in derived.notes)


def test_a_program_that_misses_its_check_is_refused_with_the_way_out(tmp_path):
    """Longformer's in-place banded attention: the derived program misses the check trace by more than 2 %, so the
    analytic method refuses it in one line (a plan traces it instead)."""
    workload = Workload(model=_config(tmp_path, LONGFORMER), task="train", batch_size=2, seq_len=64)
    with pytest.raises(NotModelled, match=r"against the trace's .*use --method traced"):
        estimate(workload, method="analytic")


def test_only_techniques_a_derived_program_takes_make_it_the_analytic_method(tmp_path):
    """Composed around the blocks (checkpointing) or traced into the program (chunked-ce) — not distillation, which
    also computes its own loss but brings a teacher model the engine would have to declare, nor LoRA."""
    from memfit.estimators import methods_for

    def methods(*techniques):
        return methods_for(Workload(model=_config(tmp_path, NEOX), task="train", batch_size=2, seq_len=32,
                                    techniques=techniques))

    assert "analytic" in methods("checkpointing", "chunked-ce")
    assert methods("distill") == methods("lora") == ("traced",)
