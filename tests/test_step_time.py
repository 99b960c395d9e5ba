"""The step-time model (planner/cost.py): measured constants replace assumed ones, what a step reads and moves,
the time `memfit estimate --gpu` reports, and each technique's overhead."""
import dataclasses
import json

import pytest

from memfit import get_gpu
from memfit.core.units import GiB
from memfit.estimators.analytic import analytic_estimate
from memfit.planner.cost import timing
from memfit.techniques.resolve import ResolvedWorkload
from tests.test_cli import run


def test_a_measured_cost_model_replaces_the_assumed_constants():
    """A cost model measured on the target replaces the assumed constants: its optimizer seconds per parameter, and
    its matmul rate (halved here: the matmuls' share of the step doubles, nothing else moves)."""
    from memfit.planner.cost import ASSUMED, CostModel, step_time

    workload = ResolvedWorkload(model="tiny-llama", task="train", batch_size=4, seq_len=128)
    gpu = get_gpu("a100-80gb")
    estimate = analytic_estimate(workload, gpu)
    device_only = dataclasses.replace(ASSUMED, host_op_s=0.0)   # no host floor: the device's time shows
    assumed = step_time(workload, estimate, gpu, grad_accum=2, num_gpus=1, cost=device_only)
    measured = CostModel(mfu=ASSUMED.mfu / 2, host_op_s=0.0, optimizer_s_per_param=(("adamw", 1e-6),),
                         source="measured")
    timed = step_time(workload, estimate, gpu, grad_accum=2, num_gpus=1, cost=measured)
    no_matmuls = step_time(workload, estimate, gpu, grad_accum=2, num_gpus=1,
                           cost=dataclasses.replace(device_only, mfu=1e12))
    matmuls = assumed.parts["compute"] - no_matmuls.parts["compute"]
    assert matmuls > 0
    assert timed.parts["compute"] == pytest.approx(assumed.parts["compute"] + matmuls)
    assert timed.parts["optimizer"] == pytest.approx(estimate.num_parameters * 1e-6)


def test_a_mixture_of_experts_decode_reads_only_the_experts_its_tokens_are_routed_to():
    """Mixtral's decode step at batch 1 reads the shared weights and 2 of 8 experts per layer; a prefill of many
    tokens reads them all; a dense model reads everything. With int8 experts (int8-weight-only quantizes them, as
    gpt-fast does) an expert is a byte a weight, and the shared weights' share of what a step reads grows."""
    from memfit.planner.cost import StepShape

    moe = ResolvedWorkload(model="mixtral-8x7b", task="inference", batch_size=1, seq_len=16, new_tokens=8,
                           precision="bf16")
    n = analytic_estimate(moe).num_parameters
    shape = StepShape.of(moe, n)
    assert shape.expert_bytes == 2 * shape.expert_params
    assert shape.weights_read(1, 2 * n) == pytest.approx(2 * n - shape.expert_bytes * 6 / 8)
    assert shape.weights_read(4096, 2 * n) == pytest.approx(2 * n)
    assert 0.25 * 2 * n < shape.weights_read(1, 2 * n) < shape.weights_read(8, 2 * n) < 2 * n
    dense = ResolvedWorkload(model="llama-3.1-8b", task="inference", batch_size=1, seq_len=16, new_tokens=8)
    assert StepShape.of(dense, 8_000_000_000).weights_read(1, 16_000_000_000) == 16_000_000_000

    int8 = ResolvedWorkload(model="mixtral-8x7b", task="inference", batch_size=1, seq_len=16, new_tokens=8,
                            precision="bf16", techniques=("int8-weight-only",))
    estimate = analytic_estimate(int8)
    stored = estimate.model_state_bytes["parameters"]
    quantized = StepShape.of(int8, estimate.num_parameters)
    assert quantized.expert_params < quantized.expert_bytes < 1.01 * quantized.expert_params
    assert 0.9 * stored < quantized.expert_bytes < stored   # the experts are almost all of the int8 model
    # two experts of eight per layer, and every shared weight: attention's int8 codes, bf16 embeddings and norms
    assert quantized.weights_read(1, stored) == pytest.approx(stored - quantized.expert_bytes * 6 / 8)


def test_estimate_reports_the_step_time_the_planner_gives_the_same_configuration(capsys, tmp_path):
    """`memfit estimate --gpu` times any configuration with the planner's step-time model: plan 1's saved workload,
    estimated again, has plan 1's step time and throughput."""
    saved = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "tiny-llama", "--gpu", "rtx-4090", "--seq-len", "256", "--global-batch", "8",
                     "--top", "1", "--save", str(saved))
    best = json.loads(saved.read_text())["plans"][0]
    assert code == 0 and best["grad_accum"] == 1
    code, out, _ = run(capsys, "estimate", "--plan", str(saved), "--method", "analytic", "--json")
    timed = json.loads(out)
    assert timed["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-4)
    assert timed["tokens_per_second_per_gpu"] == pytest.approx(best["throughput"], rel=1e-3)
    assert timed["time_source"] == "calibrated and assumed" and set(timed["time_parts_s"]) >= {"compute", "optimizer"}


def test_a_model_whose_batch_is_not_tokens_is_timed_in_samples(capsys):
    """A classifier has no vocabulary; the step-time model times it from its parameters and attention, and counts
    images, not image side x batch as tokens. A custom module's batch (here a convnet's) counts samples too: its
    second dimension need not be a sequence."""
    for model in (["tiny-vit", "--method", "analytic"], ["memfit.examples.convnet:build", "--inputs",
                                                          "memfit.examples.convnet:make_inputs"]):
        code, out, _ = run(capsys, "estimate", *model, "--task", "train", "--batch-size", "4", "--gpu", "a10g",
                           "--json")
        data = json.loads(out)
        assert code == 0 and "tokens_per_second_per_gpu" not in data and data["throughput_unit"] == "samples/s per GPU"
        assert data["samples_per_second_per_gpu"] == pytest.approx(4 / data["step_time_s"], rel=1e-3)


def test_paged_states_that_do_not_fit_beside_the_step_cross_pcie_each_step():
    """Paged AdamW's float32 states of an 8B model (64 GB) cannot stay on a 4090: what does not fit beside the step
    lives in host RAM, in for the update and out again (the optimizer technique's own overhead, now applied)."""
    gpu = get_gpu("rtx-4090")
    workload = ResolvedWorkload(model="llama-3.1-8b", task="train", batch_size=1, seq_len=512, precision="bf16",
                                optimizer="paged-adamw", techniques=("checkpointing",))
    estimate = analytic_estimate(workload, gpu)
    assert estimate.paged_out_bytes > 32 * GiB
    offload = timing(workload, estimate, gpu)["time_parts_s"]["offload"]
    # in and out over the host link, at its bandwidth: a link twice as fast halves it
    faster = dataclasses.replace(gpu, host_link_gbps=2 * gpu.host_link_gbps)
    assert timing(workload, estimate, faster)["time_parts_s"]["offload"] == pytest.approx(offload / 2, rel=1e-3)
    # 2 x 32 GiB over PCIe 4.0 x16 (at most 32 GB/s): seconds, not milliseconds or minutes
    assert 2 * 32 * GiB / 32e9 < offload < 60
    fits = ResolvedWorkload(model="tiny-llama", task="train", batch_size=1, seq_len=512, precision="bf16",
                            optimizer="paged-adamw")
    small = analytic_estimate(fits, gpu)
    assert small.paged_out_bytes == 0 and timing(fits, small, gpu)["time_parts_s"].get("offload", 0.0) == 0.0


def test_deepspeed_zero3_on_one_device_without_an_interconnect_has_no_collective_time():
    """ZeRO-Infinity on one device gathers nothing: a device with no GPU interconnect (the planner oracle's CPU)
    timed it as 0 bytes over 0 bytes per second (a ZeroDivisionError that stopped the oracle)."""
    gpu = dataclasses.replace(get_gpu("rtx-4090"), interconnect_gbps=0.0)
    workload = ResolvedWorkload(model="tiny-llama", task="train", batch_size=2, seq_len=64, precision="bf16-mixed",
                                engine="deepspeed", zero_stage=3, techniques=("nvme-offload",))
    parts = timing(workload, analytic_estimate(workload, gpu), gpu)["time_parts_s"]
    assert parts["communication"] == 0.0 and parts["compute"] > 0


def test_a_device_measured_kernel_class_by_kernel_class_is_timed_so():
    """A CPU described by its measured rates (the planner oracle's): pointwise work by elements, dropout's draws by
    random numbers, attention and batched matmuls at their measured rate for the compute dtype, the optimizer by
    the dtype it steps on; a step in backward calls one optimizer per parameter tensor; selective checkpointing
    re-runs the forward's work besides its matmuls."""
    from memfit.estimators.kernels import kernel_profile
    from memfit.planner.cost import CostModel, step_time
    from memfit.specs.hardware import CPU_KERNELS

    gpu = dataclasses.replace(get_gpu("a100-80gb"), vendor="cpu")
    workload = ResolvedWorkload(model="tiny-gpt2", task="train", batch_size=2, seq_len=64, precision="bf16")
    estimate = analytic_estimate(workload, gpu)
    profile = kernel_profile(workload, CPU_KERNELS)
    base = CostModel(mfu=1e12, host_op_s=0.0, launch_s=0.0, pointwise_s_per_element=(("bfloat16", 0.0),),
                     batched_tflops=(("bfloat16", 1e12),), attention_tflops=(("bfloat16", 1e12),),
                     optimizer_s_per_param=(("adamw:bfloat16", 0.0),))

    def timed(cost, w=workload):
        return step_time(w, estimate, gpu, grad_accum=1, num_gpus=1, cost=cost).parts

    assert timed(base)["compute"] == pytest.approx(0.0, abs=1e-9)
    pointwise = timed(dataclasses.replace(base, pointwise_s_per_element=(("bfloat16", 1e-9),)))["compute"]
    assert pointwise == pytest.approx((profile.forward.eager_elements + profile.backward.eager_elements) * 1e-9)
    draws = timed(dataclasses.replace(base, random_s_per_element=1e-6))["compute"]
    assert draws == pytest.approx(profile.forward.random_elements * 1e-6)
    batched = timed(dataclasses.replace(base, batched_tflops=(("bfloat16", 1.0),)))["compute"]
    assert batched == pytest.approx((profile.forward.batched_flops + profile.backward.batched_flops) / 1e12)
    stepped = timed(dataclasses.replace(base, optimizer_s_per_param=(("adamw", 1.0), ("adamw:bfloat16", 2e-9))))
    assert stepped["optimizer"] == pytest.approx(estimate.num_parameters * 2e-9, rel=0.01)
    in_backward = dataclasses.replace(workload, techniques=("optimizer-in-backward",))
    calls = timed(dataclasses.replace(base, optimizer_call_s=1e-3), in_backward)
    assert calls["optimizer"] == pytest.approx(profile.parameter_tensors * 1e-3, rel=0.01)
    selective = dataclasses.replace(workload, techniques=("checkpointing:mode=selective",))
    cheap = dataclasses.replace(base, pointwise_s_per_element=(("bfloat16", 1e-9),))
    assert timed(cheap, selective)["recompute"] == pytest.approx(profile.forward.eager_elements * 1e-9, rel=0.01)
    assert timed(dataclasses.replace(base, mfu=1.0), selective)["recompute"] == pytest.approx(0.0, abs=1e-9)
