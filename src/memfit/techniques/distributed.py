"""Fully sharded data parallel training (FSDP2, ZeRO-3) over ranks.

`memfit measure --world-size N -t fsdp2` starts N real ranks with torchrun (gloo on CPU) and reports the
highest per-rank peak; the traced estimate runs rank 0 in one process with PyTorch's fake process group
(collectives return fake tensors of the right shape), so it runs FSDP2's own code.

  fsdp2   torch.distributed.fsdp.fully_shard on every repeated block, then on the root. Parameters,
          gradients and optimizer states are sharded over the ranks (1/N each). A block's parameters are
          all-gathered before it runs and freed after (reshard_after_forward=True; FSDP2 frees by resizing
          the storage to 0); the root's (embeddings, final norm, LM head) stay gathered through forward and
          backward; the last block is prefetched when backward starts; after a block's backward its
          unsharded gradients are copied into one flat buffer and reduce-scattered into this rank's shard.
          Memory per rank: 16 Psi / N of model states (fp32 AdamW) + one block's unsharded parameters and
          gradients + the root's parameters + activations of the rank's micro-batch.
          Rajbhandari et al., 2020 (ZeRO-3); Zhao et al., 2023 (PyTorch FSDP).

DDP (a whole model per rank plus a flat copy of the gradients in its buckets) is modelled by
`--world-size N` without -t fsdp2 (sharding.py); it is not run for real yet.
"""
from __future__ import annotations

from dataclasses import dataclass

from memfit.core.errors import MemfitError
from memfit.techniques.base import Technique, register
from memfit.techniques.blocks import repeated_blocks
from memfit.techniques.setup import StepSetup


@register
@dataclass(frozen=True, kw_only=True)
class Fsdp2(Technique):
    name = "fsdp2"
    risk = "numerical"
    stage = "shard"
    summary = "fully_shard (ZeRO-3): parameters, gradients and optimizer states sharded over the ranks"

    def check(self, workload) -> None:
        if workload.world_size < 2:
            raise MemfitError("-t fsdp2 shards over several ranks; pass --world-size N (N >= 2).")
        if workload.zero_stage:
            raise MemfitError(f"-t fsdp2 is ZeRO-3 already; drop --zero {workload.zero_stage}.")
        if workload.task != "train":
            raise MemfitError("-t fsdp2 is for training; drop it for --task inference.")

    def apply_(self, setup: StepSetup) -> None:
        import torch.distributed as dist
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            raise MemfitError("-t fsdp2 needs a process group: run under torchrun (or `memfit measure "
                              "--world-size N`, which starts one).")
        with unset_fake_temporarily():   # the mesh reads real values
            mesh = init_device_mesh(setup.device_type, (dist.get_world_size(),))
        for _, block in repeated_blocks(setup.model):
            fully_shard(block, mesh=mesh)
        fully_shard(setup.model, mesh=mesh)
