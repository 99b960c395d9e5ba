import json

import pytest

from memfit.core.errors import MemfitError
from memfit.specs.workload import Workload
from memfit.techniques.resolve import ResolvedWorkload, resolve


def not_a_module():
    return 42


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="tiny-lama"), "tiny-llama"),
    (dict(model="tiny-llama", batch_size=0), "batch-size"),
    (dict(model="tiny-llama", batch_size=2.5), "batch-size"),
    (dict(model="tiny-llama", seq_len=-4), "seq-len"),
    (dict(model="gpt2", seq_len=4096), "allow-long-seq"),
    (dict(model="tiny-llama", precision="fp8"), "bf16-mixed"),
    (dict(model="tiny-llama", optimizer="lion"), "adamw"),
    (dict(model="tiny-llama", task="serve"), "train or inference"),
    (dict(model="tiny-llama", zero_stage=2), "world-size"),
    (dict(model="tiny-llama", zero_stage=5, world_size=2), "--zero"),
    (dict(model="tiny-llama", new_tokens=4), "inference"),
    (dict(model="mypkg.nothing:build", inputs="mypkg.nothing:inputs"), "cannot import"),
    (dict(model="memfit.examples.convnet:build"), "--inputs"),
    (dict(model="tests.test_workload:not_a_module", inputs="memfit.examples.convnet:make_inputs"), None),
    (dict(model="tiny-vit", seq_len=70), "patch size"),
])
def test_bad_workloads_raise_one_clear_error(kwargs, message):
    if message is None:   # a factory that returns no module fails when it is built
        workload = resolve(Workload(**kwargs))
        with pytest.raises(MemfitError, match=r"not a torch\.nn\.Module"):
            workload.source.build(device="meta", dtype=__import__("torch").float32)
        return
    with pytest.raises(MemfitError, match=message):
        resolve(Workload(**kwargs))


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="tiny-llama", batch_size=0), "batch-size"),
    (dict(model="tiny-llama", precision="fp8"), "bf16-mixed"),
    (dict(model="tiny-llama", task="serve"), "train or inference"),
    (dict(model="tiny-llama", zero_stage=2), "world-size"),
    (dict(model="tiny-llama", new_tokens=4), "inference"),
    (dict(model="", techniques=()), "name a model"),
    (dict(model="tiny-llama", techniques="checkpointing"), "list of names"),
])
def test_plain_values_are_checked_when_a_workload_is_made(kwargs, message):
    """What the values alone show is checked at construction; the techniques and the model are resolved later."""
    with pytest.raises(MemfitError, match=message):
        Workload(**kwargs)
    unresolved = Workload(model="no-such-model", techniques=("no-such-technique",))
    with pytest.raises(MemfitError, match="no-such"):
        resolve(unresolved)


def test_resolving_folds_the_field_techniques_and_adds_the_implied_ones():
    workload = resolve(Workload(model="tiny-llama", world_size=2, techniques=("checkpointing", "bf16-mixed")))
    assert workload.precision == "bf16-mixed" and workload.techniques == ("checkpointing",)
    assert [t.name for t in workload.technique_configs] == ["checkpointing", "ddp"]   # --world-size 2 trains with DDP
    assert resolve(workload) is workload
    assert resolve(Workload(**workload.plain())) == workload


def test_hf_config_paths(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(MemfitError, match="cannot read"):
        resolve(Workload(model=str(tmp_path / "bad.json")))
    (tmp_path / "nomodel.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(MemfitError, match="model_type"):
        resolve(Workload(model=str(tmp_path / "nomodel.json")))
    with pytest.raises(MemfitError, match="no model config"):
        resolve(Workload(model=str(tmp_path / "missing" / "config.json")))
    folder = tmp_path / "mymodel"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 128}))
    workload = ResolvedWorkload(model=str(folder), seq_len=32)
    assert workload.source.head == "causal-lm" and workload.source.hf_class_name == "LlamaForCausalLM"


def test_long_sequences_extend_learned_positions():
    workload = ResolvedWorkload(model="tiny-gpt2", seq_len=2048, allow_long_seq=True)
    assert workload.source.config().n_positions == 2048
    assert ResolvedWorkload(model="tiny-llama", task="inference", seq_len=1000, new_tokens=100,
                    allow_long_seq=True).total_tokens == 1100


def test_defaults_and_json_round_trip():
    workload = ResolvedWorkload(model="tiny-llama")
    assert workload.effective_seq_len == 512
    assert ResolvedWorkload(model="tiny-vit").effective_seq_len == 64
    data = workload.to_json()
    assert resolve(Workload.from_json({**data, "seq_len": data["seq_len"]})).effective_seq_len == 512
