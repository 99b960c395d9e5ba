"""The analytic estimator against the traced one, its extrapolation, and the published accountings."""
import importlib.util
import json
from pathlib import Path

import pytest

from memfit.core.categories import CATEGORIES
from memfit.estimators.analytic import analytic_estimate, simulate
from memfit.estimators.analytic.host import parameter_sizes, stage3_gathered_bytes
from memfit.estimators.sharding import zero_paper_table
from memfit.estimators.traced import traced_estimate
from memfit.measurement import measure
from memfit.specs.hardware import get_gpu
from memfit.specs.model_source import catalog
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import rel


def _load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


points = _load_benchmark("analytic_vs_traced").points   # the benchmark's (batch, sequence) points per model

TINY = ["tiny-llama", "tiny-gpt2", "tiny-bert", "tiny-t5", "tiny-mixtral", "tiny-vit", "tiny-gemma2", "tiny-phi3",
        "tiny-qwen2"]
# issue 39's families: each precision on a GPU target in tests/test_gpu_target.py and against real CPU steps below;
# the component-by-component matrix at bf16-mixed (the suite's time)
TINY_2025 = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-olmo2", "tiny-gemma3", "tiny-gpt-oss"]
FAMILY_MATRIX = [(name, precision) for name in TINY for precision in ("fp32", "bf16-mixed", "bf16")] + [
    (name, "bf16-mixed") for name in TINY_2025]


def assert_close(analytic, traced, peak_tol=0.05, component_tol=0.10):
    """Peak within 5 %; each category's own peak within 10 % (or 0.5 % of the peak, for slivers).
    Categories *at* the peak are not compared: two instants a few bytes apart can swap places."""
    assert rel(analytic.peak_bytes, traced.peak_bytes) < peak_tol, (analytic.peak_bytes, traced.peak_bytes)
    floor = 0.005 * traced.peak_bytes
    for name in CATEGORIES:
        a, t = analytic.component_peaks[name], traced.component_peaks[name]
        assert abs(a - t) <= max(component_tol * t, floor), (name, a, t)


@pytest.mark.parametrize("target", ["cpu", "h100"])
@pytest.mark.parametrize("name, precision", FAMILY_MATRIX)
def test_every_family_matches_the_trace(name, precision, target):
    gpu = get_gpu(target) if target != "cpu" else None
    seq = 64
    # inference at batch 1 on a GPU target: tests/test_gpu_target.py, every precision and attention. Training at
    # batch 1 takes the model's own one-sequence paths (views where more sequences copy), the same on every device:
    # checked on the CPU target (the suite's time)
    for task, batch in ((("train", 1),) if target == "cpu" else ()) + (("train", 4), ("inference", 4)):
        extra = {"new_tokens": 3} if task == "inference" and name not in ("tiny-bert", "tiny-vit") else {}
        workload = ResolvedWorkload(model=name, task=task, batch_size=batch, seq_len=seq, precision=precision,
                                    **extra)
        assert_close(analytic_estimate(workload, gpu), traced_estimate(workload, gpu))


@pytest.mark.parametrize("name", TINY_2025)
def test_the_2025_families_match_a_real_cpu_step(name):
    """Issue 39's families against a real CPU step (the trace against it too: tests/test_traced.py): the analytic
    programs to the byte but for OLMo 2's bf16 inference (within 1.1 % of the trace, not run here)."""
    for settings in (dict(task="train", precision="bf16-mixed"), dict(task="inference", new_tokens=3)):
        workload = ResolvedWorkload(model=name, batch_size=2, seq_len=64, **settings)
        measured = measure(workload, estimates=("analytic",))
        assert rel(measured.extra["estimates"]["analytic"]["peak_bytes"], measured.peak_bytes) < 0.001, settings


def test_deepseek_matches_a_real_cpu_training_step():
    workload = ResolvedWorkload(model="tiny-deepseek-v3", batch_size=2, seq_len=64, precision="bf16-mixed")
    measured = measure(workload, estimates=("analytic",))
    assert rel(measured.extra["estimates"]["analytic"]["peak_bytes"], measured.peak_bytes) < 0.001


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_deepseek_latent_attention_matches_the_trace(precision):
    """DeepSeek-V3 (multi-head latent attention, a compressed cache, grouped sigmoid routing, shared experts, a
    dense first layer): training on CPU and H100 and inference on H100 as the family matrix holds the others. CPU
    inference runs SDPA's math kernel (the values are narrower than the keys) in a no-grad order the program
    follows only roughly: its peak within 3 % (1.2-2.7 % under the trace)."""
    for target, task, batch in (("cpu", "train", 4), ("h100", "train", 4), ("h100", "inference", 4),
                                ("cpu", "inference", 4)):
        gpu = get_gpu(target) if target != "cpu" else None
        extra = {"new_tokens": 3} if task == "inference" else {}
        workload = ResolvedWorkload(model="tiny-deepseek-v3", task=task, batch_size=batch, seq_len=64,
                                    precision=precision, **extra)
        analytic, traced = analytic_estimate(workload, gpu), traced_estimate(workload, gpu)
        if (target, task) == ("cpu", "inference"):
            assert rel(analytic.peak_bytes, traced.peak_bytes) < 0.03, (analytic.peak_bytes, traced.peak_bytes)
        else:
            assert_close(analytic, traced)


@pytest.mark.parametrize("target", ["cpu", "h100"])
@pytest.mark.parametrize("name", ["tiny-bert", "tiny-gpt2", "tiny-t5", "tiny-vit"])
def test_eager_attention_matches_the_trace(name, target, tmp_path):
    """A config asking for attn_implementation "eager": the scores, softmax and dropout are materialised. At 4 × 128
    they are most of the activations: these four families' analytic programs once ran SDPA instead and were 20-85 %
    under an H200's run (benchmarks/results/gpu_validate_replay shows them now)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**catalog()[name]["hf_config"], "attn_implementation": "eager"}))
    gpu = get_gpu(target) if target != "cpu" else None
    for task, precision in (("train", "fp32"), ("train", "bf16-mixed"), ("inference", "fp32")):
        extra = {"new_tokens": 2} if task == "inference" and name in ("tiny-gpt2", "tiny-t5") else {}
        workload = ResolvedWorkload(model=str(config), task=task, batch_size=4, seq_len=128, precision=precision,
                                    **extra)
        analytic, traced = analytic_estimate(workload, gpu), traced_estimate(workload, gpu)
        # training within 0.3 %; T5's inference peak falls where two hidden states outlive the analytic program's
        assert rel(analytic.peak_bytes, traced.peak_bytes) < (0.003 if task == "train" else 0.04), (
            task, precision, analytic.peak_bytes, traced.peak_bytes)


# real sizes, one model per kind of block (the other families are the tiny ones above); every bundled model at
# real size: benchmarks/analytic_vs_traced.py
FAMILY_REPRESENTATIVES = ["bert-base-uncased", "gpt2", "llama-3.1-8b", "mixtral-8x7b", "t5-base",
                          "vit-base-patch16-224"]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_REPRESENTATIVES)
def test_each_family_at_real_size_matches_the_trace_at_three_points(name):
    gpu = get_gpu("h100-sxm-80gb")
    for batch, seq in points(name):
        workload = ResolvedWorkload(model=name, batch_size=batch, seq_len=seq, precision="bf16-mixed")
        assert_close(analytic_estimate(workload, gpu), traced_estimate(workload, gpu))


def test_extrapolation_equals_simulating_every_layer():
    for name, batch, seq in [("llama-2-7b", 1, 512), ("gemma-2-9b", 2, 256), ("t5-base", 4, 128), ("gpt2", 2, 256)]:
        workload = ResolvedWorkload(model=name, batch_size=batch, seq_len=seq, precision="bf16-mixed")
        full = simulate(workload, None, workload.source.num_layers)
        top = max((p for (phase, _), p in full.peaks.items() if phase != "setup"), key=lambda p: p.total)
        estimate = analytic_estimate(workload)
        assert estimate.peak_bytes == top.total and not estimate.notes


def test_zero_paper_figure_1():
    """Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 data-parallel ranks, K = 12."""
    rows = zero_paper_table(7_500_000_000, 64)
    assert [round(r["total"] / 1e9, 1) for r in rows] == [120.0, 31.4, 16.6, 1.9]


def test_gpt3_model_states_corrected():
    """175B fp32 Adam: 4 + 4 + 8 bytes per parameter; REFERENCE.md's 700 + 700 + 1,400 GB (the seed
    article's figures were off by ten). The bundled config counts 174.6B parameters, within 1 %."""
    estimate = analytic_estimate(ResolvedWorkload(model="gpt3-175b", batch_size=1, seq_len=128))
    psi = estimate.num_parameters
    states = estimate.model_state_bytes
    assert states["parameters"] == 4 * psi and states["gradients"] == 4 * psi
    assert 8 * psi <= states["optimizer_states"] < 8 * psi + 4 * 10_000   # + a float32 step per tensor
    for name, published_gb in (("parameters", 700), ("gradients", 700), ("optimizer_states", 1400)):
        assert rel(states[name], published_gb * 1e9) < 0.01, (name, states[name])


def test_deepspeed_engine_counts_its_states_and_bucket():
    """DeepSpeed's states per rank (measured against real runs in test_ranks): half weights (stage 3: a
    partition, and the weights it keeps gathered until reused: max_reuse_distance's 1e9 elements for a 7B model,
    plus the norms it never partitions), 12 bytes of float32 masters and moments / N, a float32 gradient
    partition (stage 2: with the 1 GB default reduction bucket; stage 3: made for the optimizer step, beside the
    half one)."""
    base = dict(model="llama-2-7b", batch_size=1, seq_len=512, precision="bf16-mixed", engine="deepspeed",
                world_size=8)
    grads = {}
    for stage in (2, 3):
        workload = ResolvedWorkload(**base, zero_stage=stage)
        estimate = analytic_estimate(workload)
        states, psi = estimate.model_state_bytes, estimate.num_parameters
        gathered = stage3_gathered_bytes(parameter_sizes(workload))
        assert 2 * 10**9 < gathered < 2 * 10**9 + 0.001 * psi
        assert states["parameters"] == (-(-2 * psi // 8) + gathered if stage == 3 else 2 * psi)
        assert states["optimizer_states"] == -(-12 * psi // 8)
        assert states["gradients"] >= -(-4 * psi // 8) + (2 * 500_000_000 if stage == 2 else -(-2 * psi // 8))
        grads[stage] = states["gradients"]
    small = analytic_estimate(ResolvedWorkload(**base, zero_stage=2, reduce_bucket=10**6)).model_state_bytes
    assert grads[2] - small["gradients"] == 2 * (500_000_000 - 10**6)


def test_zero_stages_shard_pytorch_model_states():
    base = dict(model="llama-2-7b", batch_size=1, seq_len=512, precision="bf16-mixed")
    single = analytic_estimate(ResolvedWorkload(**base)).model_state_bytes
    stage3 = analytic_estimate(ResolvedWorkload(**base, world_size=8, zero_stage=3)).model_state_bytes
    for name in single:
        assert stage3[name] == -(-single[name] // 8)
    ddp = analytic_estimate(ResolvedWorkload(**base, world_size=8)).model_state_bytes
    # DDP's reduction buckets: a flat copy of the gradients, and a second while the buckets are rebuilt
    assert ddp["gradients"] == 3 * single["gradients"]
