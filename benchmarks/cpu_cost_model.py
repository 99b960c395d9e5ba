"""This CPU as the planner's cost model reads a device, measured kernel class by kernel class on runs of its own
(none is fitted to the planner oracle's configurations): what benchmarks/planner_oracle.py plans with."""
from __future__ import annotations

import time
from statistics import median_high as median

import torch

from memfit.core.dtypes import dtype_name
from memfit.core.rates import LINK_EFFICIENCY
from memfit.estimators.analytic.families import registry
from memfit.estimators.kernels import ATTENTION_BACKWARD, kernel_profile
from memfit.planner.cost import CostModel
from memfit.specs.hardware import CPU_KERNELS, GPU
from memfit.specs.workload import Workload
from memfit.steps.host import host_copy
from memfit.steps.optim import make_optimizer
from memfit.steps.train import call_model, loss_of
from memfit.techniques import REGISTRY
from memfit.techniques.blocks import repeated_blocks
from memfit.techniques.offload import offload_saved_tensors_, parameter_storages
from memfit.techniques.resolve import resolve


def cpu_as_gpu(memory_bytes: int, model: str, seq_len: int, batch: int) -> GPU:
    """This CPU described as the planner's cost model reads a GPU: measured matmul throughput (float32 and
    bfloat16), memory bandwidth (a large copy between warm buffers, read and write), a "host link" that is what
    offloading the model's saved tensors moves a second here (offload_link, at micro-batch `batch`), no
    interconnect, no CUDA context."""
    def matmul_tflops(dtype: torch.dtype) -> float:
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        return 2 * 1024**3 / _seconds(lambda: a @ b) / 1e12

    source = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)
    target = torch.empty_like(source)
    bandwidth = 2 * source.numel() / _seconds(lambda: target.copy_(source)) / 1e9   # read + write
    bf16 = matmul_tflops(torch.bfloat16)
    # the cost model derates a data-sheet link by LINK_EFFICIENCY; this rate is one reached
    host_link = offload_link(model, seq_len, batch) / LINK_EFFICIENCY
    return GPU(name="cpu (measured)", vendor="cpu", memory_bytes=memory_bytes, fp32_tflops=matmul_tflops(torch.float32),
               bf16_tflops=bf16, fp16_tflops=bf16, memory_bandwidth_gbps=bandwidth, interconnect="none",
               interconnect_gbps=0.0, host_link_gbps=host_link, context_bytes=0)


def offload_link(model: str, seq_len: int, batch: int, pairs: int = 7) -> float:
    """GB a second that memfit's offload hooks move on this CPU, measured on the model's own forward and backward
    over one micro-batch: run alternately without and with every block's saved tensors copied to host memory and
    back (the hooks of checkpointing:mode=offload, which copy into fresh memory each way: a CPU has no copy engine,
    and fresh pages fault), `pairs` times each; the bytes are those the hooks copied (counted, twice: out and back),
    over the median of the pairs' differences (interleaving keeps a shared machine's drift out of the difference;
    one small block timed apart read 3 to 14 GB/s from run to run)."""
    import memfit.techniques.offload as offload

    workload = resolve(Workload(model=model, task="train", batch_size=batch, seq_len=seq_len))
    plain = workload.source.build(device="cpu", dtype=torch.float32)
    offloaded = workload.source.build(device="cpu", dtype=torch.float32)
    keep = parameter_storages(offloaded)
    for _, block in repeated_blocks(offloaded, None):
        offload_saved_tensors_(block, keep)
    inputs = workload.source.make_batch(batch_size=batch, seq_len=seq_len, task="train", dtype=torch.float32)
    copied = []

    def counted(tensor, *args, **kwargs):
        copied.append(tensor.numel() * tensor.element_size())
        return host_copy(tensor, *args, **kwargs)

    def step(module):
        loss_of(call_model(module, inputs)).backward()
        module.zero_grad(set_to_none=True)

    step(plain), step(offloaded)   # warm-up
    offload.host_copy, saved = counted, offload.host_copy
    try:
        step(offloaded)
        moved, differences = 2 * sum(copied), []
        for _ in range(pairs):
            differences.append(-_timed(lambda: step(plain)) + _timed(lambda: step(offloaded)))
    finally:
        offload.host_copy = saved
    return moved / max(median(differences), 1e-9) / 1e9


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _seconds(fn, runs: int = 7) -> float:
    """The median of `runs` timed calls after a warm-up one (a shared machine's spikes fall outside it)."""
    fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return median(times)


# every optimizer the search tries without --allow lossy (the paged ones run bitsandbytes' kernels on a CPU as well)
OPTIMIZERS = ("adamw", "adamw8bit", "paged-adamw8bit", "paged-adamw")
DTYPES = (torch.float32, torch.bfloat16)   # the compute dtypes of the search's precisions


def calibrate(gpu: GPU, model: str, seq_len: int, micro_batches: list[int]) -> CostModel:
    """The cost model's constants measured on this CPU, kernel class by kernel class, each on runs of its own (none
    is fitted to the oracle's configurations): the throughput of the model's own matmul shape (tokens x hidden @
    hidden x 4 hidden) at the smallest and largest micro-batch gives the utilisation and the half-utilisation token
    count; its attention's batched products (eager attention) and fused attention (forward and backward) at its
    heads, head size and sequence give their rates in float32 and bfloat16; a mix of pointwise kernels over its
    activations the seconds per element in each; dropout's Bernoulli draw the seconds per random number; one
    optimizer step over 2M parameters each optimizer's seconds per parameter on float32 and on bfloat16 weights, and
    64 AdamW steps over one small tensor each the time to call one (what a step in backward calls per parameter); the
    host's time per kernel is the model's forward over one token (no configuration the oracle measures) over the
    kernels it launches; the CPU has no copy engine and no interconnect (nothing overlaps), and issues each kernel
    before running it."""
    spec = registry.family_of(resolve(Workload(model=model, task="train")).source)[1]
    hidden = getattr(spec, "hidden", None) or spec.d_model
    heads = spec.heads
    head_dim = getattr(spec, "head_dim", None) or getattr(spec, "d_kv", None) or hidden // heads

    def tflops(tokens: int) -> float:
        x, w = torch.randn(tokens, hidden), torch.randn(hidden, 4 * hidden)
        return 2 * tokens * hidden * 4 * hidden / _seconds(lambda: x @ w) / 1e12

    t1, t2 = seq_len * micro_batches[0], seq_len * micro_batches[-1]
    g1, g2 = tflops(t1), tflops(t2)
    ratio = g2 / g1
    half = max(0.0, t1 * t2 * (1 - ratio) / (ratio * t1 - t2)) if ratio > 1 else 0.0
    mfu = min(1.0, g2 / gpu.fp32_tflops * (t2 + half) / t2)
    batch = micro_batches[-1]

    def batched(dtype: torch.dtype) -> float:   # q @ k^T and probabilities @ v, one of each
        q = torch.randn(batch * heads, seq_len, head_dim, dtype=dtype)
        p = torch.randn(batch * heads, seq_len, seq_len, dtype=dtype)
        seconds = _seconds(lambda: (torch.bmm(q, q.transpose(1, 2)), torch.bmm(p, q)))
        return 2 * 2 * batch * heads * seq_len * seq_len * head_dim / seconds / 1e12

    def attention(dtype: torch.dtype) -> float:   # forward and backward, causal: half the products
        q, k, v = (torch.randn(batch, heads, seq_len, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))

        def run():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        forward = 4 * batch * heads * seq_len * seq_len * head_dim / 2
        return forward * (1 + ATTENTION_BACKWARD) / _seconds(run) / 1e12

    def pointwise(dtype: torch.dtype) -> float:
        """Seconds per element read or written over a transformer's pointwise kernels on its activations: adds,
        products (one broadcast), activations, a norm's square-mean, softmax and log-softmax, casts, a transposed
        copy, a concatenation, a fill."""
        x, y = (torch.randn(seq_len * batch, hidden, dtype=dtype) for _ in range(2))
        scale = torch.randn(hidden, dtype=dtype)
        other = torch.float32 if dtype != torch.float32 else torch.bfloat16
        kernels = ((lambda: x + y, 3), (lambda: x * scale, 2), (lambda: torch.nn.functional.silu(x), 2),
                   (lambda: torch.nn.functional.gelu(x), 2), (lambda: x.pow(2).mean(-1), 2),
                   (lambda: torch.softmax(x, -1), 2), (lambda: torch.log_softmax(x, -1), 2), (lambda: x.to(other), 2),
                   (lambda: x.view(batch, seq_len, hidden).transpose(0, 1).contiguous(), 2),
                   (lambda: torch.cat([x, y], -1), 4), (lambda: torch.zeros_like(x), 1))
        return sum(_seconds(op) for op, _ in kernels) / sum(touched * x.numel() for _, touched in kernels)

    def random_draw() -> float:
        mask = torch.empty(seq_len * batch, hidden)
        return _seconds(lambda: mask.bernoulli_(0.9)) / mask.numel()

    def per_param(name: str, dtype: torch.dtype) -> float:
        params = [torch.nn.Parameter(torch.randn(512, 512, dtype=dtype)) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        # an optimizer technique builds its own; torch.optim's are memfit's step's
        optimizer = REGISTRY[name]().build(params) if name in REGISTRY else make_optimizer(params, name)
        return _seconds(optimizer.step) / sum(p.numel() for p in params)

    def per_call() -> float:   # one AdamW per small tensor, as a step in backward calls them
        optimizers = []
        for _ in range(64):
            p = torch.nn.Parameter(torch.randn(64))
            p.grad = torch.randn_like(p)
            optimizers.append(make_optimizer([p], "adamw"))
        return _seconds(lambda: [o.step() for o in optimizers]) / len(optimizers)

    return CostModel(mfu=mfu, tokens_half=int(half), launch_s=0.0,
                     host_op_s=host_seconds_per_kernel(model), host_overlaps=False, comm_overlap=0.0,
                     copy_overlap=0.0,
                     optimizer_s_per_param=tuple((f"{o}:{dtype_name(d)}", per_param(o, d)) for o in OPTIMIZERS
                                                 for d in DTYPES),
                     batched_tflops=tuple((dtype_name(d), batched(d)) for d in DTYPES),
                     attention_tflops=tuple((dtype_name(d), attention(d)) for d in DTYPES),
                     pointwise_s_per_element=tuple((dtype_name(d), pointwise(d)) for d in DTYPES),
                     random_s_per_element=random_draw(),
                     optimizer_call_s=per_call(),
                     source="measured on this CPU (benchmarks/planner_oracle.py)")


def host_seconds_per_kernel(model: str) -> float:
    """The model's forward over one token of one sequence — the work all but nothing, the time its kernels' issue —
    over the kernels it launches (counted as the cost model counts them)."""
    workload = resolve(Workload(model=model, task="inference", batch_size=1, seq_len=1))
    module = workload.source.build(device="cpu", dtype=torch.float32).eval()
    batch = workload.source.make_batch(batch_size=1, seq_len=1, task="inference", dtype=torch.float32)
    with torch.no_grad():
        seconds = _seconds(lambda: call_model(module, batch), runs=50)
    return seconds / kernel_profile(workload, CPU_KERNELS).forward.eager_kernels
