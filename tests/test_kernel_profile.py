"""The kernels a step launches, counted on a fake copy (estimators/kernels.py), and how the cost model times them."""
import dataclasses

import pytest
import torch

from memfit import get_gpu
from memfit.estimators.analytic import analytic_estimate
from memfit.estimators.kernels import _Counter, kernel_profile
from memfit.planner.cost import ASSUMED, step_time
from memfit.techniques.resolve import ResolvedWorkload


def test_a_llamas_matmul_flops_are_twice_its_linear_weights_per_token_and_causal_attention_half_the_square():
    """Counted at one and two blocks and extrapolated: the forward's matmuls are 2 FLOPs per linear weight per token
    (the head included, the embedding a lookup); causal attention is 2 s d per token per layer (flash skips the masked
    half of 4 s d); backward doubles the matmuls and runs attention 2.5 times over."""
    workload = ResolvedWorkload(model="tiny-llama", task="train", batch_size=4, seq_len=128, precision="bf16")
    profile = kernel_profile(workload, (9, 0))
    model = workload.source.build(device="meta", dtype=torch.bfloat16)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    tokens = 4 * 128
    spec = model.config
    assert profile.forward.gemm_flops == pytest.approx(2 * linear * tokens)
    assert profile.backward.gemm_flops == pytest.approx(4 * linear * tokens)
    causal = 2 * tokens * 128 * spec.hidden_size * spec.num_hidden_layers
    assert profile.forward.attention_flops == pytest.approx(causal)
    assert profile.backward.attention_flops == pytest.approx(2.5 * profile.forward.attention_flops)
    # a micro-batch twice as large: twice the work, the same kernels
    twice = kernel_profile(dataclasses.replace(workload, batch_size=8), (9, 0))
    assert twice.forward.eager_bytes == pytest.approx(2 * profile.forward.eager_bytes)
    assert twice.forward.eager_kernels == profile.forward.eager_kernels


def test_fused_pointwise_runs_read_what_they_did_not_make_and_write_what_is_read_later():
    """x -> mul -> add -> (mm reads the add's output): one fused kernel reads x and y once and writes only the add's
    output; eager runs two kernels, each reading and writing its own tensors."""
    counter = _Counter()
    x, y, w = torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64)
    with counter:
        z = (x * 2).add(y)
        z @ w
    profile = counter.profile().forward
    size = 64 * 64 * 4
    assert profile.eager_bytes == 2 * size + (2 * size + size)   # mul: x in, out; add: two in, one out
    assert profile.fused_bytes == 2 * size + size                # reads x and y, writes z
    assert (profile.eager_kernels, profile.fused_kernels) == (3, 2)
    assert profile.gemm_flops == 2 * 64**3


def test_a_small_step_is_bound_by_the_host_issuing_its_kernels_and_cuda_graphs_lift_it():
    """tiny-llama decoding one sequence on an H100: the device's time per token is microseconds, the host's is a
    launch per kernel — the step is the host's; replayed as CUDA graphs (compile:mode=reduce-overhead) it is the
    device's, and much shorter. A large model's prefill is the device's either way."""
    gpu = get_gpu("h100")

    eager_run = ResolvedWorkload(model="tiny-llama", task="inference", batch_size=1, seq_len=16, new_tokens=32,
                                 precision="bf16")
    memory = analytic_estimate(eager_run, gpu)   # compile's memory is the traced estimator's: the eager one here

    def timed(workload):
        return step_time(workload, memory, gpu, grad_accum=1, num_gpus=1)

    eager = timed(eager_run)
    graphs = timed(dataclasses.replace(eager_run, techniques=("compile:mode=reduce-overhead",)))
    profile = kernel_profile(ResolvedWorkload(model="tiny-llama", task="inference", batch_size=1, seq_len=16,
                                              new_tokens=32, precision="bf16"), gpu.compute_capability)
    assert eager.total_s >= 32 * profile.forward.eager_kernels * ASSUMED.host_op_s
    assert graphs.total_s < eager.total_s / 3


def test_compiled_training_moves_fewer_bytes_through_fewer_kernels():
    workload = ResolvedWorkload(model="tiny-llama", task="train", batch_size=4, seq_len=256, precision="bf16")
    profile = kernel_profile(workload, (8, 0))
    for phase in (profile.forward, profile.backward):
        assert phase.fused_bytes < phase.eager_bytes and phase.fused_kernels < phase.eager_kernels
    gpu = get_gpu("a100-80gb")
    device_only = dataclasses.replace(ASSUMED, host_op_s=0.0)
    eager = step_time(workload, analytic_estimate(workload, gpu), gpu, grad_accum=1, num_gpus=1, cost=device_only)
    compiled = step_time(dataclasses.replace(workload, techniques=("compile",)), analytic_estimate(workload, gpu), gpu,
                         grad_accum=1, num_gpus=1, cost=device_only)
    assert compiled.parts["compute"] < eager.parts["compute"]


@pytest.mark.parametrize("task", ["train", "inference"])
def test_every_family_is_counted(task):
    """Every catalog family's step is counted (an encoder-decoder's inference prefill is its encoder): none falls
    back to the FLOPs-only rule, which a transformers model never needs."""
    for model in ("tiny-bert", "tiny-gpt2", "tiny-t5", "tiny-vit", "tiny-mixtral", "tiny-gemma2", "tiny-phi3",
                  "tiny-qwen2", "tiny-llama"):
        workload = ResolvedWorkload(model=model, task=task, batch_size=2, seq_len=224 if model == "tiny-vit" else 64,
                                    precision="bf16-mixed", new_tokens=4 if task == "inference" else 0)
        profile = kernel_profile(workload, (8, 0))
        assert profile.forward.gemm_flops > 0 and profile.forward.eager_kernels > 0, model
        assert (profile.backward.gemm_flops > 0) == (task == "train"), model


def test_a_cpu_target_counts_the_cpus_own_kernels_elements_and_random_draws():
    """On a CPU (CPU_KERNELS) the step runs the CPU's own kernels: tiny-llama's SDPA is the CPU flash op (the same
    causal FLOPs as CUDA's flash kernel, which takes its grouped-query attention in half precision), tiny-gpt2's
    SDPA with dropout falls back to the math path (batched matmuls over the probabilities, and a Bernoulli draw for
    every dropped element). Elements are the bytes over each tensor's element size."""
    from memfit.specs.hardware import CPU_KERNELS

    llama = ResolvedWorkload(model="tiny-llama", task="train", batch_size=2, seq_len=64)
    cpu = kernel_profile(llama, CPU_KERNELS)
    cuda = kernel_profile(ResolvedWorkload(model="tiny-llama", task="train", batch_size=2, seq_len=64,
                                           precision="bf16-mixed"), (8, 0))
    assert cpu.forward.attention_flops > 0
    assert cpu.forward.attention_flops == pytest.approx(cuda.forward.attention_flops)
    assert cpu.forward.batched_flops == 0
    assert cpu.forward.eager_elements == pytest.approx(cpu.forward.eager_bytes / 4, rel=0.01)   # float32
    assert cpu.parameter_tensors == sum(1 for _ in llama.source.build(device="meta", dtype=torch.float32)
                                        .parameters())
    gpt2 = kernel_profile(ResolvedWorkload(model="tiny-gpt2", task="train", batch_size=2, seq_len=64), CPU_KERNELS)
    assert gpt2.forward.attention_flops == 0 and gpt2.forward.batched_flops > 0
    spec = ResolvedWorkload(model="tiny-gpt2").source.build(device="meta", dtype=torch.float32).config
    probabilities = 2 * spec.n_head * 64 * 64 * spec.n_layer
    assert gpt2.forward.random_elements >= probabilities


def test_random_draws_are_counted_and_fused_runs_count_elements():
    counter = _Counter()
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    with counter:
        y = torch.nn.functional.dropout(x, 0.1, training=True)
        (y * 2).sum()
    profile = counter.profile().forward
    assert profile.random_elements == 64 * 64
    assert profile.eager_elements * 2 == profile.eager_bytes   # bfloat16: two bytes an element
    assert profile.fused_elements * 2 == profile.fused_bytes
