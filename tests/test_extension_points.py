"""A new mechanism is a declaration: a toy weight format (with its kernel) and a toy KV-cache kind, registered from
this test module as a plugin would, flow through the analytic estimate, the planner and the cost model without an
edit to memfit. The expected bytes are counted independently: the weights from the real model's nn.Linear layers
(built on the meta device), the cache from its configuration."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

from memfit import get_gpu
from memfit.core.errors import MemfitError
from memfit.core.kv_caches import KV_CACHE_KINDS, KVCacheKind, KVState, kv_cache_kind, register_kv_cache_kind
from memfit.core.weight_formats import WEIGHT_FORMATS, State, WeightFormat, register_weight_format
from memfit.estimators.analytic import analytic_estimate
from memfit.estimators.analytic.ops import LINEAR_KERNELS, linear_kernel
from memfit.planner import PlanRequest, plan
from memfit.planner.cost import StepShape, timing
from memfit.specs.model_source import resolve_source
from memfit.techniques import REGISTRY, Technique, register
from memfit.techniques.resolve import ResolvedWorkload

# 6-bit codes, a bfloat16 scale per 32 weights and a float32 offset per tensor; the head kept, a mixture's experts
# stored too; linears run the toy kernel below
TOY_FORMAT = WeightFormat("toy-int6", "a test", 6, "uint8",
                          (State("scale", "bfloat16", 32), State("offset", "float32", "tensor")),
                          kernel="toy_dequantize", experts=True)
# int8 codes and a float16 scale per 64 cached elements, stored in pages of 16 tokens
TOY_KV = KVCacheKind("toy-int8-paged", "a test's toy", dtype="int8", state=(KVState("scale", "float16", 64),),
                     page_tokens=16)
kernel_calls: list[str] = []


def toy_dequantize(e, x, w, out_features, bias):
    """The whole weight dequantized to x's dtype, then x @ it."""
    kernel_calls.append(w.quant.format.name)
    dequantized = e.new(w.shape[0] * w.shape[1], x.dtype)
    out = e.new(x.numel // w.shape[1] * out_features, x.dtype)
    del dequantized
    return out


@dataclass(frozen=True, kw_only=True)
class ToyInt6(Technique):
    name = "toy-int6"
    summary = "a test's toy: 6-bit linear weights"
    risk = "lossy"
    stage = "quantize"
    traits = frozenset({"quantized-linears"})
    search_axis = "weights"

    @classmethod
    def search_values(cls, request, workload):
        return [cls.name] if request.task == "inference" else []

    def weight_format(self):
        return TOY_FORMAT


@dataclass(frozen=True, kw_only=True)
class ToyKv(Technique):
    name = "toy-kv"
    summary = "a test's toy: an int8 paged KV cache"
    risk = "lossy"
    stage = "sequence"

    def analytic_policy(self, workload):
        return {"kv_cache": TOY_KV.name}


@pytest.fixture(autouse=True)
def toys():
    register_weight_format(TOY_FORMAT)
    register_kv_cache_kind(TOY_KV)
    linear_kernel("toy_dequantize")(toy_dequantize)
    register(ToyInt6)
    register(ToyKv)
    kernel_calls.clear()
    yield
    for registry, name in ((WEIGHT_FORMATS, TOY_FORMAT.name), (KV_CACHE_KINDS, TOY_KV.name),
                           (LINEAR_KERNELS, "toy_dequantize"), (REGISTRY, ToyInt6.name), (REGISTRY, ToyKv.name)):
        registry.pop(name, None)


def meta_linears(model: str) -> list[tuple[int, int]]:
    """The shapes of the model's nn.Linear weights but the LM head, from transformers' own model on the meta
    device."""
    net = resolve_source(model).build(device="meta", dtype=torch.bfloat16)
    return [tuple(m.weight.shape) for name, m in net.named_modules()
            if isinstance(m, torch.nn.Linear) and name != "lm_head"]


INFERENCE = dict(model="tiny-llama", task="inference", batch_size=2, seq_len=100, new_tokens=20, precision="bf16")


def test_a_toy_weight_format_is_what_the_analytic_estimate_stores_and_its_kernel_runs():
    plain = analytic_estimate(ResolvedWorkload(**INFERENCE), None)
    toy = analytic_estimate(ResolvedWorkload(**INFERENCE, techniques=("toy-int6",)), None)
    shapes = meta_linears("tiny-llama")
    linear_bytes = sum(rows * inputs * 2 for rows, inputs in shapes)
    stored = sum(TOY_FORMAT.stored_bytes(shape, "bfloat16") for shape in shapes)
    assert stored < linear_bytes / 2   # 6 bits and a little state, of 16 bits
    assert toy.model_state_bytes["parameters"] == plain.model_state_bytes["parameters"] - linear_bytes + stored
    # every quantized linear runs the toy kernel: seven per block, in the prefill and the two decode steps simulated
    assert kernel_calls == ["toy-int6"] * (7 * 4 * 3)


def test_the_cost_model_reads_a_toy_format_for_experts_and_for_a_decode_steps_bytes():
    moe = ResolvedWorkload(model="mixtral-8x7b", task="inference", batch_size=1, seq_len=512, new_tokens=64,
                           precision="bf16", techniques=("toy-int6",))
    config = moe.source.config()
    shape = StepShape.of(moe, 46_702_792_704)
    e, h, i, layers = (config.num_local_experts, config.hidden_size, config.intermediate_size,
                       config.num_hidden_layers)
    expected = layers * (TOY_FORMAT.stored_bytes((e, 2 * i, h), "bfloat16")
                         + TOY_FORMAT.stored_bytes((e, h, i), "bfloat16"))
    assert shape.expert_bytes == expected
    assert expected < layers * e * 3 * h * i * 2 / 2
    gpu = get_gpu("a100-80gb")
    # (a model whose decode step reads its weights for longer than the host takes to launch its kernels)
    dense = dict(model="llama-3.1-70b", task="inference", batch_size=1, seq_len=512, new_tokens=64, precision="bf16")
    plain, toy = ResolvedWorkload(**dense), ResolvedWorkload(**dense, techniques=("toy-int6",))
    plain_time = timing(plain, analytic_estimate(plain, gpu), gpu)
    toy_time = timing(toy, analytic_estimate(toy, gpu), gpu)
    # decoding one token at a time reads the weights, 6-bit ones in about 0.45 of the time; the prefill (compute)
    # stays: about half the time in all
    assert 0.4 * plain_time["step_time_s"] < toy_time["step_time_s"] < 0.55 * plain_time["step_time_s"]


def test_a_toy_kv_cache_kind_is_what_the_estimate_caches_and_the_cost_model_reads():
    workload = ResolvedWorkload(**INFERENCE, techniques=("toy-kv",))
    plain = analytic_estimate(ResolvedWorkload(**INFERENCE), None)
    toy = analytic_estimate(workload, None)
    config = workload.source.config()
    width = INFERENCE["batch_size"] * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    layers, tokens = config.num_hidden_layers, INFERENCE["seq_len"] + INFERENCE["new_tokens"]

    def cache_peak(stored_bytes):
        # the last decode step: every layer's keys and values at `tokens` tokens, beside the last layer's old values
        return 2 * layers * stored_bytes(tokens) + stored_bytes(tokens - 1)

    assert plain.component_peaks["kv_cache"] == cache_peak(lambda n: width * n * 2)
    paged = cache_peak(lambda n: TOY_KV.stored_bytes(width * TOY_KV.stored_tokens(n), "bfloat16"))
    assert TOY_KV.stored_tokens(tokens) == 128 and paged < plain.component_peaks["kv_cache"]
    assert toy.component_peaks["kv_cache"] == paged
    # the cost model reads the cache a decode step reads: at a long context, a smaller cache decodes faster
    gpu = get_gpu("a100-80gb")
    long = dict(INFERENCE, model="llama-3.1-8b", batch_size=16, seq_len=8192, new_tokens=16)
    times = [timing(w, analytic_estimate(w, gpu), gpu)["step_time_s"]
             for w in (ResolvedWorkload(**long), ResolvedWorkload(**long, techniques=("toy-kv",)))]
    assert times[1] < times[0]


def test_the_planner_searches_a_toy_format_and_plans_with_a_toy_kv_kind(capsys):
    small = dataclasses.replace(get_gpu("a100-80gb"), memory_bytes=12 * 2**30)   # 16 GB of bf16 weights do not fit
    load = dict(model="llama-3.1-8b", gpu=small, task="inference", seq_len=2048, batch_size=1, new_tokens=64,
                allow="lossy", top=10)
    request = PlanRequest(**load)
    searched = {tuple(p.techniques): p for p in plan(request).plans}
    toy = searched[("bf16", "toy-int6")]   # a value of the weights axis, as int8-weight-only is
    assert toy.estimate.model_state_bytes == analytic_estimate(toy.workload(request), small).model_state_bytes
    both = PlanRequest(**load, techniques=("toy-int6", "toy-kv"))
    best = plan(both).plans[0]
    assert set(best.techniques) == {"bf16", "toy-int6", "toy-kv"}
    assert best.estimate.component_peaks["kv_cache"] == (
        analytic_estimate(best.workload(both), small).component_peaks["kv_cache"])
    assert best.estimate.component_peaks["kv_cache"] < 0.6 * toy.estimate.component_peaks["kv_cache"]
    from memfit.cli.main import main

    assert main(["estimate", "tiny-llama", "--task", "inference", "--seq-len", "100", "--new-tokens", "20",
                 "--precision", "bf16", "--method", "analytic", "-t", "toy-int6", "-t", "toy-kv", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["component_peaks"]["kv_cache"] > 0


def test_a_format_or_kind_that_declares_something_unknown_is_refused():
    with pytest.raises(Exception, match="dtype"):
        WeightFormat("bad", "a test", 4, "int3", (), kernel="x")
    with pytest.raises(ValueError, match="per"):
        WeightFormat("bad", "a test", 4, "uint8", (State("scale", "float32", "columns"),), kernel="x")
    with pytest.raises(ValueError, match="already registered"):
        register_weight_format(dataclasses.replace(TOY_FORMAT, code_bits=5))
    with pytest.raises(MemfitError, match="Did you mean: toy-int8-paged"):
        kv_cache_kind("toy-int8-pagd")
