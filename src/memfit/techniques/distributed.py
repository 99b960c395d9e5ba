"""Data-parallel training over ranks: DDP (replicated model, all-reduced gradients) and FSDP2 (fully
sharded: ZeRO-3). Both need a process group: `memfit measure --world-size N` starts N ranks with
torchrun (gloo on CPU, NCCL on GPUs); the traced estimate runs rank 0 in one process with PyTorch's
fake process group.

  ddp     torch.nn.parallel.DistributedDataParallel. Every rank holds the whole model, its gradients and
          optimizer states, plus DDP's reduction buckets: a flat copy of the gradients
          (gradient_as_bucket_view=False, the default). DDP cannot run on fake tensors, so a trace runs
          the plain model and adds the bucket copy (sharding.py).
  fsdp2   torch.distributed.fsdp.fully_shard on every repeated block, then on the root. Parameters,
          gradients and optimizer states are sharded over the ranks (1/N each); a block's parameters are
          all-gathered before it runs and freed after (reshard_after_forward=True), its gradients
          reduce-scattered after its backward. Rajbhandari et al., 2020 (ZeRO-3); Zhao et al., 2023 (FSDP).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.core.errors import MemfitError
from memfit.techniques.base import Technique, register
from memfit.techniques.blocks import repeated_blocks
from memfit.techniques.setup import StepSetup

DISTRIBUTED = ("ddp", "fsdp2")


def _check_ranks(name: str, workload) -> None:
    if workload.world_size < 2:
        raise MemfitError(f"-t {name} runs over several ranks; pass --world-size N (N >= 2).")
    if workload.zero_stage:
        raise MemfitError(f"-t {name} and --zero {workload.zero_stage} both describe data parallelism; "
                          "drop --zero (fsdp2 is ZeRO-3).")
    if workload.task != "train":
        raise MemfitError(f"-t {name} is for training; drop it for --task inference.")


def _require_process_group(name: str):
    import torch.distributed as dist

    if not dist.is_initialized():
        raise MemfitError(f"-t {name} needs a process group: run under torchrun (or `memfit measure "
                          "--world-size N`, which starts one).")
    return dist


def _is_fake(model: torch.nn.Module) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(p) for p in model.parameters())


@register
@dataclass(frozen=True, kw_only=True)
class Ddp(Technique):
    name = "ddp"
    risk = "numerical"
    stage = "shard"
    summary = "DistributedDataParallel: whole model per rank, gradients all-reduced (plus a bucket copy)"

    def check(self, workload) -> None:
        _check_ranks(self.name, workload)

    def apply_(self, setup: StepSetup) -> None:
        _require_process_group(self.name)
        if _is_fake(setup.model):   # a trace: the bucket copy is added by sharding.state_weights
            return
        setup.model = torch.nn.parallel.DistributedDataParallel(setup.model)


@register
@dataclass(frozen=True, kw_only=True)
class Fsdp2(Technique):
    name = "fsdp2"
    risk = "numerical"
    stage = "shard"
    summary = "fully_shard (ZeRO-3): parameters, gradients and optimizer states sharded over the ranks"
    reshard_after_forward: bool = True

    def check(self, workload) -> None:
        _check_ranks(self.name, workload)

    def apply_(self, setup: StepSetup) -> None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist = _require_process_group(self.name)
        with unset_fake_temporarily():   # the mesh reads real values
            mesh = init_device_mesh(setup.device_type, (dist.get_world_size(),))
        for _, block in repeated_blocks(setup.model):
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(setup.model, mesh=mesh)
