"""Mixed precision: fp16's loss scaler skips overflowing steps, and bf16-master's float32 masters are held,
predicted and stepped as Megatron-LM and DeepSpeed step them."""
import pytest
import torch

import memfit
from memfit.measurement.training import text_batches
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import HALF_SHAPE, predicted, rel


def test_fp16_overflow_skips_the_step_and_backs_off():
    from memfit.steps.train import TrainLoop
    from memfit.techniques.compose import prepare_step

    torch.manual_seed(0)
    workload = ResolvedWorkload(model="tiny-llama", task="train", batch_size=2, seq_len=32, precision="fp16-mixed")
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


def test_bf16_master_holds_float32_masters_and_gradients_and_is_predicted(measured):
    """bf16-master: bf16 weights and compute, the optimizer on float32 masters with float32 gradients, one half
    gradient at a time. Beside pure bf16 it holds 4 bytes of master and 4 of gradient per parameter and AdamW's
    states in float32 (twice bf16's), less the bf16 gradients; accumulating over windows adds into the float32
    gradients. Both estimators within 0.1 % of the real runs."""
    bf16, master = measured(("bf16",), shape=HALF_SHAPE), measured(("bf16-master",), shape=HALF_SHAPE)
    numel = master.extra["estimates"]["analytic"]["num_parameters"]
    half, full = (r.extra["estimates"]["analytic"]["model_state_bytes"] for r in (bf16, master))
    assert half["gradients"] == 2 * numel   # the bf16 gradients; bf16-master's float32 ones, and a half in flight
    assert 0 <= full["gradients"] - 4 * numel < half["gradients"] / 4
    assert full["optimizer_states"] - 2 * half["optimizer_states"] == pytest.approx(4 * numel, rel=1e-3)
    accumulated = measured(("bf16-master", "sequence-chunks:window=64"), shape=HALF_SHAPE)
    for run in (master, accumulated):
        for method in ("traced", "analytic"):
            assert rel(predicted(run, method), run.peak_bytes) < 1e-3, (method, run.peak_bytes)


def test_bf16_master_steps_the_float32_masters_and_casts_them_back():
    """After two accumulated micro-batches and a step, the masters are AdamW's float32 update from the float32 copy
    of the weights with the half gradients summed in float32, and the weights are the masters rounded to bf16 (the
    masters keep the bits of the update the weights round away)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference = [p.detach().to(torch.bfloat16).float() for p in net.parameters()]
    setup = memfit.apply_(net, torch.optim.AdamW(net.parameters(), lr=1e-2), ["bf16-master"])
    inputs = [torch.randn(4, 16).to(torch.bfloat16) for _ in range(2)]
    grads = [torch.zeros_like(r) for r in reference]
    for x in inputs:
        net(x).square().mean().backward()
        assert all(p.grad is None for p in net.parameters()), "each half gradient is freed once added"
    for x in inputs:   # the same gradients, computed again on the unchanged bf16 weights
        copy = [p.detach().clone().requires_grad_() for p in net.parameters()]
        out = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, copy[0], copy[1])), copy[2], copy[3])
        for g, d in zip(grads, torch.autograd.grad(out.square().mean(), copy)):
            g += d.float()
    setup.optimizer.step()
    expected = [r.clone().requires_grad_() for r in reference]
    for e, g in zip(expected, grads):
        e.grad = g
    torch.optim.AdamW(expected, lr=1e-2).step()
    for param, master, e in zip(net.parameters(), setup.optimizer.masters, expected):
        assert master.dtype == torch.float32 and torch.allclose(master, e, atol=1e-6)
        assert param.dtype == torch.bfloat16 and torch.equal(param, master.to(torch.bfloat16))
    assert not all(torch.equal(m, p.float()) for p, m in zip(net.parameters(), setup.optimizer.masters))
