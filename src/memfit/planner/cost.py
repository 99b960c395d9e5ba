"""Step time of a plan on the target GPUs: a roofline cost model, every constant ASSUMED (labelled so).

Training, per micro-step of T = micro_batch x seq tokens:
  forward FLOPs F = 2 N_active T + 2 L b s^2 d_attn (causal attention, scores and values) [Kaplan et al.,
  2020; Narayanan et al., 2021]; backward 2F (F when the base weights are frozen: LoRA/QLoRA compute
  no weight gradients); recompute: full checkpointing one more forward of every n-th block, selective
  ~10 % of one (Korthikanti et al., 2022), chunked-ce one more LM head forward. Compute time is FLOPs /
  (peak TFLOP/s x mfu x T / (T + tokens_half)): small micro-batches use a GPU less well.
  Tensor parallel divides the FLOPs by N and adds 4 all-reduces of T x h activations per block (not
  overlapped); pipeline parallel divides them by N and stretches the step by the bubble (M + N - 1) / M.
  Data parallel (DDP, ZeRO-1/2) all-reduces the gradients once per step, overlapped with backward;
  FSDP2 / ZeRO-3 all-gathers the parameters in forward and backward and reduce-scatters the gradients
  every micro-step, overlapped with compute. Ring collectives move 2 (N - 1) / N of the bytes (all-reduce)
  or (N - 1) / N (all-gather, reduce-scatter) at the GPU's interconnect bandwidth (NVLink: half the
  bidirectional figure; beyond one node: NETWORK_GBPS).
  The optimizer step is memory-bound: 2x the states + 3x the gradients' bytes at HBM bandwidth; with
  cpu-offload it runs on the host at HOST_STEP_GBPS and the weights cross PCIe back (gradients cross
  during backward, overlapped); checkpointing's offload mode moves the saved tensors both ways.
Inference: the prefill is compute-bound (as above, forward only); each decoded token reads the weights
  and the KV cache once (HBM bandwidth) or computes (whichever is slower); stream-layers moves the block
  weights over PCIe every forward.
The constants (CostModel) are assumed for GPUs; a CostModel measured on the target replaces them (the
oracle benchmark measures its CPU's). Techniques whose time this model does not derive (quantization kernels, QAT, distillation, pruning) use
their own step-time factor (assumed, see `memfit techniques`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memfit.estimators.breakdown import MemoryEstimate
from memfit.specs.hardware import GPU
from memfit.specs.workload import Workload

HBM_EFFICIENCY = 0.75      # fraction of the data-sheet memory bandwidth streaming kernels reach (assumed)
LINK_EFFICIENCY = 0.8      # fraction of the data-sheet link bandwidth collectives and copies reach (assumed)
HOST_STEP_GBPS = 100.0     # host memory traffic of a CPU optimizer step, per node (assumed)
NETWORK_GBPS = 50.0        # per GPU between nodes: 400 Gb/s InfiniBand (assumed)
COLLECTIVE_LATENCY_S = 15e-6   # per collective (decode-time tensor parallel; assumed)
SELECTIVE_RECOMPUTE = 0.1  # of one forward (assumed)
QLORA_DEQUANT = 1.2        # QLoRA's compute against LoRA's: every 4-bit weight dequantized in forward and backward
                           # (assumed)
MODELLED = frozenset({"checkpointing", "cpu-offload", "stream-layers", "fsdp2", "ddp", "tensor-parallel",
                      "pipeline-parallel", "lora", "qlora", "chunked-ce", "expandable-segments", "sdpa"})


@dataclass(frozen=True)
class CostModel:
    """The constants that turn FLOPs and bytes into seconds: assumed for GPUs (these defaults), or measured on
    the device a plan is for (benchmarks/planner_oracle.py calibrates one for its CPU)."""

    mfu: float = 0.40            # model FLOPs utilisation of large matmuls
    tokens_half: int = 512       # tokens per micro-step at which the device runs at half that utilisation
    comm_overlap: float = 0.8    # fraction of the compute that hides collectives
    copy_overlap: float = 0.8    # fraction that hides host <-> device copies (a GPU's copy engines; a CPU has none)
    optimizer_s_per_param: tuple[tuple[str, float], ...] = ()   # measured step seconds per parameter, by optimizer
    source: str = "assumed"


ASSUMED = CostModel()


@dataclass
class ModelShape:
    layers: int
    hidden: int
    attn_width: int
    vocab: int
    active_params: int
    causal: bool

    @classmethod
    def of(cls, workload: Workload, num_parameters: int) -> ModelShape:
        from memfit.estimators.analytic.families import registry

        _, spec = registry.family_of(workload.source)
        hidden = getattr(spec, "hidden", None) or spec.d_model
        heads = spec.heads
        head_dim = getattr(spec, "head_dim", None) or getattr(spec, "d_kv", None) or hidden // heads
        active = num_parameters
        experts = getattr(spec, "experts", 0)
        if experts:   # only top_k of the experts run per token
            expert_params = workload.source.num_layers * experts * 3 * hidden * spec.intermediate
            active -= expert_params * (experts - spec.top_k) // experts
        layers = workload.source.num_layers + getattr(spec, "decoder_layers", 0)
        return cls(layers=layers, hidden=hidden, attn_width=heads * head_dim, vocab=spec.vocab,
                   active_params=active, causal=type(spec).__name__ in ("DecoderSpec", "GPT2Spec"))

    def forward_flops(self, batch: int, seq: int) -> float:
        attention = (2 if self.causal else 4) * self.layers * batch * seq * seq * self.attn_width
        return 2 * self.active_params * batch * seq + attention


@dataclass
class StepTime:
    total_s: float
    parts: dict[str, float] = field(default_factory=dict)   # compute, recompute, communication, offload, optimizer


def _tflops(gpu: GPU, precision: str) -> float:
    if precision == "fp32":
        return gpu.fp32_tflops
    if precision.startswith("bf16") and gpu.bf16_tflops:
        return gpu.bf16_tflops
    return gpu.fp16_tflops


def link_gbps(gpu: GPU, num_gpus: int) -> float:
    per_direction = gpu.interconnect_gbps / 2 if gpu.interconnect.startswith("nvlink") else gpu.interconnect_gbps
    if num_gpus > 8:
        per_direction = min(per_direction, NETWORK_GBPS)
    return per_direction * LINK_EFFICIENCY * 1e9


def _compute_s(flops: float, gpu: GPU, precision: str, tokens: int | None, cost: CostModel) -> float:
    """`tokens` per matmul call (None: decode, where the bandwidth bound applies instead of the batch size's)."""
    efficiency = cost.mfu * (1.0 if tokens is None else tokens / (tokens + cost.tokens_half))
    return flops / (_tflops(gpu, precision) * 1e12 * efficiency)


def unmodelled_factor(workload: Workload) -> float:
    factor = 1.0
    for technique in workload.technique_configs:
        if technique.name not in MODELLED:
            factor *= technique.step_time_factor()
    return factor


def step_time(workload: Workload, estimate: MemoryEstimate, gpu: GPU, *, grad_accum: int, num_gpus: int,
              cost: CostModel = ASSUMED) -> StepTime:
    """Seconds per optimizer step (train) or per served batch (inference) of `workload` repeated
    `grad_accum` times on each of its ranks. `estimate` (analytic, for the target GPU) gives the bytes the
    step moves; an estimate without bytes counts FLOPs only (a lower bound: search.lower_bound_estimate)."""
    shape = ModelShape.of(workload, estimate.num_parameters)
    if workload.task == "train":
        return _train_step(workload, estimate, gpu, shape, grad_accum, num_gpus, cost)
    return _inference_batch(workload, estimate, gpu, shape, grad_accum, num_gpus, cost)


def _train_step(w: Workload, e: MemoryEstimate, gpu: GPU, shape: ModelShape, accum: int, num_gpus: int,
                cost: CostModel) -> StepTime:
    n, seq, batch = w.world_size, w.effective_seq_len, w.batch_size
    tokens = batch * seq
    forward = shape.forward_flops(batch, seq)
    frozen = w.technique("lora") or w.technique("qlora")
    backward = forward if frozen else 2 * forward
    recompute = 0.0
    if ckpt := w.technique("checkpointing"):
        if ckpt.mode == "full":
            recompute = forward / ckpt.every
        elif ckpt.mode == "selective":
            recompute = SELECTIVE_RECOMPUTE * forward
    if w.technique("chunked-ce"):
        recompute += 2 * shape.hidden * shape.vocab * tokens
    split = n if (w.technique("tensor-parallel") or w.technique("pipeline-parallel")) else 1
    factor = unmodelled_factor(w) / split * (QLORA_DEQUANT if w.technique("qlora") else 1.0)
    work = _compute_s(forward + backward, gpu, w.precision, tokens, cost) * factor
    redo = _compute_s(recompute, gpu, w.precision, tokens, cost) * factor
    if pipeline := w.technique("pipeline-parallel"):   # the bubble
        bubble = (pipeline.microbatches + n - 1) / pipeline.microbatches
        work, redo = work * bubble, redo * bubble
    link = link_gbps(gpu, num_gpus)
    comm = 0.0
    half = 2 if w.precision != "fp32" else 4
    if w.technique("tensor-parallel"):   # not overlapped: every block waits for its all-reduce
        per_block = 2 * (n - 1) / n * tokens * shape.hidden * half / link
        comm += (4 + (2 if recompute else 0)) * shape.layers * per_block * accum
    elif w.technique("fsdp2") or (w.engine == "deepspeed" and w.zero_stage == 3):
        gathers = 1 if (w.technique("fsdp2") and not w.technique("fsdp2").reshard) else 2
        full_params = shape_bytes(e, "parameters") * n
        per_micro = (gathers + 1) * (n - 1) / n * full_params / link
        comm += max(0.0, per_micro - cost.comm_overlap * (work + redo)) * accum
    elif n > 1 and not w.technique("pipeline-parallel"):   # DDP, ZeRO-1/2: one gradient all-reduce per step
        grads = e.num_parameters * half if w.engine == "deepspeed" else shape_bytes(e, "gradients")
        all_reduce = 2 * (n - 1) / n * grads / link
        comm += max(0.0, all_reduce - cost.comm_overlap * _backward_share(work))
    parts = {"compute": work * accum, "recompute": redo * accum, "communication": comm}
    parts.update(_optimizer_and_offload(w, e, gpu, num_gpus, work * accum, cost))
    return StepTime(sum(parts.values()), parts)


def shape_bytes(e: MemoryEstimate, category: str) -> int:
    return int(e.model_state_bytes.get(category, 0))


def _backward_share(compute_s: float) -> float:
    return compute_s * 2 / 3


def _optimizer_and_offload(w: Workload, e: MemoryEstimate, gpu: GPU, num_gpus: int, compute_s: float,
                           cost: CostModel) -> dict:
    hbm = gpu.memory_bandwidth_gbps * 1e9 * HBM_EFFICIENCY
    pcie = gpu.host_link_gbps * 1e9 * LINK_EFFICIENCY
    parts = {"optimizer": 0.0, "offload": 0.0}
    per_param = dict(cost.optimizer_s_per_param).get(w.optimizer)
    grad_bytes = 2 if w.precision == "bf16" else 4
    if w.technique("cpu-offload"):
        ranks_per_node = min(num_gpus, 8)
        trainable_numel = e.num_parameters // max(1, w.world_size)
        parts["optimizer"] = (trainable_numel * ranks_per_node * per_param if per_param
                              else 2 * e.host_bytes * ranks_per_node / (HOST_STEP_GBPS * 1e9))
        weights_up = grads_down = trainable_numel * grad_bytes
        parts["offload"] = weights_up / pcie + max(0.0, grads_down / pcie - cost.copy_overlap * _backward_share(
            compute_s))
    elif per_param:
        parts["optimizer"] = shape_bytes(e, "gradients") / grad_bytes * per_param
    else:
        states, grads = shape_bytes(e, "optimizer_states"), shape_bytes(e, "gradients")
        parts["optimizer"] = (2 * states + 3 * grads) / hbm
    ckpt = w.technique("checkpointing")
    if ckpt and ckpt.mode == "offload":   # the saved tensors: the host bytes beyond the optimizer's
        from memfit.estimators.analytic import offload_host_bytes

        saved = max(0, e.host_bytes - sum(offload_host_bytes(w)))
        parts["offload"] += max(0.0, 2 * saved / pcie - cost.copy_overlap * compute_s)
    return parts


def _inference_batch(w: Workload, e: MemoryEstimate, gpu: GPU, shape: ModelShape, chunks: int,
                     num_gpus: int, cost: CostModel) -> StepTime:
    n, seq, batch = w.world_size, w.effective_seq_len, w.batch_size
    tp = n if w.technique("tensor-parallel") else 1
    factor = unmodelled_factor(w) / tp
    hbm = gpu.memory_bandwidth_gbps * 1e9 * HBM_EFFICIENCY
    pcie = gpu.host_link_gbps * 1e9 * LINK_EFFICIENCY
    link = link_gbps(gpu, num_gpus)
    half = 4 if w.precision == "fp32" else 2
    prefill = _compute_s(shape.forward_flops(batch, seq), gpu, w.precision, batch * seq, cost) * factor
    weights = shape_bytes(e, "parameters")
    streamed = 0.0
    if w.technique("stream-layers"):
        streamed = e.host_bytes / pcie
    comm = 0.0
    if tp > 1:
        comm = 2 * shape.layers * (2 * (tp - 1) / tp * batch * seq * shape.hidden * half / link + COLLECTIVE_LATENCY_S)
    decode = 0.0
    if w.new_tokens:
        kv_mean = e.at_peak.get("kv_cache", 0) * (seq + w.new_tokens / 2) / (seq + w.new_tokens)
        memory_s = (weights + kv_mean) / hbm
        flops_s = _compute_s(shape.forward_flops(batch, 1) + 4 * shape.layers * batch * seq * shape.attn_width,
                             gpu, w.precision, None, cost) * factor
        decode = max(memory_s, flops_s) * w.new_tokens
        if tp > 1:
            comm += w.new_tokens * 2 * shape.layers * (2 * (tp - 1) / tp * batch * shape.hidden * half / link
                                                       + COLLECTIVE_LATENCY_S)
    parts = {"compute": (prefill + decode) * chunks, "communication": comm * chunks,
             "offload": streamed * (1 + w.new_tokens) * chunks}
    return StepTime(sum(parts.values()), parts)
