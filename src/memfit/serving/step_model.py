"""How long one engine step takes on one GPU of a replica (its tensor-parallel ranks run in lock-step), from what the
step reads and computes — the roofline of each kernel class, with the planner's shares of the data-sheet figures
(core/rates.py):

- the linear layers: 2 FLOPs per weight and token (a mixture: its top_k experts' share; the head only for the rows
  that sample) at the matmul share of the peak (on Hopper and later the engines' own, HOPPER_MATMUL_SHARE), or every
  weight read once (a mixture: the experts the step's tokens touch) at the HBM share of the bandwidth, whichever is
  slower;
- attention: a prefill chunk's query-key pairs (causal; a sliding layer sees its window) at the fused kernels' share
  of the peak, or the cache it reads (every decode request its whole context) at the HBM share, whichever is slower;
- the sampler: its float32 logits for each sampled row (V1's 18 bytes a logit, profile_run.py) at HBM bandwidth;
- tensor parallel: two all-reduces per layer of the step's hidden states, ring time over the GPU's link plus a
  latency each (assumed);
- the host: the engine's own time per step outside the GPU (scheduling, preparing inputs, reading outputs) and per
  running request, calibrated (HOST_* below, with the rows they come from); eager mode adds each kernel's launch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.core.dtypes import dtype_bytes
from memfit.core.rates import HBM_EFFICIENCY, LINK_EFFICIENCY, MATMUL_MFU, attention_share, experts_touched
from memfit.serving.checkpoints import Checkpoint, engine_tensors, rank_shape
from memfit.serving.profile_run import V1_SAMPLER_BYTES
from memfit.serving.result import ServingEstimate
from memfit.serving.served_model import ServedModel
from memfit.specs.hardware import GPU

# the engine's host time per step that the GPU waits for (scheduling, input preparation, output handling), by
# engine era; calibrated on published_serving_throughput.md's low-concurrency rows: vLLM V1 on R07 (Qwen3-8B on an
# H100 at 2 concurrent users: 7.37 ms per output token, 6.0 of them the weights' read), V0 on R29 (Mistral-7B on an
# H100, 10 users: 8.04 ms between tokens, 5.7 the read); SGLang's taken as vLLM V1's (assumed: R58, Qwen3-8B at 4
# users, then checks it: 7.19 ms per token)
HOST_STEP_S = {"vllm-v1": 1.3e-3, "vllm-v0": 2.3e-3, "sglang": 1.3e-3}
# per running request and step: the engine's bookkeeping, its input and output rows, detokenizing and streaming its
# token; calibrated on R01 (Qwen3-14B on an H100, 1000 ShareGPT requests at once on vLLM 0.11: 6,596 total tokens/s)
HOST_REQUEST_S = 20e-6
# the share of a Hopper (or later) GPU's dense peak the engines' steps reach (their GEMMs with the norms, rotary,
# activations and quantization kernels between them): far below the planner's MATMUL_MFU, which an A100 MLP
# calibrated; calibrated on R03 (Qwen3-14B on an H100, 500 prompts of 2,000 tokens at once: 10,597 total tokens/s,
# where 0.80 would give 22,300). Older GPUs keep MATMUL_MFU.
HOPPER_MATMUL_SHARE = 0.33
KERNELS_PER_LAYER = 12       # an eager decoder layer's kernel launches (norms, projections, rope, attention, act)
LAUNCH_S = 10e-6             # the host's time to issue one kernel from Python (the planner's host_op_s, assumed)
ALL_REDUCE_LATENCY_S = {"nvlink": 8e-6, "pcie": 25e-6}   # one small all-reduce (assumed)


@dataclass(frozen=True)
class StepModel:
    dense_bytes: float            # weights every step reads on one rank (the embedding's rows are looked up)
    expert_bytes: float           # a mixture's experts on one rank
    flops_per_token: float        # 2 x the linear weights a token passes through on one rank (not the head)
    head_flops_per_row: float
    kv_bytes_per_token: float     # one token of every layer's cache on one rank
    pair_flops: float             # per query-key pair of every layer on one rank: 4 x heads x head_dim
    windows: tuple[tuple[float, int | None], ...]   # (share of layers, window): what a token's attention reaches
    sampler_bytes_per_row: float
    experts: int
    top_k: int
    matmul_flops_per_s: float
    attention_flops_per_s: float
    hbm_bytes_per_s: float
    all_reduce_bytes_per_token: float   # both all-reduces of every layer, per token (0 at tensor parallel 1)
    all_reduces: int
    link_bytes_per_s: float
    all_reduce_latency_s: float
    ranks: int
    host_step_s: float
    launch_s: float               # eager: every kernel's launch per step

    def attention_pairs(self, context: int, new: int) -> float:
        """Query-key pairs of `new` tokens after `context` cached ones (causal), averaged over the layers' windows."""
        return sum(share * _pairs(context + 1, new, window) for share, window in self.windows)

    def context_read(self, context: int) -> float:
        """Cached tokens one query reads, averaged over the layers' windows."""
        return sum(share * (context if window is None else min(context, window)) for share, window in self.windows)

    def seconds(self, prefills: list[tuple[int, int]], decodes: list[int], sampled: int) -> float:
        """One step: `prefills` (chunk, tokens already cached), `decodes` (each request's context), `sampled` rows
        of logits."""
        tokens = sum(chunk for chunk, _ in prefills) + len(decodes)
        if tokens == 0:
            return 0.0
        linear_flops = self.flops_per_token * tokens + self.head_flops_per_row * sampled
        weights = self.dense_bytes + self.expert_bytes * experts_touched(self.experts, self.top_k, tokens)
        linear = max(linear_flops / self.matmul_flops_per_s, weights / self.hbm_bytes_per_s)
        pairs = sum(self.attention_pairs(start, chunk) for chunk, start in prefills)
        pairs += sum(self.context_read(context) for context in decodes)
        cache = sum(self.context_read(start) + chunk for chunk, start in prefills)
        cache += sum(self.context_read(context) + 1 for context in decodes)
        attention = max(pairs * self.pair_flops / self.attention_flops_per_s,
                        cache * self.kv_bytes_per_token / self.hbm_bytes_per_s)
        sampler = sampled * self.sampler_bytes_per_row / self.hbm_bytes_per_s
        comm = 0.0
        if self.ranks > 1:
            ring = 2 * (self.ranks - 1) / self.ranks
            comm = self.all_reduces * self.all_reduce_latency_s + \
                ring * tokens * self.all_reduce_bytes_per_token / self.link_bytes_per_s
        host = self.host_step_s + HOST_REQUEST_S * (len(prefills) + len(decodes)) + self.launch_s
        return linear + attention + sampler + comm + host


def matmul_share(capability: tuple[int, int]) -> float:
    return HOPPER_MATMUL_SHARE if tuple(capability) >= (9, 0) else MATMUL_MFU


def _pairs(first: int, new: int, window: int | None) -> float:
    """first + (first + 1) + ... over `new` tokens, each term at most `window`."""
    if window is None or first + new - 1 <= window:
        return new * (first + (new - 1) / 2)
    if first >= window:
        return new * window
    below = window - first + 1
    return below * (first + window) / 2 + (new - below) * window


def step_model(model: ServedModel, checkpoint: Checkpoint, dtype: str, gpu: GPU, estimate: ServingEstimate,
               policy: str) -> StepModel:
    """The step model of `estimate`'s replica: its weights per rank as the engine stores them, its cache's bytes per
    token, the GPU's rates."""
    tp = int(estimate.settings.get("tensor_parallel", 1))
    width = dtype_bytes(dtype)
    tensors = engine_tensors(model, checkpoint, dtype, tp)
    tied = "lm_head" not in tensors
    dense = sum(size for name, size in tensors.items()
                if ".experts." not in name and (name != "embed_tokens" or tied))
    experts = sum(size for name, size in tensors.items() if ".experts." in name)
    linear = expert_params = 0
    for weight in model.weights:
        if not weight.linear:
            continue
        count = math.prod(rank_shape(weight, model, tp, 1))
        if ".experts." in weight.name:
            expert_params += count
        else:
            linear += count
    active = linear + (expert_params * model.top_k / model.experts if model.experts else 0)
    vocab_rank = -(-model.vocab // tp)
    heads = -(-model.heads // tp)
    head_dim = model.mla_latent if model.mla_latent else model.head_dim
    layers = len(model.attention)
    windows: dict[int | None, int] = {}
    for layer in model.attention:
        key = layer.window if layer.kind == "sliding" else None
        windows[key] = windows.get(key, 0) + 1
    link = gpu.interconnect_gbps / 2 if gpu.interconnect.startswith("nvlink") else gpu.interconnect_gbps
    peak = (gpu.bf16_tflops or gpu.fp16_tflops) * 1e12
    if checkpoint.fmt is not None and checkpoint.fmt.name.startswith(("fp8", "w8a8")) and \
            tuple(gpu.compute_capability) >= (8, 9):
        peak *= 2      # fp8 / int8 tensor cores: twice the 16-bit rate on Ada and Hopper (data sheets)
    eager = bool(estimate.settings.get("enforce_eager"))
    return StepModel(
        dense_bytes=dense, expert_bytes=experts, flops_per_token=2 * active,
        head_flops_per_row=2 * vocab_rank * model.hidden, kv_bytes_per_token=estimate.kv_bytes_per_token,
        pair_flops=4 * layers * heads * head_dim, windows=tuple((n / layers, w) for w, n in windows.items()),
        sampler_bytes_per_row=model.vocab * V1_SAMPLER_BYTES, experts=model.experts, top_k=model.top_k,
        matmul_flops_per_s=peak * matmul_share(gpu.compute_capability),
        attention_flops_per_s=peak * attention_share(gpu.compute_capability),
        hbm_bytes_per_s=gpu.memory_bandwidth_gbps * 1e9 * HBM_EFFICIENCY,
        all_reduce_bytes_per_token=2 * layers * model.hidden * width, all_reduces=2 * layers,
        link_bytes_per_s=link * 1e9 * LINK_EFFICIENCY,
        all_reduce_latency_s=ALL_REDUCE_LATENCY_S["nvlink" if gpu.interconnect.startswith("nvlink") else "pcie"],
        ranks=tp, host_step_s=HOST_STEP_S[policy],
        launch_s=layers * KERNELS_PER_LAYER * LAUNCH_S if eager else 0.0)
