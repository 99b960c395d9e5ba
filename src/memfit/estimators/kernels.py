"""The kernels one step launches, counted on a fake copy of the model: what the step-time model turns into seconds.

A step's time on a GPU is not its FLOPs over a utilisation: the matmuls run near the tensor cores' rate, the
pointwise work between them (norm upcasts, rotary embeddings, activations, residual adds, the loss over the
vocabulary, and their backward) streams memory, and every kernel costs a launch. How much of each a model has
is a property of its code, so it is counted, not assumed: the model is built on fake tensors (nothing
model-sized is allocated) and its forward, and backward when it trains, run under a dispatch mode that records
every ATen op the GPU would run as a kernel —

  gemms      mm, addmm, bmm, baddbmm, convolutions: their FLOPs (PyTorch's own flop_counter formulas), the
             batched ones (bmm, baddbmm: eager attention's) apart, as a device may run them at another rate;
  attention  the fused attention kernels (flash, memory-efficient, cuDNN): their FLOPs, halved for a causal
             call (the kernels skip the masked half); backward 2.5 times forward (its five matmuls to two);
  the rest   every other op but views and allocations: the bytes it reads and writes, and how many elements
             (a CPU's vector units work in float32 whatever the dtype: there, time goes by elements), and
             the random numbers it draws (dropout's masks: a CPU draws each in software).

As torch.compile runs it, pointwise ops and reductions between two matmuls are one kernel (Inductor's fusion):
each run of consecutive fusible ops reads what it did not produce itself and writes only what something outside
the run reads later; the kernels of such a run count once. (Inductor's min-cut partitioner also recomputes cheap
pointwise work in backward instead of saving it: not modelled, so the compiled figures are an upper bound.)

A transformer is counted at one and two blocks (a period of its repeated layers each), the difference is one
block's, and the whole stack is the first count plus the rest of the blocks at that rate; a custom model is counted
whole. Counted once per model, precision, sequence length and GPU generation, at two sequences per batch; a
micro-batch of b sequences is b / 2 times the FLOPs and bytes and the same kernels.
"""
from __future__ import annotations

import dataclasses
import operator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from memfit.core.precision import get_precision
from memfit.estimators.cuda_emulation import CudaAutocast, CudaKernels
from memfit.estimators.fake_patches import FakeKernelFixes, real_data_decisions
from memfit.estimators.traced import build_fake
from memfit.specs.hardware import CPU_KERNELS
from memfit.specs.user_code import cache_key
from memfit.specs.workload import Workload
from memfit.steps.train import call_model, loss_of
from memfit.techniques.resolve import ResolvedWorkload, resolve

COUNTED_BATCH = 2   # sequences per counted batch (a batch of one may take other kernels' paths)
ATTENTION_BACKWARD = 2.5   # a fused attention's backward FLOPs over its forward's (five matmuls to two)

aten = torch.ops.aten
_GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm, aten.convolution, aten._convolution,
          aten.convolution_backward, aten._grouped_mm}
_ATTENTION = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
              aten._scaled_dot_product_cudnn_attention, aten._flash_attention_forward,
              aten._efficient_attention_forward, aten._scaled_dot_product_flash_attention_for_cpu}
# their backward kernels: FLOPs counted with the forward's (ATTENTION_BACKWARD); a CPU's own step runs one
_ATTENTION_GRADS = {aten._scaled_dot_product_flash_attention_for_cpu_backward,
                    aten._scaled_dot_product_flash_attention_backward,
                    aten._scaled_dot_product_efficient_attention_backward, aten._flash_attention_backward,
                    aten._efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward}
_NO_KERNEL = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
              aten.detach, aten.lift_fresh, aten._local_scalar_dense, aten._unsafe_view, aten.alias,
              aten.set_, aten.resize_}
_BATCHED = {aten.bmm, aten.baddbmm}
_RANDOM = {aten.bernoulli, aten.bernoulli_, aten.native_dropout, aten.rand, aten.rand_like, aten.randn,
           aten.randn_like, aten.normal_, aten.uniform_, aten.randint, aten.randint_like, aten.randperm}
_ALSO_FUSED = {aten._to_copy, aten.clone, aten.copy_, aten.fill_, aten.zero_, aten.zeros_like, aten.ones_like,
               aten.full_like, aten.where}


@dataclass
class Phase:
    """One phase's kernels (forward or backward) for the counted batch."""

    gemm_flops: float = 0.0
    attention_flops: float = 0.0
    eager_bytes: float = 0.0      # what the other kernels read and write, each op its own kernel
    fused_bytes: float = 0.0      # the same work with pointwise runs fused (torch.compile)
    eager_kernels: int = 0
    fused_kernels: int = 0
    batched_flops: float = 0.0    # the part of gemm_flops in batched matmuls (bmm, baddbmm)
    eager_elements: float = 0.0   # the elements eager_bytes counts
    fused_elements: float = 0.0   # the elements fused_bytes counts
    random_elements: float = 0.0  # random numbers drawn (dropout masks)

    def __add__(self, other: Phase) -> Phase:
        return Phase(*map(operator.add, vars(self).values(), vars(other).values()))

    def __sub__(self, other: Phase) -> Phase:
        return Phase(*map(operator.sub, vars(self).values(), vars(other).values()))

    def times(self, k: float, *, kernels: float = 1.0) -> Phase:
        """FLOPs, bytes and elements times `k`, kernels times `kernels`."""
        counts = {name: (round(value * kernels) if name.endswith("kernels") else value * k)
                  for name, value in vars(self).items()}
        return Phase(**counts)


@dataclass
class KernelProfile:
    """A micro-step's kernels at `batch` sequences of the counted length."""

    forward: Phase
    backward: Phase = field(default_factory=Phase)
    batch: int = COUNTED_BATCH
    parameter_tensors: int = 0   # the model's parameters, tensors (what a step per parameter calls an optimizer on)

    def at_batch(self, batch: int) -> KernelProfile:
        k = batch / self.batch
        return KernelProfile(self.forward.times(k), self.backward.times(k), batch, self.parameter_tensors)


def kernel_profile(workload: ResolvedWorkload, capability: tuple[int, int]) -> KernelProfile | None:
    """The kernels of one micro-step of `workload`'s model (forward, and backward when it trains) at its micro-batch,
    on a GPU of compute `capability` (which attention kernel runs; CPU_KERNELS: a CPU's own), in its precision,
    without its other techniques (they change FLOPs through the cost model's own hooks); attention-switching
    techniques are kept. None where the model cannot be run on its own batch (a user's step feeds it)."""
    profile = _cached(profile_key(workload, capability))
    return profile.at_batch(workload.batch_size) if profile else None


def forward_flops_per_token(workload: Workload) -> float:
    """FLOPs of one forward of `workload`'s model per token of its batch (its matmuls and attention as counted here,
    float32 weights, no techniques): what the step-time model needs of a model without a transformer shape to
    compute them from (a custom nn.Module). Where the model cannot be called on its batch directly (a user's step
    that unpacks the batch itself), 2 FLOPs per parameter per token, the dense-model rule."""
    workload = resolve(workload)
    seq_len = workload.effective_seq_len
    profile = _cached(profile_key(workload, (8, 0), precision="fp32", attention=()))
    if profile is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        return 2.0 * sum(p.numel() for p in build_fake(workload, None, fake_mode).parameters())
    return (profile.forward.gemm_flops + profile.forward.attention_flops) / (COUNTED_BATCH * seq_len)


ProfileKey = tuple[str, str | None, str, int, str, tuple[str, ...], tuple[int, int]]
_PROFILES: dict[ProfileKey, KernelProfile | None] = {}   # counted once per process (None: it cannot be)


def profile_key(workload: ResolvedWorkload, capability: tuple[int, int], *, precision: str | None = None,
                attention: tuple[str, ...] | None = None) -> ProfileKey:
    """What a profile depends on: the model and its inputs, the task, the sequence length, the precision, the
    techniques that switch its attention (the workload's, or those given), and the GPU generation (which attention
    kernel runs)."""
    if attention is None:
        attention = tuple(t.spec for t in workload.technique_configs if t.search_axis == "attention")
    return (cast(str, cache_key(workload.model)), cache_key(workload.inputs), workload.task, workload.effective_seq_len,
            precision or workload.precision, attention, capability)


def counted(key: ProfileKey) -> bool:
    return key in _PROFILES


def count_profile(key: ProfileKey) -> KernelProfile | None:
    """The profile `key` names, counted (None where a custom model cannot run on its own batch)."""
    try:
        return _counted(*key)
    except Exception:   # a user's step feeds the model itself: the step-time model falls back to FLOPs
        if resolve(Workload(model=key[0], inputs=key[1])).source.is_hf:
            raise   # memfit builds a transformers model's batch itself: a failure is memfit's, and shows
        return None


def remember(key: ProfileKey, profile: KernelProfile | None) -> None:
    """A profile counted elsewhere (a worker process) for this process to use."""
    _PROFILES[key] = profile


def _cached(key: ProfileKey) -> KernelProfile | None:
    if key not in _PROFILES:
        _PROFILES[key] = count_profile(key)
    return _PROFILES[key]


def _counted(model: str, inputs: str | None, task: str, seq_len: int, precision: str, attention: tuple[str, ...],
             capability: tuple[int, int]) -> KernelProfile:
    plain = resolve(Workload(model=model, inputs=inputs, task=task, seq_len=seq_len, batch_size=COUNTED_BATCH,
                             precision=precision, techniques=attention))
    source = plain.source
    if not source.is_hf or not source.num_layers:
        return _count(plain, None, capability)
    period = source.layer_period
    one, two = _count(plain, period, capability), _count(plain, 2 * period, capability)
    blocks = source.num_layers / period - 1
    return KernelProfile(one.forward + (two.forward - one.forward).times(blocks, kernels=blocks),
                         one.backward + (two.backward - one.backward).times(blocks, kernels=blocks),
                         parameter_tensors=round(one.parameter_tensors
                                                 + (two.parameter_tensors - one.parameter_tensors) * blocks))


def _count(workload: ResolvedWorkload, num_layers: int | None, capability: tuple[int, int]) -> KernelProfile:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake(workload, num_layers, fake_mode)
    precision = get_precision(workload.precision)
    counter = _Counter()
    train = workload.task == "train"
    device_kernels = (nullcontext() if capability == CPU_KERNELS else
                      CudaKernels(capability, workload.source.attention_kernel))
    with fake_mode, FakeKernelFixes(), real_data_decisions(), device_kernels:
        batch = workload.source.make_batch(batch_size=COUNTED_BATCH, seq_len=workload.effective_seq_len,
                                           task=workload.task, dtype=precision.param_dtype)
        autocast = CudaAutocast(precision.autocast_dtype) if precision.autocast_dtype else nullcontext()
        # inference: the prefill, which for an encoder-decoder is its encoder (steps/inference.py)
        prefill_only = not train and workload.source.head == "seq2seq-lm"
        with torch.set_grad_enabled(train), counter, autocast:
            # prefill_only: a transformers encoder-decoder (its own get_encoder), its batch keyword tensors
            output = (cast(Any, model).get_encoder()(input_ids=cast("dict[str, Any]", batch)["input_ids"])
                      if prefill_only else call_model(model, batch))
            if train:
                counter.phase = "backward"
                loss_of(output).backward()
    return dataclasses.replace(counter.profile(), parameter_tensors=sum(1 for _ in model.parameters()))


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        # (phase, kind, FLOPs, inputs, outputs), each tensor as (storage name, bytes, elements)
        self.ops: list[tuple[str, str, float, list[tuple[int, int, int]], list[tuple[int, int, int]]]] = []
        self._keep: list = []    # the storages seen, alive until counted (their addresses are their names)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = getattr(func, "_overloadpacket", None)
        if packet is None or func.namespace != "aten" or func.is_view or packet in _NO_KERNEL:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if packet in _ATTENTION_GRADS:
            kind, flops = "attention", 0.0
        elif packet in _GEMMS or packet in _ATTENTION:
            flops = (_grouped_mm_flops(args[0], out) if packet is aten._grouped_mm else
                     float(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
                     if packet is aten._scaled_dot_product_flash_attention_for_cpu else
                     float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0)
            if packet in _ATTENTION and _causal(func, args, kwargs):
                flops /= 2
            kind = "attention" if packet in _ATTENTION else "batched" if packet in _BATCHED else "gemm"
        else:   # its "FLOPs" are the random numbers it draws
            fusible = torch.Tag.pointwise in func.tags or torch.Tag.reduction in func.tags or packet in _ALSO_FUSED
            kind = "fusible" if fusible else "other"
            flops = float(outputs[0].numel()) if packet in _RANDOM and outputs else 0.0
        self.ops.append((self.phase, kind, flops, [self._named(t) for t in inputs], [self._named(t) for t in outputs]))
        return out

    def _named(self, tensor: torch.Tensor) -> tuple[int, int, int]:
        storage = tensor.untyped_storage()
        self._keep.append(storage)
        nbytes = min(tensor.numel() * tensor.element_size(), storage.nbytes())
        return StorageWeakRef(storage).cdata, nbytes, nbytes // max(1, tensor.element_size())

    def profile(self) -> KernelProfile:
        readers: dict[int, list[int]] = {}
        for index, (_, _, _, inputs, _) in enumerate(self.ops):
            for name, _, _ in inputs:
                readers.setdefault(name, []).append(index)
        phases = {"forward": Phase(), "backward": Phase()}
        trains = any(op[0] == "backward" for op in self.ops)
        run: list[int] = []
        for index, (phase, kind, flops, inputs, outputs) in enumerate(self.ops):
            counted = phases[phase]
            if kind in ("gemm", "batched"):
                counted.gemm_flops += flops
                counted.batched_flops += flops if kind == "batched" else 0.0
            elif kind == "attention":
                counted.attention_flops += flops
                if phase == "forward" and trains:   # its backward kernel (not an op of the emulated step)
                    phases["backward"].attention_flops += ATTENTION_BACKWARD * flops
            else:
                counted.eager_bytes += _total(inputs, outputs, 1)
                counted.eager_elements += _total(inputs, outputs, 2)
                counted.random_elements += flops
            counted.eager_kernels += 1
            if kind == "fusible" and (not run or self.ops[run[-1]][0] == phase):
                run.append(index)
                continue
            self._close(run, phases, readers)
            run = [index] if kind == "fusible" else []
            if kind != "fusible":
                counted.fused_kernels += 1
                if kind == "other":
                    counted.fused_bytes += _total(inputs, outputs, 1)
                    counted.fused_elements += _total(inputs, outputs, 2)
        self._close(run, phases, readers)
        self._keep.clear()
        return KernelProfile(phases["forward"], phases["backward"])

    def _close(self, run: list[int], phases: dict[str, Phase], readers: dict[int, list[int]]) -> None:
        """One fused kernel for the ops `run` indexes: it reads what it did not make, writes what is read after."""
        if not run:
            return
        read: dict[int, tuple[int, int]]
        written: dict[int, tuple[int, int]]
        inside, made, read, written = set(run), set(), {}, {}
        for index in run:
            _, _, _, inputs, outputs = self.ops[index]
            for name, nbytes, elements in inputs:
                if name not in made:
                    read[name] = max(read.get(name, (0, 0)), (nbytes, elements))
            for name, nbytes, elements in outputs:
                made.add(name)
                if any(reader not in inside for reader in readers.get(name, ())):
                    written[name] = max(written.get(name, (0, 0)), (nbytes, elements))
        counted = phases[self.ops[run[0]][0]]
        moved = [*read.values(), *written.values()]
        counted.fused_bytes += sum(nbytes for nbytes, _ in moved)
        counted.fused_elements += sum(elements for _, elements in moved)
        counted.fused_kernels += 1


def _total(inputs: list[tuple[int, int, int]], outputs: list[tuple[int, int, int]], field: int) -> int:
    """The bytes (field 1) or elements (field 2) an op reads and writes."""
    return sum(t[field] for t in inputs) + sum(t[field] for t in outputs)


def _grouped_mm_flops(mat_a: torch.Tensor, out: torch.Tensor) -> float:
    """A mixture of experts' grouped matmul (transformers' MoE blocks): each output element is a dot product over
    its group's share of the inner dimension — all of it, unless both operands are 2-D (groups split the inner
    dimension, one output matrix per group)."""
    inner = mat_a.shape[-1] if not (mat_a.dim() == 2 and out.dim() == 3) else mat_a.shape[-1] / out.shape[0]
    return 2.0 * out.numel() * inner


def _causal(func, args, kwargs) -> bool:
    schema_names = [a.name for a in func._schema.arguments]
    values = dict(zip(schema_names, args, strict=False)) | kwargs
    return bool(values.get("is_causal", False))

