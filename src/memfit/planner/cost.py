"""Step time of a plan on the target GPUs, from the kernels its step launches (constants CALIBRATED where a
published measurement gives them, ASSUMED elsewhere; each labelled on CostModel).

Training, per micro-step: the model's kernels are counted on a fake copy (estimators/kernels.py): its matmuls'
FLOPs, its fused attention's FLOPs (causal: half the square) and the bytes every other kernel reads and writes, and
how many kernels there are, eager or fused by torch.compile. A phase (forward, backward) takes its matmuls at the
tensor rate x mfu x T / (T + tokens_half) (small micro-batches use a GPU less well), its attention at the fused
kernels' own share of peak, its bytes at HBM bandwidth, and a gap per kernel; the host issues every kernel (eager
from Python, or one CUDA-graph launch) ahead of the GPU, so a step is never shorter than the host's part (a small
model's or a decode step's bound). The techniques' FLOP hooks scale these times (a recompute re-runs that share of
the forward). The optimizer step is memory-bound: 2x the states + 3x the gradients' bytes at HBM bandwidth.
Inference: the prefill is the forward as above; each decoded token reads the weights and the KV cache once (HBM
bandwidth) or computes (whichever is slower), and launches the forward's kernels.
Each technique adds its own terms through two hooks (techniques/base.py): `cost_compute` changes the FLOPs
(recompute, frozen weights, the ranks they split over, a pipeline's bubble, compile's fusion) and by default
multiplies the compute by its step-time factor (assumed, see `memfit techniques`); `cost_overhead` adds the seconds
it spends beside the compute (collectives, host copies, a host optimizer step). The collectives are the formulas
below: ring collectives move 2 (N - 1) / N of the bytes (all-reduce) or (N - 1) / N (all-gather, reduce-scatter) at
the GPU's interconnect bandwidth (NVLink: half the bidirectional figure; a collective over more than one node:
the network's share per GPU, CostModel.network_gbps — the instance's own network when a plan is for one),
overlapped with compute where the technique's hook says so. DeepSpeed's engine (not a technique) uses the
same: ZeRO-3 gathers like a sharded layout, ZeRO-1/2 all-reduce the gradients like data parallel.
A CostModel measured on the target replaces the constants (the oracle benchmark measures its CPU's). A CPU runs its
own kernels (GPU.kernels) and is measured kernel class by kernel class, because it is not a small GPU: its batched
matmuls and its flash attention run far below its matmul rate (and in bfloat16 below float32, where its matmuls run
faster), its vector units convert half precision to float32 (pointwise time goes by elements, not bytes), it draws
dropout's random numbers in software, and each optimizer call costs Python time a step in backward pays per tensor.
`benchmarks/published_throughput.py` compares the model with published GPU runs (docs/accuracy.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memfit.core.dtypes import BYTES, dtype_name
from memfit.core.precision import get_precision
from memfit.core.rates import HBM_EFFICIENCY, LINK_EFFICIENCY, MATMUL_MFU, attention_share, experts_touched
from memfit.estimators.analytic import offload_host_bytes
from memfit.estimators.analytic.families import registry
from memfit.estimators.breakdown import MemoryEstimate
from memfit.estimators.kernels import KernelProfile, Phase, forward_flops_per_token, kernel_profile
from memfit.specs.hardware import GPU
from memfit.techniques.resolve import ResolvedWorkload

HOST_STEP_GBPS = 100.0     # host memory traffic of a CPU optimizer step, per node (assumed)
NVME_GBPS = 6.0            # a node's local NVMe drives, read or write: two PCIe 4.0 drives (assumed)
NETWORK_GBPS = 50.0        # per GPU between nodes: 400 Gb/s InfiniBand (assumed)
GPUS_PER_NODE = 8          # GPUs share a node's host RAM and NVLink up to this many


@dataclass(frozen=True)
class CostModel:
    """The constants that turn FLOPs, bytes and kernels into seconds: for GPUs these defaults (each labelled
    below), or measured on the device a plan is for (benchmarks/planner_oracle.py measures its CPU's)."""

    mfu: float = MATMUL_MFU     # large matmuls' share of the peak (core/rates.py)
    tokens_half: int = 512       # tokens per matmul at which it runs at half that utilisation (assumed)
    # the fused attention kernels' share of the peak: None takes core/rates.py's by generation
    attention_efficiency: float | None = None
    launch_s: float = 2e-6       # the GPU's gap per kernel (launch latency and tail) (assumed)
    # the host's time to issue one kernel: PyTorch eager from Python (this project's 2-core CPU dispatches a
    # transformers Llama's ops at 5.5 us each without CUDA; a CUDA launch adds its own) (assumed)
    host_op_s: float = 10e-6
    host_overlaps: bool = True   # the host issues kernels ahead of the device (a GPU); False: one after the other
    comm_overlap: float = 0.8    # fraction of the compute that hides collectives
    copy_overlap: float = 0.8    # fraction that hides host <-> device copies (a GPU's copy engines; a CPU has none)
    # measured step seconds per parameter, by optimizer ("adamw"), or by optimizer and the dtype it steps on
    # ("adamw:bfloat16": a CPU steps half-precision states at another rate)
    optimizer_s_per_param: tuple[tuple[str, float], ...] = ()
    # a device measured kernel class by kernel class (a CPU: benchmarks/planner_oracle.py); where given, these replace
    # the formulas above. By compute dtype ("float32", "bfloat16"): TFLOP/s of batched matmuls (bmm: eager
    # attention's products) and of fused attention (forward and backward)
    batched_tflops: tuple[tuple[str, float], ...] = ()
    attention_tflops: tuple[tuple[str, float], ...] = ()
    # every other kernel's seconds per element it reads or writes, by compute dtype (a CPU's vector units convert
    # half precision to float32: elements, not bytes, set its time); none given: bytes at the memory's bandwidth
    pointwise_s_per_element: tuple[tuple[str, float], ...] = ()
    # the host's time to call one optimizer's step (Python and its kernels' issue): what a step in backward pays per
    # parameter; None: AdamW's foreach step over one tensor, 8 kernels at host_op_s (assumed)
    optimizer_call_s: float | None = None
    random_s_per_element: float = 0.0   # drawing one random number (a CPU draws dropout's masks in software; a
    #                                     GPU's Philox generator runs inside the kernel, whose bytes are counted)
    network_gbps: float = NETWORK_GBPS   # GB/s per GPU between nodes (PlanRequest takes an instance's own)
    source: str = "calibrated and assumed"

    def optimizer_seconds_per_param(self, optimizer: str, dtype: torch.dtype) -> float | None:
        """The measured seconds per parameter of `optimizer` stepping `dtype` states (None: not measured)."""
        measured = dict(self.optimizer_s_per_param)
        return measured.get(f"{optimizer}:{dtype_name(dtype)}", measured.get(optimizer))

    @property
    def seconds_per_optimizer_call(self) -> float:
        return self.optimizer_call_s if self.optimizer_call_s is not None else 8 * self.host_op_s

    def attention_share(self, gpu: GPU) -> float:
        if self.attention_efficiency is not None:
            return self.attention_efficiency
        return attention_share(gpu.compute_capability)


ASSUMED = CostModel()


@dataclass
class StepShape:
    """What the step-time model computes with: the model's shape (`ModelSource.shape`) and its active parameters."""

    layers: int
    hidden: int
    attn_width: int
    vocab: int              # 0 for a classifier (a ViT's head is in its parameters)
    active_params: int
    causal: bool
    expert_params: int = 0   # a mixture of experts: the experts' parameters, all layers
    expert_bytes: int = 0    # and the bytes they are stored in (their weight format's codes and state, if any)
    experts: int = 0
    top_k: int = 0
    counted_flops_per_token: float = 0.0   # a custom model: its forward's FLOPs counted on a fake copy (no shape)

    @classmethod
    def of(cls, workload: ResolvedWorkload, num_parameters: int) -> StepShape:
        if not workload.source.is_hf:   # a custom model: what PyTorch's FLOP counter counts
            return cls(layers=0, hidden=0, attn_width=0, vocab=0, active_params=num_parameters, causal=False,
                       counted_flops_per_token=forward_flops_per_token(workload))
        m = workload.source.shape
        active, expert_params, expert_bytes = num_parameters, 0, 0
        if m.experts:   # only top_k of the experts run per token
            matrices = ((m.experts, 2 * m.intermediate, m.hidden), (m.experts, m.hidden, m.intermediate))
            expert_params = m.layers * sum(e * rows * inputs for e, rows, inputs in matrices)
            active -= expert_params * (m.experts - m.top_k) // m.experts
            fmt = workload.weight_format
            dtype = dtype_name(get_precision(workload.precision).param_dtype)
            if fmt is not None and fmt.experts:   # stored in the technique's weight format
                expert_bytes = m.layers * sum(fmt.stored_bytes(shape, dtype) for shape in matrices)
            else:
                expert_bytes = expert_params * BYTES[dtype]
        return cls(layers=m.layers, hidden=m.hidden, attn_width=m.attn_width, vocab=m.vocab, active_params=active,
                   causal=m.causal, expert_params=expert_params, expert_bytes=expert_bytes, experts=m.experts,
                   top_k=m.top_k)

    def weights_read(self, tokens: int, parameter_bytes: int) -> float:
        """The bytes of weights one forward over `tokens` tokens reads: all of a dense model's; of a mixture of
        experts, the shared weights and the experts its tokens are routed to — with each token choosing top_k of E
        experts, E * (1 - (1 - top_k / E) ** tokens) of them per layer on average (a decode step of a small batch
        reads a few; a prefill, all)."""
        if not self.experts:
            return parameter_bytes
        touched = experts_touched(self.experts, self.top_k, tokens)
        return parameter_bytes - min(self.expert_bytes, parameter_bytes) * (1 - touched)

    def forward_flops(self, batch: int, seq: int) -> float:
        if self.counted_flops_per_token:
            return self.counted_flops_per_token * batch * seq
        attention = (2 if self.causal else 4) * self.layers * batch * seq * seq * self.attn_width
        return 2 * self.active_params * batch * seq + attention


@dataclass
class StepTime:
    total_s: float
    parts: dict[str, float] = field(default_factory=dict)   # compute, recompute, communication, offload, optimizer


@dataclass
class Compute:
    """One micro-step's FLOPs, as the techniques' `cost_compute` hooks leave them."""

    forward: float
    backward: float
    shape: StepShape
    tokens: int
    world_size: int
    recompute: float = 0.0
    recompute_cheap: float = 0.0   # share of the forward's work besides its matmuls re-run in backward (selective)
    split: int = 1           # ranks that divide the FLOPs (tensor, pipeline parallel)
    factor: float = 1.0      # step-time factors of the techniques this model does not derive
    bubble: float = 1.0      # a pipeline schedule's stretch
    fused: bool = False      # pointwise kernels fused (torch.compile): the kernel profile's fused figures
    graphs: bool = False     # kernels replayed as CUDA graphs: the host launches each phase at once


@dataclass
class Step:
    """What the techniques' `cost_overhead` hooks read (the workload, its estimate, the hardware, the compute
    already timed) and add to (`parts`: seconds by part of the step)."""

    workload: ResolvedWorkload
    estimate: MemoryEstimate
    gpu: GPU
    cost: CostModel
    compute: Compute
    accum: int               # micro-steps per step (gradient accumulation; inference: chunks served)
    num_gpus: int
    parameter_tensors: int = 0   # the model's parameter tensors (0: not counted)
    work_s: float = 0.0      # one micro-step's compute, seconds
    redo_s: float = 0.0      # its recompute
    parts: dict[str, float] = field(default_factory=dict)

    def group_link_bytes_per_s(self, ranks: int) -> float:
        """A collective over `ranks` consecutive GPUs: their own links within one node; beyond it, the network
        between the nodes bounds it."""
        per_direction = (self.gpu.interconnect_gbps / 2 if self.gpu.interconnect.startswith("nvlink")
                         else self.gpu.interconnect_gbps)
        if ranks > GPUS_PER_NODE:
            per_direction = min(per_direction, self.cost.network_gbps)
        return per_direction * LINK_EFFICIENCY * 1e9

    @property
    def link_bytes_per_s(self) -> float:
        """A collective over every GPU."""
        return self.group_link_bytes_per_s(self.num_gpus)

    @property
    def data_parallel_link_bytes_per_s(self) -> float:
        """A collective over the data-parallel ranks: every GPU, but on a pipeline's 2-D mesh the ranks of one stage,
        which are consecutive ("pp" is the mesh's outer axis: a stage of 8 is one node)."""
        w = self.workload
        if w.with_trait("splits-blocks") and 1 < w.data_parallel_size < w.world_size:
            return self.group_link_bytes_per_s(w.data_parallel_size)
        return self.link_bytes_per_s

    @property
    def pcie_bytes_per_s(self) -> float:
        return self.gpu.host_link_gbps * 1e9 * LINK_EFFICIENCY

    @property
    def host_step_bytes_per_s(self) -> float:
        return HOST_STEP_GBPS * 1e9

    @property
    def nvme_bytes_per_s(self) -> float:
        """One rank's share of its node's local NVMe drives."""
        return NVME_GBPS * 1e9 / min(self.num_gpus, GPUS_PER_NODE)

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.gpu.memory_bandwidth_gbps * 1e9 * HBM_EFFICIENCY

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of the activations that cross the links (half precision, or float32)."""
        return 4 if self.workload.precision == "fp32" else 2

    @property
    def gradient_bytes(self) -> int:
        """Bytes per element of the gradients (the weights' dtype, or their master copies')."""
        precision = get_precision(self.workload.precision)
        return (precision.master_dtype or precision.param_dtype).itemsize

    def state_bytes(self, category: str) -> int:
        return int(self.estimate.model_state_bytes.get(category, 0))

    def optimizer_s(self, gradient_bytes: float, state_bytes: float) -> float:
        """An optimizer step over `gradient_bytes` of gradients and `state_bytes` of states: the measured seconds per
        parameter where the cost model has them, else memory-bound: 2x the states' and 3x the gradients' bytes at
        HBM bandwidth."""
        precision = get_precision(self.workload.precision)
        per_param = self.cost.optimizer_seconds_per_param(self.workload.optimizer,
                                                          precision.master_dtype or precision.param_dtype)
        if per_param:
            return gradient_bytes / self.gradient_bytes * per_param
        return (2 * state_bytes + 3 * gradient_bytes) / self.hbm_bytes_per_s

    def backward_share(self, compute_s: float) -> float:
        return compute_s * 2 / 3

    def sharded_gathers_s(self, gathers: int) -> float:
        """A sharded layout's collectives (FSDP2, ZeRO-3): `gathers` all-gathers of the parameters and one
        reduce-scatter of the gradients per micro-step, overlapped with its compute."""
        n = self.workload.data_parallel_size   # on a 2-D mesh: the groups a split layout leaves
        if n == 1:   # one rank (DeepSpeed's ZeRO-3 on one GPU): nothing to gather
            return 0.0
        full_params = self.state_bytes("parameters") * n
        per_micro = (gathers + 1) * (n - 1) / n * full_params / self.data_parallel_link_bytes_per_s
        return max(0.0, per_micro - self.cost.comm_overlap * (self.work_s + self.redo_s)) * self.accum

    def gradient_all_reduce_s(self, gradient_bytes: float) -> float:
        """Data parallel (DDP, ZeRO-1/2): one all-reduce of the gradients per step, overlapped with backward."""
        n = self.workload.data_parallel_size
        if n == 1:
            return 0.0
        all_reduce = 2 * (n - 1) / n * gradient_bytes / self.data_parallel_link_bytes_per_s
        return max(0.0, all_reduce - self.cost.comm_overlap * self.backward_share(self.work_s))

    def activation_host_bytes(self) -> int:
        """Host bytes the step's saved activations take (the host bytes beyond an offloaded optimizer's: its closed
        form for a transformer family the analytic model has; for any other model, float32 master weights, gradients
        and AdamW's two states, 16 bytes per parameter at most, this rank's shard of them when a sharding layout keeps
        them)."""
        w = self.workload
        if registry.has_family(w.source):
            held = sum(offload_host_bytes(w))
        elif w.with_trait("host-optimizer"):
            held = 16 * self.estimate.num_parameters // (w.data_parallel_size if w.with_trait("offloads-shards") else 1)
        else:
            held = 0
        return max(0, self.estimate.host_bytes - held)

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds


def _compute_dtype(precision: str) -> torch.dtype:
    compute = get_precision(precision)
    return compute.autocast_dtype or compute.param_dtype


def _tflops(gpu: GPU, precision: str) -> float:
    dtype = _compute_dtype(precision)
    if dtype == torch.float32:
        return gpu.fp32_tflops
    if dtype == torch.bfloat16 and gpu.bf16_tflops:
        return gpu.bf16_tflops
    return gpu.fp16_tflops


def _compute_s(flops: float, gpu: GPU, precision: str, tokens: int | None, cost: CostModel) -> float:
    """`tokens` per matmul call (None: decode, where the bandwidth bound applies instead of the batch size's)."""
    efficiency = cost.mfu * (1.0 if tokens is None else tokens / (tokens + cost.tokens_half))
    return flops / (_tflops(gpu, precision) * 1e12 * efficiency)


def _phase_s(phase: Phase, step: Step) -> float:
    """One phase's kernels on the device: matmuls at their rate, fused attention at its own, everything else at
    the memory's bandwidth, a gap per kernel; the host issues every kernel ahead of the device (a GPU) or before
    it (a CPU), whichever bounds the phase."""
    return _phase_parts(phase, step)[0]


def _phase_parts(phase: Phase, step: Step) -> tuple[float, float]:
    """(the phase's seconds, its matmuls' share of them)."""
    w, gpu, cost, fused = step.workload, step.gpu, step.cost, step.compute.fused
    dtype = dtype_name(_compute_dtype(w.precision))
    batched_tflops = dict(cost.batched_tflops).get(dtype)
    if batched_tflops:
        gemm = (_compute_s(phase.gemm_flops - phase.batched_flops, gpu, w.precision, step.compute.tokens, cost)
                + phase.batched_flops / (batched_tflops * 1e12))
    else:
        gemm = _compute_s(phase.gemm_flops, gpu, w.precision, step.compute.tokens, cost)
    attention_tflops = (dict(cost.attention_tflops).get(dtype)
                        or _tflops(gpu, w.precision) * cost.attention_share(gpu))
    attention = phase.attention_flops / (attention_tflops * 1e12)
    per_element = dict(cost.pointwise_s_per_element).get(dtype)
    if per_element is None:
        memory = (phase.fused_bytes if fused else phase.eager_bytes) / step.hbm_bytes_per_s
    else:
        memory = (phase.fused_elements if fused else phase.eager_elements) * per_element
    memory += phase.random_elements * cost.random_s_per_element
    kernels = phase.fused_kernels if fused else phase.eager_kernels
    return _with_host(gemm + attention + memory + kernels * cost.launch_s, kernels, step), gemm


def _with_host(device_s: float, kernels: int, step: Step) -> float:
    """The device's time, or the host's to issue its `kernels` (one graph launch when they are CUDA graphs)."""
    cost = step.cost
    host_s = (1 if step.compute.graphs else kernels) * cost.host_op_s
    return max(device_s, host_s) if cost.host_overlaps else device_s + host_s


def step_time(workload: ResolvedWorkload, estimate: MemoryEstimate, gpu: GPU, *, grad_accum: int, num_gpus: int,
              cost: CostModel = ASSUMED) -> StepTime:
    """Seconds per optimizer step (train) or per served batch (inference) of `workload` repeated
    `grad_accum` times on each of its ranks. `estimate` (analytic, for the target GPU) gives the bytes the
    step moves; an estimate without bytes counts FLOPs only (a lower bound: search.lower_bound_estimate)."""
    shape = StepShape.of(workload, estimate.num_parameters)
    seq, batch = workload.effective_seq_len, workload.batch_size
    forward = shape.forward_flops(batch, seq)
    compute = Compute(forward=forward, backward=2 * forward, shape=shape, tokens=batch * seq,
                      world_size=workload.world_size)
    for technique in workload.technique_configs:
        technique.cost_compute(compute)
    step = Step(workload, estimate, gpu, cost, compute, grad_accum, num_gpus)
    if workload.task == "train":
        _train_step(step)
    else:
        _inference_batch(step)
    for technique in workload.hooked_techniques:
        technique.cost_overhead(step)
    return StepTime(sum(step.parts.values()), step.parts)


def _micro_step_s(step: Step, profile: KernelProfile | None) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of one micro-step as the techniques' hooks left its FLOPs: the
    counted kernels' time scaled by the FLOPs the hooks changed (a frozen weight's backward, a recompute), or
    without a profile the FLOPs at the matmuls' rate."""
    w, c = step.workload, step.compute
    base = c.shape.forward_flops(w.batch_size, w.effective_seq_len)
    if profile is None or not base:
        def timed(flops: float) -> float:
            return _compute_s(flops, step.gpu, w.precision, c.tokens, step.cost)
        return timed(c.forward), timed(c.backward), timed(c.recompute)
    (forward_s, matmuls_s), backward_s = _phase_parts(profile.forward, step), _phase_s(profile.backward, step)
    recompute_s = forward_s * c.recompute / base + c.recompute_cheap * max(0.0, forward_s - matmuls_s)
    return forward_s * c.forward / base, backward_s * c.backward / (2 * base), recompute_s


def _train_step(step: Step) -> None:
    w, c = step.workload, step.compute
    factor = c.factor / c.split
    profile = kernel_profile(w, step.gpu.kernels)
    step.parameter_tensors = profile.parameter_tensors if profile else 0
    forward_s, backward_s, recompute_s = _micro_step_s(step, profile)
    step.work_s = (forward_s + backward_s) * factor * c.bubble
    step.redo_s = recompute_s * factor * c.bubble
    step.parts.update(compute=step.work_s * step.accum, recompute=step.redo_s * step.accum, communication=0.0)
    if w.engine == "deepspeed":   # its ZeRO stages: stage 3 gathers like a sharded layout, 1-2 all-reduce
        step.add("communication", step.sharded_gathers_s(2) if w.zero_stage == 3 else
                 step.gradient_all_reduce_s(step.estimate.num_parameters * step.activation_bytes))
    states = step.state_bytes("optimizer_states") + step.estimate.paged_bytes   # paged ones are read too
    step.parts.update(optimizer=step.optimizer_s(step.state_bytes("gradients"), states), offload=0.0)


def _inference_batch(step: Step) -> None:
    w, c, cost, gpu = step.workload, step.compute, step.cost, step.gpu
    seq, batch = w.effective_seq_len, w.batch_size
    factor = c.factor / c.split
    profile = kernel_profile(w, gpu.kernels)
    prefill = _micro_step_s(step, profile)[0] * factor
    decode = 0.0
    if w.new_tokens:
        kv_mean = step.estimate.at_peak.get("kv_cache", 0) * (seq + w.new_tokens / 2) / (seq + w.new_tokens)
        weights = c.shape.weights_read(batch, step.state_bytes("parameters"))
        memory_s = (weights + kv_mean) / step.hbm_bytes_per_s
        flops_s = _compute_s(c.shape.forward_flops(batch, 1) + 4 * c.shape.layers * batch * seq * c.shape.attn_width,
                             gpu, w.precision, None, cost) * factor
        kernels = 0 if profile is None else profile.forward.fused_kernels if c.fused else profile.forward.eager_kernels
        decode = _with_host(max(memory_s, flops_s) + kernels * cost.launch_s, kernels, step) * w.new_tokens
    step.work_s = prefill + decode
    step.parts.update(compute=(prefill + decode) * step.accum, communication=0.0, offload=0.0)


def timing(workload: ResolvedWorkload, estimate: MemoryEstimate, gpu: GPU, cost: CostModel = ASSUMED) -> dict:
    """The cost model's time for one fixed configuration (what `memfit estimate --gpu` reports beside the memory):
    one optimizer step of the workload's batch on each rank (train), or the prefill and every decode step of its
    batch (inference), and the tokens per second per GPU that makes (generated tokens when it decodes; samples for
    a model whose batch is not token sequences)."""
    timed = step_time(workload, estimate, gpu, grad_accum=1, num_gpus=workload.world_size, cost=cost)
    per_sample, unit = workload.throughput_per_sample
    done = workload.batch_size * workload.data_parallel_size * per_sample
    key = "samples_per_second_per_gpu" if unit == "samples" else "tokens_per_second_per_gpu"
    return {"step_time_s": round(timed.total_s, 6), key: round(done / timed.total_s / workload.world_size, 3),
            "throughput_unit": f"{unit}/s per GPU", "time_parts_s": {k: round(v, 6) for k, v in timed.parts.items()},
            "time_source": cost.source}
