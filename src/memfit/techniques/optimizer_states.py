"""Optimizer-state compression: 8-bit and 4-bit AdamW, Adafactor.

Mechanism and memory per parameter (fp32 AdamW keeps m and v: 8 bytes):
  adamw8bit (bitsandbytes AdamW8bit): m and v as uint8 codes in blocks of 256 with one float32
    absmax per block: 2 bytes + 8/256; tensors under 4,096 elements keep float32 states.
    Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022.
  adamw4bit (torchao AdamW4bit): 4-bit codes in blocks of 128 with one float32 scale per block:
    1 byte + 8/128; tensors under 4,096 elements (or not a multiple of 128) keep float32 states.
    Li et al., "Memory Efficient Optimizers with 4-bit States", 2023.
  adafactor (torch.optim.Adafactor): factored second moment (a row and a column vector per
    matrix), no first moment. Shazeer & Stern, 2018.
  paged-adamw8bit (bitsandbytes PagedAdamW8bit): adamw8bit's layout; the m and v codes of tensors of 1e5
    elements or more live in CUDA unified memory (cudaMallocManaged),
    outside PyTorch's allocator: not in max_memory_allocated or reserved, on the device while it has room and
    paged to host RAM when it has not. A GPU estimate reports them as `paged_bytes`; a CPU has no unified
    memory, so there (and in memfit's CPU measurements) they are ordinary tensors.
  paged-adamw (bitsandbytes PagedAdamW): float32 m and v (8 bytes), paged like paged-adamw8bit.
These set the workload's optimizer (`--optimizer` and `-t` are the same setting); each builds its optimizer
for the step (`build`) and declares its states and step temporaries to the analytic estimator: on CUDA each
runs one kernel per tensor (no temporaries); on the CPU bitsandbytes' 8-bit step dequantizes m and v and
updates in float32 (bitsandbytes/backends/cpu/ops.py): 5 float32 copies of the tensor at once (m, v, scaled
gradient, sqrt(v), denominator), plus a float32 copy of a half parameter, one tensor at a time; torchao's
compiled 4-bit step fuses per tensor; Adafactor's var_estimate is parameter-sized (and grad*grad for vectors),
one parameter at a time, or all at once with foreach. Adafactor runs as foreach or for-loop (`--optimizer-impl`);
the 8-bit and 4-bit optimizers have their own kernels and take none.
"""
from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from memfit.core.errors import MemfitError
from memfit.steps.host import note_paged
from memfit.steps.optim import impl_of, torch_optimizer, torch_optimizer_name, trainable
from memfit.steps.setup import StepSetup
from memfit.steps.stand_ins import stand_in
from memfit.techniques.base import REGISTRY, SNAPSHOT_RATIO, Export, OomFix, Technique, register
from memfit.techniques.contracts import CostStep, OomMessage, OomSnapshot, PlanQuery

KEEP_8BIT_STATE = 2 / 8   # bytes of state per parameter: 8-bit m and v against float32 AdamW's (Dettmers et al.)
BNB_MIN_8BIT_SIZE, BNB_BLOCK, BNB_QMAP = 4096, 256, 256   # bitsandbytes' 8-bit state layout
PAGED_MIN_NUMEL = 100_000   # bitsandbytes pages the states of tensors this large (Optimizer8bit.get_state_buffer)


@dataclass(frozen=True, kw_only=True)
class _Optimizer(Technique):
    stage = "optimizer"
    workload_field = "optimizer"
    risk = "numerical"
    default_lr: ClassVar[float] = 1e-4
    search_axis = "optimizer"
    deepspeed_conflict = ("runs DeepSpeed's own AdamW (float32 master weights and moments)", "use --engine pytorch")
    # the --optimizer-impl values it runs with (steps/optim.py OPTIMIZER_IMPLS); none: its own kernels
    implementations: ClassVar[tuple[str, ...]] = ()
    trainer_optim: ClassVar[str]   # its name in TrainingArguments.optim
    optimizer_class: ClassVar[str]   # the class it builds, module.Class

    def export(self, tool, workload) -> Export | None:
        if tool == "hf-trainer":
            return Export({"optim": self.trainer_optim})
        where = {"deepspeed": "deepspeed.initialize(optimizer=...)", "lightning": "configure_optimizers",
                 "accelerate": "accelerator.prepare"}.get(tool, "the training loop")
        return Export({}, f"build {self.optimizer_class} yourself and hand it to {where}")

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [cls.name] if request.task == "train" else []

    def apply_(self, setup: StepSetup) -> None:
        setup.optimizer_name = self.name
        setup.optimizer_factory = self.build

    def build(self, params, *, lr: float | None = None, impl: str | None = None,
              shard: bool = False) -> torch.optim.Optimizer:
        """The optimizer over the trainable `params` (`lr` None: its default)."""
        raise NotImplementedError

    def analytic_step_temporaries(self, params, impl: str) -> list[tuple[int, str]]:
        return []   # one fused kernel per tensor

    def _refuse_shard(self, shard: bool) -> None:
        if shard:
            raise MemfitError(f"--zero 1 shards torch.optim optimizers; {self.name} keeps its own state layout.")


@register
@dataclass(frozen=True, kw_only=True)
class AdamW8bit(_Optimizer):
    name = "adamw8bit"
    examples = (("adamw8bit", {}),)
    trainer_optim = "adamw_bnb_8bit"
    optimizer_class = "bitsandbytes.optim.AdamW8bit"
    summary = "AdamW with block-wise 8-bit m and v (bitsandbytes): ~2 bytes of state per parameter"
    changes = "reduced-precision"
    oom_fixes = ("adamw8bit",)
    conflicts_with = {
        "host-optimizer": ("the host optimizer keeps float32 states (DeepSpeed's CPU Adam does too); 8-bit states "
                           "are kernels for the device", "use AdamW or Adafactor with {other}"),
        "dtensor": ("bitsandbytes' 8-bit states are not DTensor-aware", "use AdamW with {other}"),
    }

    def check(self, workload) -> None:
        _refuse_zero(self.name, workload, "bitsandbytes keeps 8-bit states per whole tensor in blocks of 256")

    def analytic_states(self, params) -> list[tuple[int, str]]:
        """Two 256-entry float32 quantization maps shared by all; per tensor of 4,096 elements or more m and v
        as uint8 codes with a float32 absmax per block of 256, smaller ones float32 m and v."""
        shared = [(BNB_QMAP, "float32")] * 2 if any(p.numel >= BNB_MIN_8BIT_SIZE for p in params) else []
        return shared + [state for p in params for state in (
            [(p.numel, "float32")] * 2 if p.numel < BNB_MIN_8BIT_SIZE
            else [(p.numel, "uint8"), (-(-p.numel // BNB_BLOCK), "float32")] * 2)]

    def analytic_step_temporaries(self, params, impl: str) -> list[tuple[int, str]]:
        quantized = [p for p in params if p.numel >= BNB_MIN_8BIT_SIZE]
        if impl == "foreach" or not quantized:   # CUDA's default marks a CUDA target: one fused kernel per tensor
            return []
        largest = max(quantized, key=lambda p: p.numel)
        return [(largest.numel, "float32")] * (5 + (largest.dtype != "float32"))

    def oom_fix(self, message: OomMessage | None, snapshot: OomSnapshot | None) -> OomFix | None:
        states = snapshot.by_category.get("optimizer_states") if snapshot is not None else None
        if not states:
            return None
        return OomFix(self.name, int(states * (1 - KEEP_8BIT_STATE)), SNAPSHOT_RATIO, f"-t {self.name}")

    def build(self, params, *, lr=None, impl=None, shard=False):
        return _build_bnb(self, params, lr, shard)


class _Paged:
    """What bitsandbytes' paged optimizers share: m and v of every tensor of 1e5 elements or more in CUDA unified
    memory (`get_state_buffer`), outside the allocator; what does not fit beside the rest pages to host RAM."""

    name: ClassVar[str]
    optimizer_class: ClassVar[str]
    state_dtype: ClassVar[str]

    def analytic_paged_states(self, params) -> list[tuple[int, str]]:
        return [(p.numel, self.state_dtype) for p in params if p.numel >= PAGED_MIN_NUMEL for _ in range(2)]

    def oom_fix(self, message: OomMessage | None, snapshot: OomSnapshot | None) -> OomFix | None:
        states = snapshot.by_category.get("optimizer_states") if snapshot is not None else None
        if not states:
            return None
        return OomFix(self.name, int(states), SNAPSHOT_RATIO + "; the states move outside the allocator",
                      f"-t {self.name}")

    def build(self, params, *, lr=None, impl=None, shard=False):
        return _noting_paged_states(_build_bnb(self, params, lr, shard))

    def cost_overhead(self, step: CostStep) -> None:
        """The paged states that do not fit on the device cross PCIe twice a step (in for the update, out again)."""
        step.add("offload", 2 * step.estimate.paged_out_bytes / step.pcie_bytes_per_s)


@register
@dataclass(frozen=True, kw_only=True)
class PagedAdamW8bit(_Paged, AdamW8bit):
    name = "paged-adamw8bit"
    examples = (("paged-adamw8bit", {}),)
    trainer_optim = "paged_adamw_8bit"
    optimizer_class = "bitsandbytes.optim.PagedAdamW8bit"
    summary = ("AdamW8bit with its large states in CUDA unified memory (bitsandbytes PagedAdamW8bit): outside the "
               "allocator, paged to host RAM when the device is full")
    oom_fixes = ("paged-adamw8bit",)
    state_dtype = "uint8"


@register
@dataclass(frozen=True, kw_only=True)
class PagedAdamW(_Paged, _Optimizer):
    name = "paged-adamw"
    examples = (("paged-adamw", {}),)
    trainer_optim = "paged_adamw_32bit"
    optimizer_class = "bitsandbytes.optim.PagedAdamW"
    summary = ("AdamW with float32 m and v in CUDA unified memory (bitsandbytes PagedAdamW): outside the allocator, "
               "paged to host RAM when the device is full")
    oom_fixes = ("paged-adamw",)
    conflicts_with = AdamW8bit.conflicts_with
    state_dtype = "float32"

    def check(self, workload) -> None:
        _refuse_zero(self.name, workload, "bitsandbytes keeps its states per whole tensor")

    def analytic_states(self, params) -> list[tuple[int, str]]:
        """float32 m and v for every tensor, whatever the parameter's dtype (Optimizer2State.init_state)."""
        return [(p.numel, "float32") for p in params for _ in range(2)]

    def analytic_step_temporaries(self, params, impl: str) -> list[tuple[int, str]]:
        """CUDA: one fused kernel per tensor. CPU (bitsandbytes/backends/cpu/ops.py `_optimizer_update_32bit_cpu`),
        one tensor at a time: the scaled float32 gradient, sqrt(v) and sqrt(v) + eps together, then the update
        beside them, plus a float32 copy of a half parameter."""
        if impl == "foreach" or not params:   # CUDA's default marks a CUDA target
            return []
        largest = max(params, key=lambda p: p.numel)
        return [(largest.numel, "float32")] * (3 + (largest.dtype != "float32"))


def _build_bnb(technique: _Optimizer, params, lr, shard: bool) -> torch.optim.Optimizer:
    # Imported and built outside any tracking or fake mode: the import creates constant tables and the
    # constructor computes its quantization maps from real values; neither is the step's memory.
    from torch.utils._python_dispatch import _disable_current_modes

    technique._refuse_shard(shard)
    params = trainable(params)
    with _disable_current_modes():
        bnb = _import("bitsandbytes", technique.name)
        kind = technique.optimizer_class.rpartition(".")[2]
        return getattr(bnb.optim, kind)(params, lr=technique.default_lr if lr is None else lr)


def _noting_paged_states(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """After each step, say which states bitsandbytes pages on a GPU (`get_state_buffer`: m and v of tensors of
    1e5 elements or more); a CPU run keeps them as ordinary tensors, a GPU estimate counts them apart."""
    step = optimizer.step

    def stepped(*args, **kwargs):
        with warnings.catch_warnings():   # its CPU fallback: memfit says itself where the states live
            warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
            out = step(*args, **kwargs)
        note_paged([state[name] for p, state in optimizer.state.items() if p.numel() >= PAGED_MIN_NUMEL
                    for name in ("state1", "state2") if isinstance(state.get(name), torch.Tensor)])
        return out

    optimizer.step = stepped  # type: ignore[method-assign]  # this instance's step, wrapped
    return optimizer


@register
@dataclass(frozen=True, kw_only=True)
class AdamW4bit(_Optimizer):
    name = "adamw4bit"
    examples = (("adamw4bit", {}),)
    trainer_optim = "adamw_torch_4bit"
    optimizer_class = "torchao.optim.AdamW4bit"
    # measured: +24 % held-out perplexity after 60 steps from scratch (benchmarks/results/technique_table.txt)
    risk = "lossy"
    summary = "AdamW with block-wise 4-bit m and v (torchao): ~1 byte of state per parameter"
    conflicts_with = {
        "host-optimizer": ("the host optimizer keeps float32 states (DeepSpeed's CPU Adam does too); 4-bit states "
                           "are kernels for the device", "use AdamW or Adafactor with {other}"),
        "dtensor": ("memfit does not trace torchao's 4-bit states on DTensor shards yet", "use AdamW with {other}"),
    }

    def check(self, workload) -> None:
        _refuse_zero(self.name, workload, "torchao's 4-bit states are per whole tensor (or per DTensor shard)")

    def analytic_states(self, params) -> list[tuple[int, str]]:
        """A float32 `step`; per tensor of 4,096 elements or more (and a multiple of 128) m and v as packed 4-bit
        codes with a float32 scale per block of 128 and a 16-entry map each; other tensors m and v in their
        dtype."""
        layout = []
        for p in params:
            layout.append((1, "float32"))
            if p.numel >= MIN_QUANTIZED_NUMEL and p.numel % BLOCK_4BIT == 0:
                layout += [(p.numel // 2, "uint8"), (p.numel // BLOCK_4BIT, "float32"), (QMAP_4BIT, "float32")] * 2
            else:
                layout += [(p.numel, p.dtype)] * 2
        return layout

    def build(self, params, *, lr=None, impl=None, shard=False):
        self._refuse_shard(shard)
        params = trainable(params)
        lr = self.default_lr if lr is None else lr
        first = next(iter(params[0]["params"]), None) if params and isinstance(params[0], dict) else next(
            iter(params), None)
        # torchao's step is compiled and reads data, which fake tensors cannot do: a trace gets its exact state layout
        layout = stand_in("torchao-adamw4bit", [first] if first is not None else [])
        if layout is not None:
            return layout(params, lr=lr)
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
        optimizer = _import("torchao.optim", self.name).AdamW4bit(params, lr=lr)
        optimizer.step = _outside_dispatch_modes(optimizer.step)
        return optimizer


@register
@dataclass(frozen=True, kw_only=True)
class Adafactor(_Optimizer):
    name = "adafactor"
    examples = (("adafactor", {}),)
    trainer_optim = "adafactor"
    optimizer_class = "torch.optim.Adafactor"
    risk = "lossy"      # a different update rule (and learning rate) than AdamW: the training path changes
    summary = "Adafactor: factored second moment, no first moment (rows + columns per matrix)"
    default_lr = 1e-2
    implementations = ("foreach", "for-loop")   # torch.optim.Adafactor has no fused kernel
    conflicts_with = {"dtensor": ("torch.optim.Adafactor's in-place norm updates do not run on DTensor shards",
                                  "use AdamW with {other}")}

    def analytic_states(self, params) -> list[tuple[int, str]]:
        """A float32 `step`; row and column second-moment factors for a matrix, a full variance for a vector."""
        return [state for p in params for state in [(1, "float32")] + [(n, p.dtype) for n in _factors(p.shape)]]

    def analytic_step_temporaries(self, params, impl: str) -> list[tuple[int, str]]:
        if not params:
            return []
        if impl == "foreach":
            return [(p.numel, p.dtype) for p in params]
        largest = max(params, key=lambda p: p.nbytes * (2 if len(p.shape) < 2 else 1))
        return [(largest.numel, largest.dtype)] * (2 if len(largest.shape) < 2 else 1)

    def build(self, params, *, lr=None, impl=None, shard=False):
        return torch_optimizer(torch.optim.Adafactor, params, lr=self.default_lr if lr is None else lr,
                               impl=impl, shard=shard)


def _factors(shape: tuple[int, ...]) -> list[int]:
    numel = 1
    for size in shape:
        numel *= size
    return [numel] if len(shape) < 2 else [numel // shape[-1], numel // shape[-2]]


def _refuse_zero(name: str, workload, layout: str) -> None:
    if workload.zero_stage >= 1:
        raise MemfitError(f"{name}: {layout}, but ZeRO-1/2 partitions one flat optimizer state across ranks; drop "
                          "--zero, or keep the fp32 optimizer under ZeRO.")


def _outside_dispatch_modes(step):
    """torch.compile will not run under a Python dispatch mode (memfit's tracker is one), so the compiled
    step runs outside them; the allocator, which `measure` reads, still sees everything it allocates."""
    from torch.utils._python_dispatch import _disable_current_modes

    def wrapped(*args, **kwargs):
        with _disable_current_modes():
            return step(*args, **kwargs)

    return wrapped


def _import(module: str, technique: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MemfitError(f"-t {technique} needs {module.split('.')[0]}: pip install 'memfit[optim]'.") from None


# torchao's AdamW4bit state layout (torchao/optim/adam.py `_new_buffer`, subclass_4bit.py `OptimState4bit.zeros`)
BLOCK_4BIT = 128
QMAP_4BIT = 16
MIN_QUANTIZED_NUMEL = 4096


def optimizer_of(optimizer) -> tuple[str, str | None]:
    """(memfit's optimizer name, --optimizer-impl) for an optimizer instance, or a name as given."""
    if optimizer is None or isinstance(optimizer, str):
        return optimizer or "adamw", None
    name = torch_optimizer_name(optimizer)
    if name is not None:
        return name, impl_of(optimizer)
    cls = type(optimizer)
    for technique in REGISTRY.values():
        module, _, class_name = getattr(technique, "optimizer_class", "").rpartition(".")
        if module and cls.__name__ == class_name and cls.__module__.startswith(module):   # an _Optimizer
            return technique.name, impl_of(optimizer) if cast("type[_Optimizer]", technique).implementations else None
    if cls is torch.optim.SGD:
        raise MemfitError("memfit's sgd keeps a momentum buffer (momentum 0.9); this SGD has no momentum and so no "
                          "state: estimate it with optimizer='sgd' for an upper bound, or use a stateful optimizer.")
    known = ["torch.optim.AdamW", "torch.optim.Adam", "torch.optim.SGD"] + sorted(
        cast("type[_Optimizer]", t).optimizer_class for t in REGISTRY.values() if getattr(t, "optimizer_class", None))
    raise MemfitError(f"memfit does not model {cls.__module__}.{cls.__name__}; it models {', '.join(known)} (or "
                      "pass an optimizer name).")
