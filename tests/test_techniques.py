"""Techniques applied for real: predicted peak (traced, analytic) against a real CPU run, the measured
saving against the predicted one, and the results against the same training without the technique."""
import gc
import weakref

import pytest
import torch

import memfit
from memfit.core.errors import MemfitError
from memfit.measurement import measure
from memfit.measurement.training import text_batches
from memfit.techniques.base import parse_technique
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import (
    EXAMPLES,
    HALF_SHAPE,
    LOSS_SHAPE,
    POINT,
    SHAPE,
    assert_analytic,
    host_predicted_as_measured,
    predicted,
    rel,
    shape_for,
)

# (techniques measured, techniques of the baseline they are compared with)
MODES = [
    (("checkpointing",), ()),
    (("checkpointing:every=2",), ()),
    (("checkpointing:mode=selective",), ()),
    (("chunked-ce",), ()),
    (("chunked-ce:mode=upcast",), ()),
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
    (("checkpointing:mode=offload",), ()),
    (("cpu-offload",), ()),
    (("lora",), ()),
    (("lora:targets=all-linear",), ()),
    (("lora:rank=8,targets=q_proj|k_proj|v_proj|o_proj", "checkpointing", "bf16-mixed"),
     ("checkpointing", "bf16-mixed")),
    (("qlora",), ()),
    (("qlora:format=fp4,double_quant=false", "checkpointing", "bf16-mixed"), ("checkpointing", "bf16-mixed")),
    (("prune-structured",), ()),
]


@pytest.fixture(scope="session")
def eager_llama(tmp_path_factory) -> str:
    """tiny-llama's config.json with eager attention, as a user's model might have it."""
    import json

    from memfit.specs.model_source import catalog

    path = tmp_path_factory.mktemp("eager") / "config.json"
    path.write_text(json.dumps({**catalog()["tiny-llama"]["hf_config"], "attn_implementation": "eager"}))
    return str(path)


# Each mode's analytic error today where it is more than a rounding (against the real run's peak, as a fraction of
# it; this file's shapes, torch 2.13, CPU): a mode is held to its error plus one point, so a change that moves the
# estimate by a point fails here. Every other mode is within 0.1 %.
ANALYTIC_ERROR = {("chunked-ce",): 0.0016, ("lora:rank=8,targets=q_proj|k_proj|v_proj|o_proj", "checkpointing",
                                                "bf16-mixed"): 0.0006,
                  ("qlora:format=fp4,double_quant=false", "checkpointing", "bf16-mixed"): 0.0008}


@pytest.mark.parametrize("techniques,baseline", MODES)
def test_predicted_peak_and_saving_match_a_real_run(techniques, baseline, measured):
    # autocast alone saves the activations it stores in half less the half copies of the weights: at HALF_SHAPE the
    # copies outweigh it (-1 %), so it is measured at SHAPE (-10 %)
    shape = SHAPE if techniques in (("bf16-mixed",), ("fp16-mixed",)) else shape_for(techniques)
    run, base = measured(techniques, shape=shape), measured(baseline, shape=shape)
    analytic = ANALYTIC_ERROR.get(techniques, 0.001) + POINT
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03   # a trace in a long session varies by up to 2.5 %
    assert rel(predicted(run, "analytic"), run.peak_bytes) < analytic
    saving = base.peak_bytes - run.peak_bytes
    assert saving > 0.05 * base.peak_bytes, "every mode saves memory at this shape"
    for method, tolerance in (("traced", 0.03), ("analytic", analytic)):
        predicted_saving = predicted(base, method) - predicted(run, method)
        assert abs(predicted_saving - saving) <= tolerance * base.peak_bytes, (method, predicted_saving, saving)


@pytest.mark.parametrize("model", ["tiny-llama", "eager", "tiny-qwen2"])
def test_torchtitans_op_policy_keeps_less_than_selective_and_is_predicted(model, eager_llama, measured):
    """checkpointing:mode=selective-op saves SDPA's output and every other aten.mm, recomputing bmm (eager
    attention) and addmm (Qwen2's biased projections): between full recompute and `selective`, and both
    estimators within 2 % of the real run."""
    op = measured(("checkpointing:mode=selective-op",), eager_llama if model == "eager" else model)
    if model == "tiny-llama":   # the other modes' runs are MODES' (measured once per session)
        full, selective = measured(("checkpointing",)), measured(("checkpointing:mode=selective",))
        assert full.peak_bytes < op.peak_bytes < selective.peak_bytes
    assert rel(predicted(op, "traced"), op.peak_bytes) < 0.02
    assert rel(predicted(op, "analytic"), op.peak_bytes) < 0.02


@pytest.mark.parametrize("model,task,techniques", [
    ("eager", "train", ("sdpa",)), ("eager", "inference", ("sdpa",)),
    ("tiny-qwen2", "train", ("sliding-window:window=64",)), ("tiny-qwen2", "inference", ("sliding-window:window=64",)),
])
def test_attention_techniques_change_memory_as_predicted(model, task, techniques, eager_llama, measured):
    model = eager_llama if model == "eager" else model
    run, base = measured(techniques, model, task), measured((), model, task)
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    assert_analytic(run)
    change = base.peak_bytes - run.peak_bytes
    for method, tolerance in (("traced", 0.03), ("analytic", POINT)):
        assert abs(predicted(base, method) - predicted(run, method) - change) <= tolerance * base.peak_bytes
    if techniques == ("sdpa",):
        assert change > 0.1 * base.peak_bytes, "eager attention saves the seq x seq scores for backward"


def test_sdpa_gives_eager_attention_results(eager_llama, losses):
    got, base = losses(("sdpa",), eager_llama), losses((), eager_llama)
    assert rel(got[0], base[0]) < 1e-4 and all(rel(a, b) < 0.01 for a, b in zip(got, base))
    window = losses(("sliding-window:window=64",), "tiny-qwen2")
    assert window != losses((), "tiny-qwen2") and window[-1] < window[0] - 0.1


@pytest.mark.parametrize("techniques", [m.values[0] if hasattr(m, "values") else m[0] for m in MODES])
def test_results_change_only_as_the_risk_label_says(techniques, losses):
    shape = shape_for(techniques, LOSS_SHAPE)
    got, base = losses(techniques, shape=shape), losses((), shape=shape)
    assert got[-1] < got[0] - 0.1, f"the loss must still decrease: {got}"
    risks = {parse_technique(spec).risk for spec in techniques}
    if risks == {"lossless"}:
        assert all(rel(a, b) < 1e-6 for a, b in zip(got, base)), (got, base)
    elif "lossy" not in risks:
        assert rel(got[0], base[0]) < 1e-3, (got, base)             # same model, same batch
        assert all(rel(a, b) < 0.02 for a, b in zip(got, base)), (got, base)
    else:
        assert got != base, "a lossy technique that changes nothing is mislabelled"


def test_optimizer_in_backward_saves_the_gradients_and_changes_no_result(losses):
    """A step whose peak is the optimizer's (a tiny batch): in backward each parameter steps as its gradient is
    complete, so the gradients and the whole-model step temporaries are never held at once; each parameter gets
    the same update as from one optimizer over all (lossless)."""
    shape = dict(model="tiny-llama", batch_size=1, seq_len=16)
    for impl in (None, "fused"):
        run = measure(ResolvedWorkload(**shape, optimizer_impl=impl, techniques=("optimizer-in-backward",)))
        base = measure(ResolvedWorkload(**shape, optimizer_impl=impl))
        gradients = base.model_state_bytes["gradients"]
        assert run.peak_phase == "backward" and run.peak_bytes < base.peak_bytes - gradients / 2, (impl, run, base)
        for method in ("traced", "analytic"):
            assert rel(predicted(run, method), run.peak_bytes) < 0.01, (impl, method)
    got, base = losses(("optimizer-in-backward",)), losses(())
    assert all(rel(a, b) < 1e-6 for a, b in zip(got, base)), (got, base)


def test_lora_adapters_in_the_models_dtype_as_torchtune_keeps_them(measured):
    """peft upcasts a bfloat16 model's adapters to float32 (and each adapted linear's input with them);
    adapter_dtype=model keeps them in bfloat16, as torchtune's LoRA does: less memory, and both estimators on
    the real run."""
    upcast = measured(("bf16", "lora"), shape=HALF_SHAPE)
    kept = measured(("bf16", "lora:adapter_dtype=model"), shape=HALF_SHAPE)
    assert kept.peak_bytes < upcast.peak_bytes
    assert rel(predicted(upcast, "traced"), upcast.peak_bytes) < 0.02
    for method in ("traced", "analytic"):
        assert rel(predicted(kept, method), kept.peak_bytes) < 0.02, method
    with pytest.raises(MemfitError, match="adapter_dtype must be one of float32, model"):
        parse_technique("lora:adapter_dtype=bf16")


def test_optimizer_in_backward_refuses_what_needs_every_gradient_at_once():
    for flags, message in ((dict(precision="fp16-mixed"), "GradScaler unscales every gradient"),
                           (dict(techniques=("sequence-chunks:window=64",)), "runs backward once per window"),
                           (dict(techniques=("cpu-offload",)), "steps the optimizer on the host"),
                           (dict(world_size=2, techniques=("ddp",)), "before the gradients are reduced"),
                           (dict(task="inference"), "drop it for --task inference")):
        techniques = ("optimizer-in-backward", *flags.pop("techniques", ()))
        with pytest.raises(MemfitError, match=message):
            ResolvedWorkload(model="tiny-llama", techniques=techniques, **flags)


COMPOSITIONS = [
    ("bf16-mixed", "checkpointing", "adamw8bit"),
    ("bf16", "checkpointing:mode=selective", "chunked-ce"),
    ("fp16-mixed", "checkpointing:every=2", "adafactor"),
    ("truncate:max_len=192", "sequence-chunks:window=64", "checkpointing"),
    ("sequence-chunks:window=128", "chunked-ce", "adamw8bit"),
    ("bf16-mixed", "checkpointing", "chunked-ce", "adamw8bit"),
    ("bf16-mixed", "checkpointing:mode=offload,every=2", "cpu-offload", "chunked-ce"),
]


@pytest.mark.parametrize("techniques", COMPOSITIONS)
def test_compositions_of_three_or_more(techniques, measured):
    shape = shape_for(techniques)
    run, base = measured(techniques, shape=shape), measured((), shape=shape)
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    # the analytic estimate of the last composition is +4.4 % today (not explained yet)
    assert_analytic(run, error=0.0444 if "cpu-offload" in techniques else 0.0)
    assert run.peak_bytes < base.peak_bytes


@pytest.mark.parametrize("techniques", [("checkpointing:mode=offload",), ("cpu-offload",), COMPOSITIONS[-1]])
def test_offload_reports_the_host_ram_it_needs(techniques, measured):
    """Offload moves memory to the host: the run's host tensors against the predicted host RAM."""
    shape = shape_for(techniques)
    run, base = measured(techniques, shape=shape), measured((), shape=shape)
    assert base.host_bytes == 0 and run.host_bytes > 0.2 * base.peak_bytes
    host_predicted_as_measured(run)


def test_stream_layers_runs_inference_in_less_device_memory(measured):
    """Block weights in host RAM, each block's copied in while it runs: the device holds one block's."""
    run, base = measured(("stream-layers",), task="inference"), measured((), task="inference")
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    assert_analytic(run)
    assert run.peak_bytes < 0.8 * base.peak_bytes and run.host_bytes > 0
    host_predicted_as_measured(run)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = text_batches(batch_size=2, seq_len=32, num_batches=1)[0]["input_ids"] % 256
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)
        memfit.apply_(model, None, ["stream-layers"])
        assert all(p.device.type == "cpu" for p in model.model.layers.parameters())
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), expected)


def test_park_frozen_keeps_idle_frozen_weights_on_the_host():
    """A classifier on a frozen encoder: the frozen weights wait in host RAM outside their own forward, so
    backward and the optimizer step run without them; the trace predicts it, and training is unchanged."""
    model, inputs = EXAMPLES["frozen_encoder"]
    shape = {"model": model, "inputs": inputs, "task": "train", "batch_size": 8, "seq_len": 128}
    run, base = (measure(ResolvedWorkload(**shape, techniques=t), estimates=("traced",))
                 for t in (("park-frozen",), ()))
    from memfit.examples.frozen_encoder import build, make_inputs

    frozen = sum(p.numel() * 4 for p in build().parameters() if not p.requires_grad)
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    assert run.host_bytes == frozen and base.host_bytes == 0
    assert base.peak_bytes - run.peak_bytes > 0.8 * frozen   # the peak falls in backward, without them
    runs = []
    for techniques in ((), ("park-frozen",)):
        torch.manual_seed(0)
        net = build()
        setup = memfit.apply_(net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad]), techniques)
        torch.manual_seed(1)
        runs.append([float(setup.step(make_inputs(8, 64))) for _ in range(3)])
    assert runs[1] == runs[0]
    with pytest.raises(MemfitError, match="no frozen module"):
        memfit.apply_(torch.nn.Linear(4, 4), None, ["park-frozen"])


def test_allocator_techniques_change_only_the_cuda_reserve(measured):
    """expandable-segments and release-cache act on CUDA's caching allocator: the tensors' peak is the same, the
    simulated allocator runs with expandable segments for the first (tests/test_caching_allocator.py replays it);
    on the CPU they change nothing."""
    from memfit.specs.hardware import get_gpu

    gpu = get_gpu("h100")
    base = memfit.estimate(ResolvedWorkload(**SHAPE), method="analytic", gpu=gpu)
    for name in ("expandable-segments", "release-cache"):
        run = memfit.estimate(ResolvedWorkload(**SHAPE, techniques=(name,)), method="analytic", gpu=gpu)
        assert run.peak_bytes == base.peak_bytes and run.sources["allocator_reserve"] == "simulated"
        assert run.allocator["expandable_segments"] is (name == "expandable-segments")
        cpu = measured((name,))
        assert cpu.peak_bytes == measured(()).peak_bytes


def test_custom_module_blocks_are_found_or_named():
    model, inputs = EXAMPLES["convnet"]
    shape = {"model": model, "inputs": inputs, "batch_size": 8, "seq_len": 32}
    base = measure(ResolvedWorkload(**shape), estimates=("traced",))
    for spec in ("checkpointing", r"checkpointing:blocks=blocks\.[02]"):
        run = measure(ResolvedWorkload(**shape, techniques=(spec,)), estimates=("traced",))
        assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
        assert run.peak_bytes < base.peak_bytes
    lstm, lstm_inputs = EXAMPLES["lstm"]
    with pytest.raises(MemfitError, match="blocks=REGEX"):
        measure(ResolvedWorkload(model=lstm, inputs=lstm_inputs, techniques=("checkpointing",)), estimates=("traced",))


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


def test_cpu_offload_accumulates_micro_batches_on_the_host(losses):
    """With gradient accumulation (sequence windows) the host adds each micro-batch's gradient: same losses."""
    windows = ("sequence-chunks:window=64",)
    assert losses(windows + ("cpu-offload",)) == losses(windows)


def test_offload_in_a_users_own_loop_changes_no_result():
    """cpu-offload rebuilds the user's optimizer (kind and settings) over host master weights; with the
    saved activations offloaded too, training gives the same losses as without."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.techniques.offload import HostOffloadOptimizer

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, use_cache=False)
    batch = text_batches(batch_size=2, seq_len=64, num_batches=1)[0]
    runs = []
    for techniques in ((), ("checkpointing:mode=offload", "cpu-offload")):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        setup = memfit.apply_(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05), techniques)
        runs.append([float(setup.step(batch)) for _ in range(4)])
    assert isinstance(setup.optimizer, HostOffloadOptimizer)
    assert type(setup.optimizer.inner) is torch.optim.AdamW and setup.optimizer.param_groups[0]["weight_decay"] == 0.05
    assert runs[1] == runs[0] and runs[0][-1] < runs[0][0]
    # The gradient hooks stay on the user's model (still referenced here); they must not keep the optimizer
    # and its host copies alive.
    optimizer = weakref.ref(setup.optimizer)
    del setup
    gc.collect()
    assert optimizer() is None


def test_lora_on_a_mixture_of_experts_keeps_no_expert_inputs(measured):
    """Frozen experts need no weight gradients, so their grouped matmuls save no inputs (predicted)."""
    run, base = measured(("lora",), "tiny-mixtral"), measured((), "tiny-mixtral")
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    assert_analytic(run)
    assert run.peak_bytes < 0.7 * base.peak_bytes


def test_lora_in_a_users_loop_trains_only_the_adapters():
    """apply_ wraps the user's model with peft and rebuilds their optimizer (kind and settings) over the
    adapters; B starts at zero, so the first loss is the base model's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=256)
    batch = text_batches(batch_size=2, seq_len=32, num_batches=1)[0]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        base = float(model(**batch).loss)
    setup = memfit.apply_(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), ["lora:rank=4"])
    trained = [p for p in setup.model.parameters() if p.requires_grad]
    assert {id(p) for p in setup.optimizer.param_groups[0]["params"]} == {id(p) for p in trained}
    assert setup.optimizer.param_groups[0]["weight_decay"] == 0.1 and len(trained) == 2 * 2 * 2
    frozen = {n: p.detach().clone() for n, p in setup.model.named_parameters() if not p.requires_grad}
    first = [float(setup.step(batch)) for _ in range(3)]
    assert first[0] == base and first[-1] < first[0]
    assert all(torch.equal(p, frozen[n]) for n, p in setup.model.named_parameters() if not p.requires_grad)
    with pytest.raises(MemfitError, match="no module named c_attn"):
        memfit.apply_(LlamaForCausalLM(config), None, ["lora:targets=c_attn"])
