"""CPU offload (memory extension): gradients and optimizer states (`cpu-offload`), the weights of an
inference model larger than the device (`stream-layers`), and the tensors autograd saves
(`checkpointing:mode=offload`, see checkpointing.py).

  cpu-offload            one process: ZeRO-Offload (Ren et al., 2021). The optimizer keeps float32
                         master weights, their gradients and its states in host RAM and steps there;
                         each gradient is copied to the host as soon as autograd has accumulated it
                         and freed on the device; after the step the updated weights are copied back.
                         Device: the model's parameters and activations, one gradient at a time, no
                         optimizer state. Host: 4 (master) + 4 (gradient) + the optimizer's states in
                         float32 per parameter (AdamW: 8), plus the CPU step's temporaries.
  cpu-offload + fsdp2    FSDP2's CPUOffloadPolicy: the sharded parameters, gradients and optimizer
                         states live on the host and the optimizer steps there; each block's
                         parameters are copied to the device and all-gathered before it runs.
                         Device: the gathered blocks, the root's parameters and the activations.
                         Host: (parameters + gradients + states) / N.
  cpu-offload + --engine deepspeed   ZeRO-Offload run by DeepSpeed itself (steps/deepspeed_loop.py):
                         float32 masters, moments and gradients of each rank's partition in host RAM,
                         stepped by DeepSpeed's CPU Adam; at stage 3 the weights' partitions too.
  nvme-offload           ZeRO-Infinity (DeepSpeed, stage 3): the same host step, with the float32 masters,
                         moments and gradients swapped to files on a local NVMe drive and read back each
                         step; host RAM holds DeepSpeed's swap buffers and the weights' partitions.

  stream-layers          inference of a model larger than the device: each repeated block's weights
                         live in host RAM and are copied to the device just before the block runs,
                         and dropped after (accelerate's CPU offload; no prefetch here). Device: the
                         root's weights (embeddings, head), one block's weights, the activations and
                         the KV cache. Host: the blocks' weights. Time: every forward (each decoded
                         token too) copies the blocks' weights over PCIe.
  park-frozen            training with frozen modules that no gradient flows through (a frozen encoder
                         or embeddings before the trained part): their weights live in host RAM and are
                         copied in for their own forward only. Device: the trained part's step, one frozen
                         module's weights at a time; host: the frozen weights.
  checkpointing:mode=offload   each chosen block's saved tensors (its parameters excepted) are copied to
                         the host as autograd saves them, and back to the device, one node's at a time,
                         when backward needs them (torch.autograd.graph.save_on_cpu, one copy per
                         tensor). Device: as checkpointing, without the recompute; host: the saved
                         activations of the offloaded blocks.

Gradient and weight copies here are synchronous (on a GPU, at least 2 x the model's bytes cross PCIe
every step); DeepSpeed overlaps them with backward. The step-time factors are `assumed` until measured
on a GPU. On the CPU the copies stay in one memory; memfit still counts the host tensors apart
(steps/host.py).
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision, precision_names
from memfit.steps.deepspeed_loop import nvme_offload_config
from memfit.steps.hooks import tensors_in
from memfit.steps.host import host_copy, note_category, note_host, on_host
from memfit.steps.master_weights import MasterWeightsOptimizer
from memfit.steps.setup import StepSetup
from memfit.techniques.base import SNAPSHOT_RATIO, Export, OomFix, Technique, register
from memfit.techniques.blocks import repeated_blocks
from memfit.techniques.contracts import CostCompute, CostStep, OomMessage, OomSnapshot, PlanQuery


@register
@dataclass(frozen=True, kw_only=True)
class CpuOffload(Technique):
    name = "cpu-offload"
    examples = (("cpu-offload", {}),)
    risk = "lossless"
    traits = frozenset({"host-optimizer", "around-blocks"})
    conflicts_with = {
        "reduces-gradients": ("{other} reduces each gradient in buckets as backward produces it, but cpu-offload takes "
                              "it off the device first", "shard the model instead (-t fsdp2 -t cpu-offload)"),
        "splits-linears": ("the host optimizer copies plain tensors, and {other}'s weights are DTensor shards",
                           "drop cpu-offload"),
        "own-backward": ("{other} runs its own backward; the host optimizer is not wired into it", "drop cpu-offload"),
    }
    stage = "offload"
    summary = "gradients, optimizer states (and with fsdp2 the parameter shards) in host RAM; the step runs there"
    time_factor = 1.3
    oom_fixes: ClassVar[tuple[str, ...]] = ("cpu-offload",)
    search_axis = "offload"

    def export(self, tool, workload) -> Export | None:
        sharded = workload.with_trait("offloads-shards") is not None   # FSDP2: its CPUOffloadPolicy
        if tool == "deepspeed":   # ZeRO-Offload: at least stage 1 (the optimizer states are partitioned to offload)
            return Export({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu",
                                                                                    "pin_memory": True}}})
        if tool == "accelerate":
            return Export({"fsdp_config": {"fsdp_offload_params": True}} if sharded else {
                "distributed_type": "DEEPSPEED",
                "deepspeed_config": {"zero_stage": 1, "offload_optimizer_device": "cpu"}})
        if tool == "lightning":   # Lightning registers no stage-1 offload: stage 2 is the same on one GPU
            stage = max(2, workload.zero_stage)
            return Export({"strategy": "fsdp_cpu_offload" if sharded else f"deepspeed_stage_{stage}_offload"})
        return None

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [cls.name] if request.task == "train" else []

    def cost_compute(self, compute: CostCompute) -> None:
        # the compute stays; the time is the host step and the copies
        pass

    def analytic_policy(self, workload) -> dict:
        # each gradient leaves the device once accumulated, unless a sharding wrapper keeps the shards itself
        return {} if workload.with_trait("offloads-shards") else {"grads_leave": True}

    def cost_overhead(self, step: CostStep) -> None:
        """The optimizer steps on the host (every rank of a node shares its memory bandwidth); the updated weights
        cross PCIe back after it, the gradients during backward (overlapped)."""
        w, e = step.workload, step.estimate
        ranks_per_node = min(step.num_gpus, 8)
        trainable_numel = e.num_parameters // max(1, w.world_size)
        per_param = step.cost.optimizer_seconds_per_param(w.optimizer, torch.float32)   # on float32 host masters
        step.parts["optimizer"] = (trainable_numel * ranks_per_node * per_param if per_param
                                   else 2 * e.host_bytes * ranks_per_node / step.host_step_bytes_per_s)
        weights_up = grads_down = trainable_numel * step.gradient_bytes
        overlap = step.cost.copy_overlap * step.backward_share(step.work_s * step.accum)
        step.add("offload", weights_up / step.pcie_bytes_per_s + max(0.0, grads_down / step.pcie_bytes_per_s - overlap))

    def oom_fix(self, message: OomMessage | None, snapshot: OomSnapshot | None) -> OomFix | None:
        if snapshot is None or not snapshot.by_category.get("optimizer_states"):
            return None
        moved = snapshot.by_category["optimizer_states"] + snapshot.by_category.get("gradients", 0)
        return OomFix(self.name, moved, SNAPSHOT_RATIO, f"-t {self.name}")

    def check(self, workload) -> None:
        if workload.task != "train":
            raise MemfitError("-t cpu-offload moves gradients and optimizer states, which only training has; "
                              "drop it for --task inference.")
        if workload.zero_stage and workload.engine != "deepspeed":
            raise MemfitError("-t cpu-offload with --zero: memfit offloads sharded states through FSDP2 or "
                              "DeepSpeed; use --world-size N -t fsdp2 -t cpu-offload, or --engine deepspeed.")
        if get_precision(workload.precision).loss_scaling and workload.engine == "pytorch":
            raise MemfitError(f"{workload.precision} + cpu-offload: the loss scaler unscales and checks the gradients "
                              "on the device, but cpu-offload moves each one to the host as it arrives; use "
                              f"{precision_names(autocast=True, loss_scaling=False)} with cpu-offload.")

    def apply_(self, setup: StepSetup) -> None:
        if not setup.layout_offloads:   # else the sharding layout keeps the states in host RAM itself
            setup.host_optimizer = HostOffloadOptimizer


@register
@dataclass(frozen=True, kw_only=True)
class NvmeOffload(CpuOffload):
    """DeepSpeed's ZeRO-Infinity (Rajbhandari et al., 2021) at ZeRO stage 3: the optimizer's float32 masters and
    moments, the float32 gradients and the half weights' partitions swapped to files on a local NVMe drive
    through DeepSpeed's async_io op (libaio), read back for each step. Host RAM holds DeepSpeed's swap buffers
    instead of the states, and a flat copy of the half weights up to max_in_cpu (1e9 elements)."""
    name = "nvme-offload"
    examples = (("nvme-offload", {"engine": "deepspeed", "zero_stage": 3, "precision": "bf16-mixed"}),)
    traits = frozenset({"host-optimizer", "swaps-to-disk"})
    conflicts_with = {**CpuOffload.conflicts_with,
                      "cpu-offload": ("both move the optimizer states off the device, to host RAM or to a drive",
                                      "keep one")}
    summary = ("ZeRO-Infinity: optimizer states and gradients swapped to a local NVMe drive (DeepSpeed, ZeRO-3); "
               "path=DIR on the drive (default: a temporary folder)")
    time_factor = 1.5    # the states cross the drive twice a step (assumed; the cost model derives it)
    oom_fixes = ()       # explain-oom offers cpu-offload: the same saving on the device, no drive needed
    needs_engine = "deepspeed"
    path: str = ""

    def export(self, tool, workload) -> Export | None:
        folder = self.path or "/local_nvme"
        if tool == "deepspeed":
            return Export({"zero_optimization": {"stage": 3, **nvme_offload_config(folder, pin_memory=True)}},
                          None if self.path else "nvme_path: set it to a folder on the machine's local NVMe drive")
        if tool == "accelerate":
            return Export({"distributed_type": "DEEPSPEED", "deepspeed_config": {
                "zero_stage": 3, "offload_optimizer_device": "nvme", "offload_param_device": "nvme",
                "offload_optimizer_nvme_path": folder, "offload_param_nvme_path": folder}})
        if tool == "lightning":
            return Export({"strategy": "deepspeed"}, "DeepSpeedStrategy(stage=3, offload_optimizer=True, "
                          f"offload_parameters=True, offload_optimizer_device='nvme', offload_params_device='nvme', "
                          f"nvme_path='{folder}')")
        return None

    def check(self, workload) -> None:
        if workload.engine != self.needs_engine or workload.zero_stage != 3:
            raise MemfitError("-t nvme-offload is DeepSpeed's ZeRO-Infinity, which swaps to NVMe at ZeRO stage 3 "
                              "only: add --engine deepspeed --zero 3 (one GPU or --world-size N).")
        super().check(workload)

    def oom_fix(self, message: OomMessage | None, snapshot: OomSnapshot | None) -> OomFix | None:
        return None

    def apply_(self, setup: StepSetup) -> None:
        super().apply_(setup)
        setup.swap_folder = swap_folder(self.path, owner=setup)

    def cost_overhead(self, step: CostStep) -> None:
        """The host step as cpu-offload's, plus the drive: what was swapped is read for the step and written
        back after it, the node's ranks sharing its drives (DeepSpeed overlaps neither with the compute)."""
        super().cost_overhead(step)
        step.add("offload", 2 * step.estimate.nvme_bytes / step.nvme_bytes_per_s)


def swap_folder(path: str, *, owner) -> str:
    """A fresh folder for this process's swap files, under `path` (or the temporary folder), removed with
    `owner`: the files are scratch, rewritten every step."""
    try:
        if path:
            os.makedirs(path, exist_ok=True)
        folder = tempfile.mkdtemp(prefix="memfit-nvme-", dir=path or None)
    except OSError as exc:
        raise MemfitError(f"-t nvme-offload: cannot make its swap folder under {path or 'the temporary folder'} "
                          f"({exc.strerror}); give path=DIR on a writable local drive.") from None
    weakref.finalize(owner, shutil.rmtree, folder, ignore_errors=True)
    return folder


class HostOffloadOptimizer(MasterWeightsOptimizer):
    """An optimizer whose step runs in host RAM on float32 master weights (ZeRO-Offload in one process): the
    masters, their gradients, the states and the step live on the host; each gradient is copied there as it
    arrives, and the updated weights back to the device after the step."""

    def _master(self, param: torch.Tensor) -> torch.Tensor:
        return host_copy(param, torch.float32)

    def _note(self, masters: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        note_host(grads)                        # host_copy noted the masters

    def _arrived(self, grad: torch.Tensor) -> torch.Tensor:
        return grad.to("cpu")                   # device -> host (nothing moves when the step runs on the CPU)

    def _region(self):
        return on_host()                        # the states, the step's temporaries, the casts back

    def _copy_back(self, param: torch.Tensor, master: torch.Tensor) -> None:   # cast on the host, then -> device
        param.copy_(master if param.dtype == master.dtype else master.to(param.dtype))


def offload_saved_tensors_(block: torch.nn.Module, keep: WeakIdKeyDictionary) -> None:
    """Make `block`'s forward copy every tensor autograd saves to host RAM (its parameters excepted:
    storages in `keep`), and bring each back to the device only when backward uses it: torch's
    `save_on_cpu`, with one host copy per saved tensor and the parameters left where they are."""
    forward = block.forward

    @functools.wraps(forward)
    def offloaded(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(*_offload_hooks(keep)):
            return forward(*args, **kwargs)

    block.forward = offloaded


def _offload_hooks(keep: WeakIdKeyDictionary):
    copies = WeakIdKeyDictionary()      # this forward's host copies: storage -> {view: copy}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage in keep:
            return tensor
        views = copies.setdefault(storage, {})   # ops save fresh views of one tensor (linear's 2-D input)
        view = (tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view not in views:
            views[view] = host_copy(tensor)
        return tensor.device, views[view]

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned(), copy=True)

    return pack, unpack


def parameter_storages(model: torch.nn.Module) -> WeakIdKeyDictionary:
    keep = WeakIdKeyDictionary()
    for tensor in [*model.parameters(), *model.buffers()]:
        keep[tensor.untyped_storage()] = True
    return keep


@register
@dataclass(frozen=True, kw_only=True)
class StreamLayers(Technique):
    name = "stream-layers"
    examples = (("stream-layers", {"task": "inference"}),)
    risk = "lossless"
    stage = "offload"
    summary = "inference larger than the device: block weights in host RAM, each copied in just before it runs"
    conflicts_with = {"subclass-weights": ("stream-layers copies plain weights between host and device; {other}'s "
                                           "weights are tensor subclasses", "drop -t {other} or -t stream-layers")}
    time_factor = 3.0     # PCIe-bound: the whole model crosses the bus every forward (assumed)
    oom_fixes = ("stream-layers",)
    search_axis = "offload"

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [cls.name] if request.task == "inference" else []

    def cost_compute(self, compute: CostCompute) -> None:
        pass

    def analytic_policy(self, workload) -> dict:
        return {"stream_blocks": True}

    def cost_overhead(self, step: CostStep) -> None:
        # the blocks' weights cross PCIe for every forward (each token's too)
        streamed = step.estimate.host_bytes / step.pcie_bytes_per_s
        step.add("offload", streamed * (1 + step.workload.new_tokens) * step.accum)

    def check(self, workload) -> None:
        if workload.task != "inference":
            raise MemfitError("-t stream-layers swaps weights between forwards, which backward would need; it is "
                              "for --task inference (use -t cpu-offload or fsdp2 for training).")

    def apply_(self, setup: StepSetup) -> None:
        for _, block in repeated_blocks(setup.model):
            stream_block_(block)


def stream_block_(block: torch.nn.Module, park_after: Callable[[object], bool] = lambda output: True) -> None:
    """Keep `block`'s weights in host RAM; a device copy exists while its forward runs, and after it
    unless `park_after(output)` says the weights can go back (parked)."""
    device = next(block.parameters()).device
    slots = []
    for module in block.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(host_copy(param), requires_grad=False)
                slots.append((module, name, module._parameters[name]))
    on_device = [False]

    def bring_in(_module, _args):
        if on_device[0]:
            return
        copies = [host.to(device, non_blocking=host.is_pinned(), copy=True) for _, _, host in slots]
        note_category(copies, "parameters")
        for (module, name, _), copy in zip(slots, copies):
            module._parameters[name] = torch.nn.Parameter(copy, requires_grad=False)
        on_device[0] = True

    def send_back(_module, _args, output):
        if not park_after(output):
            return
        for module, name, host in slots:
            module._parameters[name] = host
        on_device[0] = False

    block.register_forward_pre_hook(bring_in)
    block.register_forward_hook(send_back)


@register
@dataclass(frozen=True, kw_only=True)
class ParkFrozen(Technique):
    name = "park-frozen"
    examples = (("park-frozen", {"model": "memfit.examples.frozen_encoder:build",
                                 "inputs": "memfit.examples.frozen_encoder:make_inputs"}),)
    risk = "lossless"
    stage = "offload"
    summary = ("frozen modules that backward never needs (no gradient flows through them) wait in host RAM "
               "outside their own forward")
    time_factor = 1.1     # their weights cross PCIe once per step (assumed)

    def check(self, workload) -> None:
        if workload.task != "train":
            raise MemfitError("-t park-frozen moves frozen weights out of the training step's backward and "
                              "optimizer phases; for inference use -t stream-layers.")
        if workload.source.is_hf:
            raise MemfitError(f"-t park-frozen needs frozen modules, and {workload.model} trains every "
                              "parameter here; freeze part of your own model (a module:function source).")

    def apply_(self, setup: StepSetup) -> None:
        parked = frozen_modules(setup.model)
        if not parked:
            raise MemfitError("-t park-frozen: the model has no frozen module (every one has a trainable "
                              "parameter).")
        for module in parked:
            # a gradient flowing through the module's output would need its weights in backward
            stream_block_(module, park_after=lambda output: not any(t.requires_grad for t in tensors_in(output)))


def frozen_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost modules that are called (containers such as ModuleList are not) and whose parameters
    are all frozen."""
    found: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        params = list(module.parameters())
        container = isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict))
        if params and not container and not any(p.requires_grad for p in params):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found
