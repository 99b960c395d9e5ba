"""Activation checkpointing (torch.utils.checkpoint, non-reentrant): full per block, every n-th block,
or selective per op; or, instead of recomputing, the blocks' saved tensors offloaded to host RAM
(`mode=offload`, offload.py).

Mechanism: a checkpointed block keeps only its inputs during the forward; backward re-runs the
block's forward (once, when it first needs a saved tensor) and then its backward. `every=n`
checkpoints blocks 0, n, 2n, ... . `mode=selective` keeps the outputs of every matmul (mm, addmm, bmm)
and attention kernel (the expensive ops) and recomputes the cheap ones (norms, activations, rotary,
casts), via torch.utils.checkpoint.create_selective_checkpoint_contexts. `mode=selective-op` is
torchtitan's op policy exactly (torchtitan/models/llama3/infra/parallelize.py, `_save_list`): it keeps
the outputs of aten.mm except every second one (counted per block, in the forward and again in the
re-run), of the flash and memory-efficient SDPA kernels (and the CPU flash kernel, so that CPU runs
match), of reduce-scatter and of max, and recomputes everything else: addmm (a linear with a bias), bmm
(eager attention's matmuls) and half the projections are re-run, so it keeps less than `selective`.
Memory: saved activations of a checkpointed block drop to its inputs (Korthikanti et al., 2022:
`2sbh` per layer for full recompute), and backward holds one block's activations at a time again.
Time: one extra forward of the checkpointed blocks (about a third of a training step; ~20 % in the
transformers performance guide), less for selective. A BatchNorm inside a checkpointed block updates its
running statistics again in the re-run (as PyTorch documents); losses and gradients are unchanged.
"""
from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch

from memfit.core.errors import MemfitError, require_choice, require_positive_int
from memfit.steps.setup import StepSetup
from memfit.techniques.base import SNAPSHOT_RATIO, Export, OomFix, Technique, register
from memfit.techniques.blocks import repeated_blocks
from memfit.techniques.contracts import CostCompute, CostStep, OomMessage, OomSnapshot, PlanQuery
from memfit.techniques.offload import offload_saved_tensors_, parameter_storages

MODES = ("full", "selective", "selective-op", "offload")
SELECTIVE_OP_RECOMPUTE = 0.5   # of one forward: every second projection and the cheap ops (assumed)
KEEP_CHECKPOINTED = 2 / 34   # of a layer's activation bytes: full recompute keeps 2sbh of 34sbh (Korthikanti et al.)


def _expensive_ops() -> set:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_grouped_mm")
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = _expensive_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _torchtitan_save_list() -> set:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default, aten.max.default}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        ops.add(aten._scaled_dot_product_flash_attention_for_cpu.default)
    if hasattr(torch.ops, "_c10d_functional"):
        ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return ops


def selective_op_context():
    """torchtitan's op policy: a fresh mm count per checkpointed call, in the forward and in the re-run."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save, counts = _torchtitan_save_list(), {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op == torch.ops.aten.mm.default:
            counts[mode] += 1
        keep = op in save and not (op == torch.ops.aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@register
@dataclass(frozen=True, kw_only=True)
class Checkpointing(Technique):
    name = "checkpointing"
    traits = frozenset({"around-blocks"})
    examples = (("checkpointing", {}), ("checkpointing:mode=selective", {}), ("checkpointing:mode=offload", {}))
    risk = "lossless"
    stage = "activations"
    summary = ("recompute block activations in backward: full per block, every n-th block, selective per op; "
               "or offload them to host RAM (mode=offload)")
    time_factor = 1.33
    conflicts_with = {"splits-linears": ("mode=offload copies the saved tensors to the host as plain tensors, and "
                                         "{other} saves DTensors", "use checkpointing:mode=full or selective")}
    oom_fixes = ("checkpointing", "checkpointing:mode=selective", "checkpointing:mode=offload")
    search_axis = "activations"
    every: int = 1
    mode: str = "full"
    blocks: str | None = None       # regular expression over module names; default: the repeated blocks

    def __post_init__(self) -> None:
        require_positive_int(self.every, "-t checkpointing: every")
        require_choice(self.mode, MODES, "-t checkpointing: mode")

    def export(self, tool, workload) -> Export | None:
        if self != Checkpointing():   # every block, whole: what the tools' own checkpointing does
            return None
        if tool == "hf-trainer":
            return Export({"activation_checkpointing": True,
                           "activation_checkpointing_kwargs": {"use_reentrant": False}})
        if tool == "accelerate" and workload.with_trait("offloads-shards"):   # FSDP2: its fsdp_config
            return Export({"fsdp_config": {"fsdp_activation_checkpointing": True}})
        return Export({}, "enable it in the model (model.gradient_checkpointing_enable() for a transformers model)")

    def step_time_factor(self) -> float:
        # offload: device <-> host copies of the saved tensors instead of a re-run (overlapped on a GPU)
        return {"full": self.time_factor, "selective": 1.1, "selective-op": 1.17, "offload": 1.1}[self.mode]

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return list(cls.oom_fixes) if request.task == "train" else []

    def analytic_policy(self, workload) -> dict:
        return {"checkpoint_every": self.every,
                "checkpoint_selective": self.mode if self.mode.startswith("selective") else None,
                "checkpoint_offload": self.mode == "offload"}

    def cost_compute(self, compute: CostCompute) -> None:
        """Full: one more forward of every n-th block; selective: everything of the forward but its matmuls (their
        outputs are kept; pointwise ops, attention and dropout's draws are re-run: the step-time model times that
        work, not a share of FLOPs); offload recomputes nothing (its copies are `cost_overhead`)."""
        if self.mode == "full":
            compute.recompute += compute.forward / self.every
        elif self.mode == "selective":
            compute.recompute_cheap += 1.0
        elif self.mode == "selective-op":
            compute.recompute += SELECTIVE_OP_RECOMPUTE * compute.forward

    def cost_overhead(self, step: CostStep) -> None:
        if self.mode == "offload":   # the saved tensors go to the host and back, overlapped with the compute
            moved = 2 * step.activation_host_bytes() / step.pcie_bytes_per_s
            step.add("offload", max(0.0, moved - step.cost.copy_overlap * step.work_s * step.accum))

    def oom_fix(self, message: OomMessage | None, snapshot: OomSnapshot | None) -> OomFix | None:
        activations = snapshot.by_category.get("activations") if snapshot is not None else None
        if not activations:
            return None
        return OomFix(self.name, int(activations * (1 - KEEP_CHECKPOINTED)), SNAPSHOT_RATIO, f"-t {self.name}")

    def conflicts(self):
        return self.conflicts_with if self.mode == "offload" else {}

    def check(self, workload) -> None:
        if workload.task != "train":
            raise MemfitError("-t checkpointing trades recompute for saved activations, which only training "
                              "keeps; drop it for --task inference.")

    def apply_(self, setup: StepSetup) -> None:
        blocks = repeated_blocks(setup.model, self.blocks)
        chosen = [block for index, block in blocks if index % self.every == 0]
        if self.mode == "offload":
            keep = parameter_storages(setup.model)
            for block in chosen:
                offload_saved_tensors_(block, keep)
            return
        checkpoint = step_checkpoint(setup, selective=self.mode if self.mode.startswith("selective") else None)
        for block in chosen:
            checkpoint_block_(block, checkpoint)


def step_checkpoint(setup: StepSetup, *, selective: str | None = None):
    """torch.utils.checkpoint (non-reentrant) for this step. The re-run happens inside backward, where
    checkpoint restores torch.autocast but not Python torch-function modes; memfit's traces use such
    modes (CUDA kernel and autocast emulation), so the re-run re-enters them and a fresh autocast region."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils.checkpoint import checkpoint

    def context_fn():
        contexts = {"selective": selective_context, "selective-op": selective_op_context}
        forward, recompute = contexts[selective]() if selective else (nullcontext(), nullcontext())
        modes = [m for m in _get_current_function_mode_stack() if not getattr(m, "autocast_region", False)]
        again = modes + ([setup.autocast()] if setup.autocast_fn is not None else [])
        return (forward, _entered(recompute, *again)) if again else (forward, recompute)

    return functools.partial(checkpoint, use_reentrant=False, context_fn=context_fn)


@contextmanager
def _entered(*contexts):
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def checkpoint_block_(block: torch.nn.Module, checkpoint) -> None:
    """Make `block`'s forward a checkpoint of itself (module hooks and names unchanged)."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, **kwargs)

    block.forward = checkpointed
