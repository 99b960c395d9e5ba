"""The traced estimator against real CPU runs, against itself at full depth, and its GPU modelling."""
import json
import subprocess
import sys

import pytest
import torch

from memfit.estimators.traced import traced_estimate
from memfit.measurement import measure
from memfit.specs.hardware import get_gpu
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import EXAMPLES, rel

ZOO = {   # (model, inputs, seq_len): decoder, encoder, encoder-decoder, MoE, ViT, decoder (GPT-2), CNN, LSTM
    "tiny-llama": ("tiny-llama", None, 64), "tiny-bert": ("tiny-bert", None, 64), "tiny-t5": ("tiny-t5", None, 64),
    "tiny-mixtral": ("tiny-mixtral", None, 64), "tiny-vit": ("tiny-vit", None, 64),
    "tiny-gpt2": ("tiny-gpt2", None, 64),
    # the 2025 families (issue 39): query/key norms, OLMo 2's norms after each sublayer, Gemma 3's sliding and global
    # layers with one key/value head, Qwen3-MoE's router, gpt-oss's sinks and clamped experts, DeepSeek-V3's MLA
    "tiny-qwen3": ("tiny-qwen3", None, 64), "tiny-qwen3-moe": ("tiny-qwen3-moe", None, 64),
    "tiny-olmo2": ("tiny-olmo2", None, 64), "tiny-gemma3": ("tiny-gemma3", None, 64),
    "tiny-gpt-oss": ("tiny-gpt-oss", None, 64), "tiny-deepseek-v3": ("tiny-deepseek-v3", None, 64),
    "convnet": (*EXAMPLES["convnet"], 64), "lstm": (*EXAMPLES["lstm"], 64),
}
SETTINGS = {"train-fp32": dict(task="train"), "train-bf16-mixed": dict(task="train", precision="bf16-mixed"),
            "inference": dict(task="inference")}


def _cpu_runs_a_bfloat16_lstm() -> bool:
    """oneDNN builds its bf16 LSTM primitive only on CPUs with bfloat16 support (AVX512-BF16 or AMX): elsewhere the
    real run and the trace's kernel probe both fail to create it."""
    lstm = torch.nn.LSTM(4, 4)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lstm(torch.randn(2, 1, 4))
    except RuntimeError:
        return False
    return True


def _workload(name, setting):
    model, inputs, seq = ZOO[name]
    kwargs = dict(SETTINGS[setting])
    if kwargs["task"] == "inference" and name not in ("tiny-bert", "tiny-vit", "convnet", "lstm"):
        kwargs["new_tokens"] = 3
    return ResolvedWorkload(model=model, inputs=inputs, batch_size=2, seq_len=seq, **kwargs)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(ZOO))
def test_traced_matches_the_measured_cpu_run(name, setting):
    if name == "lstm" and setting == "train-bf16-mixed" and not _cpu_runs_a_bfloat16_lstm():
        pytest.skip("this CPU's oneDNN has no bfloat16 LSTM primitive (no AVX512-BF16 or AMX)")
    measured = measure(_workload(name, setting), estimates=("traced",))
    traced = measured.extra["estimates"]["traced"]
    assert rel(traced["peak_bytes"], measured.peak_bytes) < 0.01
    # The real run reaches its peak in the phase the trace names. Where two phases tie (the end of backward and
    # the optimizer's start hold the same tensors), a few bytes of scalar temporaries decide which one the
    # allocator sees first, so a phase within 0.1 % of the peak counts as the same peak.
    real_peak_in_traced_phase = measured.extra["phase_peak_bytes"][traced["peak_phase"]]
    assert rel(real_peak_in_traced_phase, measured.peak_bytes) < 0.001


@pytest.mark.parametrize("name, seq, new_tokens, precision, target", [
    ("tiny-llama", 64, 12, "fp32", None), ("tiny-t5", 32, 10, "fp32", None),
    ("tiny-mixtral", 32, 8, "bf16", "h100"), ("tiny-gemma2", 70, 9, "fp32", None)])
def test_a_long_generation_traces_four_decode_steps_and_equals_the_full_trace(name, seq, new_tokens, precision, target):
    """Issue 39: the steps after the fourth are read off the last three traced (the cache grows a token a step), so
    an 8B model's 512-token generation estimates in seconds (benchmarks/estimate_speed.py); every component equals
    the trace of every step (Gemma 2: sliding windows the prompt already fills)."""
    workload = ResolvedWorkload(model=name, task="inference", batch_size=2, seq_len=seq, precision=precision,
                                new_tokens=new_tokens)
    gpu = get_gpu(target) if target else None
    fast, full = traced_estimate(workload, gpu), traced_estimate(workload, gpu, full_trace=True)
    assert any(f"4 of {new_tokens} decode steps" in note for note in fast.notes)
    assert fast.peak_bytes == full.peak_bytes and fast.component_peaks == full.component_peaks


def test_a_sliding_window_filling_up_mid_generation_traces_every_step():
    workload = ResolvedWorkload(model="tiny-gemma3", task="inference", batch_size=2, seq_len=24, new_tokens=12)
    assert not any("decode steps" in note for note in traced_estimate(workload).notes)   # window 32: filled at 32


def test_cpu_kernel_scratch_is_probed():
    """oneDNN convolutions and LSTMs allocate inside the kernel, and the fake LSTM returns an empty
    workspace; without the probe the CNN and LSTM would be several percent low."""
    for name in ("convnet", "lstm"):
        workload = _workload(name, "train-fp32")
        measured = measure(workload, estimates=("traced",))
        assert measured.extra["untracked_bytes"] > 0.02 * measured.peak_bytes       # the kernels do allocate
        traced = measured.extra["estimates"]["traced"]
        assert any("probed" in note for note in traced["notes"])
        assert rel(traced["peak_bytes"], measured.peak_bytes) < 0.01


def _deep_config(tmp_path, model_type, **fields):
    base = {"llama": dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=5000, max_position_embeddings=256),
            "t5": dict(architectures=["T5ForConditionalGeneration"], d_model=64, d_kv=16, d_ff=128, num_heads=4,
                       vocab_size=500, decoder_start_token_id=0, pad_token_id=0),
            "gemma2": dict(architectures=["Gemma2ForCausalLM"], hidden_size=64, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=500, sliding_window=16,
                           max_position_embeddings=256, query_pre_attn_scalar=16),
            "gpt2": dict(architectures=["GPT2LMHeadModel"], n_embd=64, n_head=4, vocab_size=500, n_positions=256),
            # per-layer windows: the depth-sampled trace cuts the list with the layers
            "longformer": dict(architectures=["LongformerForMaskedLM"], hidden_size=64, num_attention_heads=4,
                               intermediate_size=128, vocab_size=500, max_position_embeddings=258, type_vocab_size=1,
                               pad_token_id=1, attention_window=[16] * fields.get("num_hidden_layers", 12))}
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({"model_type": model_type, **base[model_type], **fields}))
    return str(path)


@pytest.mark.parametrize("model_type, layers", [("llama", dict(num_hidden_layers=10)), ("t5", dict(num_layers=9)),
                                                 ("gemma2", dict(num_hidden_layers=12)), ("gpt2", dict(n_layer=11)),
                                                 ("longformer", dict(num_hidden_layers=6))])
@pytest.mark.parametrize("task", ["train", "inference"])
def test_extrapolated_trace_equals_the_full_trace(tmp_path, model_type, layers, task):
    """Trace 2, 3, 4 layers (4, 6, 8 for alternating layers) and extrapolate: the same bytes as tracing all."""
    config = _deep_config(tmp_path, model_type, **layers)
    extra = {"new_tokens": 2} if task == "inference" and model_type not in ("bert", "longformer") else {}
    workload = ResolvedWorkload(model=config, task=task, batch_size=4, seq_len=48, **extra)
    short = traced_estimate(workload)
    full = traced_estimate(workload, full_trace=True)
    assert "extrapolated" in " ".join(short.notes)
    assert short.at_peak == full.at_peak and short.peak_phase == full.peak_phase
    assert short.component_peaks == full.component_peaks


def test_longformer_deeper_than_the_trace_matches_a_real_cpu_step(tmp_path):
    """Longformer's attention_window is a per-layer list: the trace of 2-4 layers cuts it (issue 39)."""
    workload = ResolvedWorkload(model=_deep_config(tmp_path, "longformer", num_hidden_layers=6), batch_size=2,
                                seq_len=64)
    measured = measure(workload, estimates=("traced",))
    assert rel(measured.extra["estimates"]["traced"]["peak_bytes"], measured.peak_bytes) < 0.02


def test_large_vocabulary_backward_peak_crosses_over(tmp_path):
    """A big vocabulary moves the backward peak from its start (activations) to after the LM head
    (gradients); extrapolation must follow the right one at every depth."""
    config = _deep_config(tmp_path, "llama", num_hidden_layers=12, vocab_size=60000)
    for batch, seq in [(1, 16), (8, 128)]:
        workload = ResolvedWorkload(model=config, batch_size=batch, seq_len=seq)
        assert traced_estimate(workload).at_peak == traced_estimate(workload, full_trace=True).at_peak


def test_gpu_target_models_cuda():
    workload = ResolvedWorkload(model="tiny-llama", batch_size=2, seq_len=64, precision="bf16-mixed")
    cpu, gpu = traced_estimate(workload), traced_estimate(workload, get_gpu("h100"))
    params = gpu.model_state_bytes["parameters"]
    assert gpu.component_peaks["temporaries"] >= params          # foreach AdamW: sqrt of every exp_avg_sq at once
    assert cpu.component_peaks["temporaries"] < params           # CPU: per-parameter temporaries
    assert gpu.overhead_bytes > 0 and gpu.fits is True and gpu.sources["cuda_context"] == "assumed"
    assert gpu.peak_bytes % 512 == 0                              # caching-allocator rounding
    fused = traced_estimate(ResolvedWorkload(**{**workload.plain(), "optimizer_impl": "fused"}), get_gpu("h100"))
    assert fused.component_peaks["temporaries"] < params         # --optimizer-impl fused: the step in place


def test_cuda_emulation_follows_cuda_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.estimators.cuda_emulation import CudaAutocast, CudaKernels

    with FakeTensorMode(), CudaKernels(capability=(8, 0)):
        x = torch.randn(4, 8, requires_grad=True)
        w = torch.nn.Parameter(torch.randn(16, 8))
        y = torch.nn.functional.dropout(x, 0.1, True)
        assert y.shape == x.shape and y.grad_fn.__class__.__name__.startswith("NativeDropout")
        with CudaAutocast(torch.bfloat16) as autocast:
            h = torch.nn.functional.linear(x, w)
            assert h.dtype == torch.bfloat16
            assert torch.nn.functional.layer_norm(h, (16,)).dtype == torch.float32
            assert torch.softmax(h, -1).dtype == torch.float32
            torch.nn.functional.linear(x, w)
            assert len(autocast.cache) == 2                  # each leaf (x and w) was cast once and reused
            with torch.autocast("cpu", enabled=False):   # a region nested in the model turns autocast off
                assert torch.nn.functional.linear(x, w).dtype == torch.float32
        assert not autocast.cache                            # the cache dies with the region


def test_tracing_a_huge_model_allocates_nothing_real():
    # The child's own peak resident memory: VmHWM of its address space. (ru_maxrss would also count the
    # pages it shared with this test process between fork and exec: the whole pytest process.)
    code = ("import re, memfit.estimators.traced as t, memfit.specs.workload as w;"
            "e = t.traced_estimate(w.Workload(model='llama-3.1-405b', batch_size=1, seq_len=4096,"
            " precision='bf16-mixed'));"
            "print(e.peak_bytes, re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 4 * 405e9          # terabytes estimated ...
    assert int(out[1]) * 1024 < 2 * 2**30   # ... in under 2 GiB of resident memory
