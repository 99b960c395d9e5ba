"""Techniques applied for real: predicted peak (traced, analytic) against a real CPU run, the measured
saving against the predicted one, and the results against the same training without the technique."""
import functools

import pytest
import torch

import memfit
from memfit.core.errors import MemfitError
from memfit.measurement import measure
from memfit.measurement.training import text_batches, train_run
from memfit.specs.workload import Workload
from memfit.techniques.base import REGISTRY, parse_technique
from memfit.techniques.effects import effect
from tests.conftest import EXAMPLES, rel

SHAPE = {"model": "tiny-llama", "task": "train", "batch_size": 4, "seq_len": 256}

# (techniques measured, techniques of the baseline they are compared with)
MODES = [
    (("checkpointing",), ()),
    (("checkpointing:every=2",), ()),
    (("checkpointing:mode=selective",), ()),
    (("chunked-ce",), ()),
    (("checkpointing", "chunked-ce:chunks=4"), ("checkpointing",)),
    (("truncate:max_len=128",), ()),
    (("sequence-chunks:window=64",), ()),
    (("sequence-chunks:window=96,stride=64",), ()),
    (("adamw8bit",), ()),
    pytest.param(("adamw4bit",), (), marks=pytest.mark.slow),   # torch.compile of the 4-bit step: ~30 s
    (("adafactor",), ()),
    (("bf16-mixed",), ()),
    (("fp16-mixed",), ()),
    (("bf16",), ()),
]


@functools.cache
def measured(techniques: tuple[str, ...], model: str = "tiny-llama", task: str = "train"):
    shape = {**SHAPE, "model": model, "task": task} | ({"new_tokens": 8} if task == "inference" else {})
    return measure(Workload(**shape, techniques=techniques), estimates=("traced", "analytic"))


@pytest.fixture(scope="session")
def eager_llama(tmp_path_factory) -> str:
    """tiny-llama's config.json with eager attention, as a user's model might have it."""
    import json

    from memfit.specs.model_source import catalog

    path = tmp_path_factory.mktemp("eager") / "config.json"
    path.write_text(json.dumps({**catalog()["tiny-llama"]["hf_config"], "attn_implementation": "eager"}))
    return str(path)


def _predicted(result, method: str) -> int:
    return result.extra["estimates"][method]["peak_bytes"]


@pytest.mark.parametrize("techniques,baseline", MODES)
def test_predicted_peak_and_saving_match_a_real_run(techniques, baseline):
    run, base = measured(techniques), measured(baseline)
    assert rel(_predicted(run, "traced"), run.peak_bytes) < 0.03
    assert rel(_predicted(run, "analytic"), run.peak_bytes) < 0.10
    saving = base.peak_bytes - run.peak_bytes
    assert saving > 0.05 * base.peak_bytes, "every mode saves memory at this shape"
    for method, tolerance in (("traced", 0.03), ("analytic", 0.10)):
        predicted_saving = _predicted(base, method) - _predicted(run, method)
        assert abs(predicted_saving - saving) <= tolerance * base.peak_bytes, (method, predicted_saving, saving)


@pytest.mark.parametrize("model,task,techniques", [
    ("eager", "train", ("sdpa",)), ("eager", "inference", ("sdpa",)),
    ("tiny-qwen2", "train", ("sliding-window:window=64",)), ("tiny-qwen2", "inference", ("sliding-window:window=64",)),
])
def test_attention_techniques_change_memory_as_predicted(model, task, techniques, eager_llama):
    model = eager_llama if model == "eager" else model
    run, base = measured(techniques, model, task), measured((), model, task)
    assert rel(_predicted(run, "traced"), run.peak_bytes) < 0.03
    assert rel(_predicted(run, "analytic"), run.peak_bytes) < 0.10
    change = base.peak_bytes - run.peak_bytes
    for method, tolerance in (("traced", 0.03), ("analytic", 0.10)):
        assert abs(_predicted(base, method) - _predicted(run, method) - change) <= tolerance * base.peak_bytes
    if techniques == ("sdpa",):
        assert change > 0.1 * base.peak_bytes, "eager attention saves the seq x seq scores for backward"


def test_sdpa_gives_eager_attention_results(eager_llama):
    got, base = losses(("sdpa",), eager_llama), losses((), eager_llama)
    assert rel(got[0], base[0]) < 1e-4 and all(rel(a, b) < 0.01 for a, b in zip(got, base))
    window = losses(("sliding-window:window=64",), "tiny-qwen2")
    assert window != losses((), "tiny-qwen2") and window[-1] < window[0] - 0.1


@functools.cache
def losses(techniques: tuple[str, ...], model: str = "tiny-llama") -> list[float]:
    workload = Workload(model=model, task="train", batch_size=4, seq_len=192, techniques=techniques)
    batches = text_batches(batch_size=4, seq_len=192, num_batches=5)
    return train_run(workload, batches, lr=1e-3).losses


@pytest.mark.parametrize("techniques", [m.values[0] if hasattr(m, "values") else m[0] for m in MODES])
def test_results_change_only_as_the_risk_label_says(techniques):
    got, base = losses(techniques), losses(())
    assert got[-1] < got[0] - 0.1, f"the loss must still decrease: {got}"
    risks = {parse_technique(spec).risk for spec in techniques}
    if risks == {"lossless"}:
        assert all(rel(a, b) < 1e-6 for a, b in zip(got, base)), (got, base)
    elif "lossy" not in risks:
        assert rel(got[0], base[0]) < 1e-3, (got, base)             # same model, same batch
        assert all(rel(a, b) < 0.02 for a, b in zip(got, base)), (got, base)
    else:
        assert got != base, "a lossy technique that changes nothing is mislabelled"


def test_fp16_overflow_skips_the_step_and_backs_off():
    from memfit.steps.train import TrainLoop
    from memfit.techniques.compose import prepare_step

    torch.manual_seed(0)
    workload = Workload(model="tiny-llama", task="train", batch_size=2, seq_len=32, precision="fp16-mixed")
    model = workload.source.build(device="cpu", dtype=torch.float32)
    loop = TrainLoop(prepare_step(model, workload, device_type="cpu"))
    loop.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60, backoff_factor=2.0**-50)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = text_batches(batch_size=2, seq_len=32, num_batches=1)[0]
    loop.step(batch)
    assert loop.skipped_steps == 1 and loop.scaler.get_scale() == 2.0**10
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters()), "a skipped step changes nothing"
    first = float(loop.step(batch))
    for _ in range(3):
        last = float(loop.step(batch))
    assert loop.skipped_steps == 1 and last < first


COMPOSITIONS = [
    ("bf16-mixed", "checkpointing", "adamw8bit"),
    ("bf16", "checkpointing:mode=selective", "chunked-ce"),
    ("fp16-mixed", "checkpointing:every=2", "adafactor"),
    ("truncate:max_len=192", "sequence-chunks:window=64", "checkpointing"),
    ("sequence-chunks:window=128", "chunked-ce", "adamw8bit"),
    ("bf16-mixed", "checkpointing", "chunked-ce", "adamw8bit"),
]


@pytest.mark.parametrize("techniques", COMPOSITIONS)
def test_compositions_of_three_or_more(techniques):
    run, base = measured(techniques), measured(())
    assert rel(_predicted(run, "traced"), run.peak_bytes) < 0.03
    assert rel(_predicted(run, "analytic"), run.peak_bytes) < 0.10
    assert run.peak_bytes < base.peak_bytes


@pytest.mark.distributed
@pytest.mark.parametrize("techniques", [("fsdp2",), ("fsdp2", "checkpointing", "bf16-mixed")])
def test_fsdp2_on_two_real_ranks(techniques):
    """torchrun starts 2 gloo ranks; each rank's peak against rank 0's trace (fake process group) and the
    analytic model of FSDP2's shards, all-gathers and reduce-scatters."""
    run = measure(Workload(**SHAPE, world_size=2, techniques=techniques), estimates=("traced", "analytic"))
    single = measured(techniques[1:])
    assert len(run.extra["rank_peak_bytes"]) == 2
    assert rel(_predicted(run, "traced"), run.peak_bytes) < 0.03
    assert rel(_predicted(run, "analytic"), run.peak_bytes) < 0.10
    assert run.peak_bytes < single.peak_bytes, "sharding the model states saves memory per rank"


def test_custom_module_blocks_are_found_or_named():
    model, inputs = EXAMPLES["convnet"]
    shape = {"model": model, "inputs": inputs, "batch_size": 8, "seq_len": 32}
    base = measure(Workload(**shape), estimates=("traced",))
    for spec in ("checkpointing", r"checkpointing:blocks=blocks\.[02]"):
        run = measure(Workload(**shape, techniques=(spec,)), estimates=("traced",))
        assert rel(_predicted(run, "traced"), run.peak_bytes) < 0.03
        assert run.peak_bytes < base.peak_bytes
    lstm, lstm_inputs = EXAMPLES["lstm"]
    with pytest.raises(MemfitError, match="blocks=REGEX"):
        measure(Workload(model=lstm, inputs=lstm_inputs, techniques=("checkpointing",)), estimates=("traced",))


def test_apply_to_a_users_own_model_and_optimizer():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, use_cache=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    setup = memfit.apply_(model, optimizer, ["checkpointing", "chunked-ce", "adamw8bit"])
    assert type(setup.optimizer).__name__ == "AdamW8bit" and setup.optimizer.param_groups[0]["lr"] == 3e-3
    batch = text_batches(batch_size=2, seq_len=64, num_batches=1)[0]
    got = [float(setup.step(batch)) for _ in range(4)]
    assert got[-1] < got[0]


def test_bad_input_is_one_error_and_changes_nothing():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, vocab_size=64))
    forwards = [layer.forward for layer in model.model.layers]
    for bad, fragment in ((["checkpointing", "nosuch"], "unknown technique"),
                          (["checkpointing", "checkpointing:every=2"], "given twice"),
                          (["adamw8bit", "adafactor"], "both set the optimizer"),
                          (["checkpointing:mode=fast"], "full or selective"),
                          (["truncate:max_len=x"], "not a valid int")):
        with pytest.raises(MemfitError, match=fragment):
            memfit.apply_(model, None, bad)
    assert [layer.forward for layer in model.model.layers] == forwards
    with pytest.raises(MemfitError, match="ZeRO-1/2"):
        Workload(model="tiny-llama", world_size=2, zero_stage=1, techniques=("adamw8bit",))
    with pytest.raises(MemfitError, match="inference"):
        Workload(model="tiny-llama", task="inference", techniques=("checkpointing",))


def test_every_technique_parses_round_trips_and_has_an_effect(eager_llama):
    where = {"sdpa": {"model": eager_llama}, "sliding-window": {"model": "tiny-qwen2"}, "fsdp2": {"world_size": 2}}
    for name, cls in REGISTRY.items():
        workload = Workload(**{**SHAPE, "seq_len": 128, **where.get(name, {})})
        base = memfit.estimate(workload, method="analytic")
        technique = parse_technique(name)
        assert parse_technique(technique.spec) == technique and cls.risk in ("lossless", "numerical", "lossy")
        changed = effect(technique, base, workload)
        assert changed.extra["effect"]["saved_bytes"] == base.peak_bytes - changed.peak_bytes
        assert changed.extra["effect"]["risk"] == cls.risk
    spec = parse_technique("sequence-chunks:window=64,stride=32").spec
    assert spec == "sequence-chunks:window=64,stride=32"
    data = Workload(**SHAPE, techniques=("checkpointing:every=2", "bf16-mixed")).to_json()
    assert data["precision"] == "bf16-mixed" and data["techniques"] == ["checkpointing:every=2"]
    assert Workload.from_json(data) == Workload(**SHAPE, techniques=("bf16-mixed", "checkpointing:every=2"))
