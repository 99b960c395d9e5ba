"""StepSetup: everything a training or inference step needs after the techniques have changed it.

memfit's own runs build one with `techniques.compose.prepare_step` (for a workload); a user's loop gets one
from `memfit.apply_(model, optimizer, techniques)` and uses `setup.autocast()`, `setup.optimizer`,
`setup.loss(model, batch)` and `setup.prepare_batch(batch)` — or just `setup.step(batch)`.
Techniques fill it in; the step (train.py) only reads it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from memfit.core.precision import Precision
from memfit.steps.optim import make_optimizer
from memfit.steps.train import TrainLoop, autocast_region, call_model, loss_of

LossFn = Callable[[nn.Module, Any], torch.Tensor]
BatchSplit = Callable[[Any], list]
# (parameters, lr or None for the optimizer's default, impl, shard over the process group) -> optimizer
OptimizerFactory = Callable[..., torch.optim.Optimizer]
# (parameters, a builder of the optimizer over host master weights) -> an optimizer that steps on the host (used
# like a torch.optim one, not necessarily one: offload's HostOffloadOptimizer)
HostOptimizer = Callable[[Any, Callable[[list], torch.optim.Optimizer]], Any]
# (parameters, a builder of the optimizer over some of them) -> an optimizer that runs those otherwise
OptimizerWrapper = Callable[[Any, Callable[[list], torch.optim.Optimizer]], Any]


def model_loss(model: nn.Module, batch) -> torch.Tensor:
    return loss_of(call_model(model, batch))


def whole_batch(batch) -> list:
    return [batch]


@dataclass
class StepSetup:
    model: nn.Module
    precision: Precision
    device_type: str
    optimizer_name: str = "adamw"
    optimizer_factory: OptimizerFactory | None = None   # an optimizer technique's builder; None: torch.optim's
    optimizer_impl: str | None = None                # foreach | fused | for-loop; None: PyTorch's default
    autocast_fn: Callable | None = None               # replaces torch.autocast (GPU emulation in traces)
    loss: LossFn = model_loss                         # forward + loss of one micro-batch
    micro_batches: BatchSplit = whole_batch           # how one batch is run (accumulated gradients)
    batch_transform: Callable[[Any], Any] | None = None   # applied to the batch before it is split
    optimizer: torch.optim.Optimizer | None = None
    lr: float | None = None                           # None: the optimizer's default
    param_groups: list[dict] | None = None            # the user's parameter groups (apply_), else every parameter
    # an offload technique's optimizer that steps in host RAM on master weights (None: on the device); a sharding
    # technique that keeps the states on the host itself takes it over and sets `states_on_host`
    host_optimizer: HostOptimizer | None = None
    states_on_host: bool = False      # gradient shards, optimizer states and the step live in host RAM
    swap_folder: str | None = None    # DeepSpeed swaps the host optimizer's states to files here (NVMe offload)
    # a technique's optimizer around the given one: stepped in backward, or over float32 master weights
    optimizer_wrapper: OptimizerWrapper | None = None
    shard_optimizer: bool = False     # ZeRO-1 (--zero 1 with DDP): ZeroRedundancyOptimizer
    # Decided once, before any technique applies (techniques/compose.py `decide_layout`), and read by the techniques
    # that share them: the device mesh's axes, outer first, when one technique splits each block (or the model into
    # stages) over part of the ranks and a sharding layout shards over the rest (("dp", 2), ("tp", 4)); () : one axis
    # over every rank. And whether the sharding layout keeps the offloaded shards, gradients and optimizer states in
    # host RAM itself (FSDP2's CPUOffloadPolicy), so that the offload technique leaves the optimizer to it.
    mesh_axes: tuple[tuple[str, int], ...] = ()
    layout_offloads: bool = False
    mesh: Any = None                  # the DeviceMesh over `mesh_axes`, built at its first use (device_mesh)
    pipeline: Any = None              # a pipeline schedule that runs each step's micro-batches itself
    scheduler: Any = None             # the user's LR scheduler, on `optimizer` (apply_)
    phase_callbacks: list[Callable[[str], None]] = field(default_factory=list)   # called as each phase starts
    # -t compile's torch.compile (its backend and mode), for code a technique runs beside the blocks (a loss)
    compile_fn: Callable[[Callable], Callable] | None = None

    def device_mesh(self, axis: str | None = None):
        """The step's device mesh (built once, over `mesh_axes`), or its `axis`; on a 1-D mesh every axis is the
        whole mesh."""
        if self.mesh is None:
            import torch.distributed as dist
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch.distributed.device_mesh import init_device_mesh

            with unset_fake_temporarily():   # the mesh reads real values
                if self.mesh_axes:
                    self.mesh = init_device_mesh(self.device_type, tuple(size for _, size in self.mesh_axes),
                                                 mesh_dim_names=tuple(name for name, _ in self.mesh_axes))
                else:
                    self.mesh = init_device_mesh(self.device_type, (dist.get_world_size(),))
        return self.mesh[axis] if axis is not None and self.mesh_axes else self.mesh

    def autocast(self):
        return autocast_region(self.precision, self.device_type, self.autocast_fn)

    def optimizer_builder(self) -> Callable[[Any], torch.optim.Optimizer]:
        """params -> this setup's optimizer over them (its kind, learning rate, implementation and sharding)."""
        factory = self._factory()
        return lambda params: factory(params, lr=self.lr, impl=self.optimizer_impl, shard=self.shard_optimizer)

    def build_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            # (the cast only gives list() its type: mypy would infer it from the groups' list[dict])
            params = self.param_groups or cast("list[nn.Parameter]", list(self.model.parameters()))
            if self.host_optimizer is not None:   # it steps on the CPU: the CPU's kernels
                factory = self._factory()
                self.optimizer = self.host_optimizer(self.model.parameters(), lambda masters: factory(
                    over_host_copies(params, self.model, masters), lr=self.lr, impl=self.optimizer_impl))
            elif self.optimizer_wrapper is not None:
                self.optimizer = self.optimizer_wrapper(params, self.optimizer_builder())
            else:
                self.optimizer = self.optimizer_builder()(params)
        return self.optimizer

    def _factory(self) -> OptimizerFactory:
        return self.optimizer_factory or functools.partial(make_optimizer, name=self.optimizer_name)

    def step(self, batch):
        """One training step (forward and backward per micro-batch, optimizer step, zero_grad); the loss."""
        if getattr(self, "_loop", None) is None:
            self._loop = TrainLoop(self)
        return self._loop.step(batch)

    def prepare_batch(self, batch) -> list:
        if self.batch_transform is not None:
            batch = self.batch_transform(batch)
        return self.micro_batches(batch)


def over_host_copies(params: list, model: nn.Module, masters: list[torch.Tensor]) -> list:
    """`params` (parameters, or groups of them) with each trainable parameter of `model` replaced by its host
    master copy in `masters` (in the same order as the model's trainable parameters)."""
    return over_copies(params, [p for p in model.parameters() if p.requires_grad], masters)


def over_copies(params: list, originals: list, copies: list[torch.Tensor]) -> list:
    """`params` (parameters, or groups of them, with their settings) with each of `originals` replaced by its copy
    in `copies` (in the same order); the others left out."""
    copy_of = {id(p): c for p, c in zip(originals, copies)}
    if params and isinstance(params[0], dict):
        return [{**group, "params": [copy_of[id(p)] for p in group["params"] if id(p) in copy_of]}
                for group in params]
    return [copy_of[id(p)] for p in params if id(p) in copy_of]
