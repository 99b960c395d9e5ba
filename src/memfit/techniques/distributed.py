"""Training over ranks: fully sharded (FSDP2, ZeRO-3), replicated (DDP), or each block split (tensor
parallel).

`memfit measure --world-size N -t NAME` starts N real ranks with torchrun (gloo on CPU) and reports the
highest per-rank peak; the traced estimate runs rank 0 in one process with PyTorch's fake process group
(collectives return fake tensors of the right shape), so it runs the real wrappers' own code.

  fsdp2   torch.distributed.fsdp.fully_shard on every repeated block, then on the root. Parameters,
          gradients and optimizer states are sharded over the ranks (1/N each). A block's parameters are
          all-gathered before it runs and freed after (reshard_after_forward=True; FSDP2 frees by resizing
          the storage to 0); the root's (embeddings, final norm, LM head) stay gathered through forward and
          backward; the last block is prefetched when backward starts; after a block's backward its
          unsharded gradients are copied into one flat buffer and reduce-scattered into this rank's shard.
          Memory per rank: 16 Psi / N of model states (fp32 AdamW) + one block's unsharded parameters and
          gradients + the root's parameters + activations of the rank's micro-batch. `reshard=false`
          (FSDP's SHARD_GRAD_OP, ZeRO-2-like) keeps each block's gathered parameters from its forward until
          its backward is done: no second all-gather, but every block's parameters whole at the start of
          backward. With -t cpu-offload (offload.py) the shards, their gradients and the optimizer step
          live in host RAM (CPUOffloadPolicy). With bf16-mixed or fp16-mixed, `mp=policy` (the default, as
          torchtitan and torchtune run it) is MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32):
          float32 shards and optimizer states, parameters gathered in the half type, every activation half, the
          unsharded gradients half and reduced in float32, no autocast; `mp=autocast` gathers float32
          parameters and runs the forward under torch.autocast. Rajbhandari et al., 2020 (ZeRO-3); Zhao et al.,
          2023 (PyTorch FSDP).
  ddp     torch.nn.parallel.DistributedDataParallel: a whole model per rank; gradients are all-reduced in
          buckets of ~25 MB as backward produces them. The buckets are one flat copy of every gradient,
          allocated when DDP is built and kept (gradient_as_bucket_view=False, PyTorch's default); with
          `bucket_view=true` the gradients are views into the buckets, so each gradient autograd makes is
          copied in and freed. The second step rebuilds the buckets in the order gradients arrived and
          holds both sets through that step (measured; later steps hold one): memfit reports that step,
          the highest. Memory per rank: the single-process step + 2 x the gradients. `--world-size N`
          alone trains with ddp; with `--zero 1` its optimizer is ZeroRedundancyOptimizer (ZeRO-1: each rank
          keeps and steps the states of its share of the parameters, then broadcasts them).
          Li et al., 2020 (PyTorch Distributed).
  tensor-parallel  torch.distributed.tensor.parallel on every repeated block (Megatron-LM's layout,
          Shoeybi et al., 2019): q/k/v and gate/up projections split by output features (each rank
          computes its heads and channels), o and down projections by input features with their outputs
          all-reduced. Every rank sees the whole batch. Memory per rank: the blocks' weights, gradients,
          optimizer states and attention/MLP activations / N; the residual stream, the norms, the
          embeddings and the head whole. Training and inference (the KV cache splits by heads too).
          `size=T` (fewer than the ranks) splits each block over groups of T ranks, and -t fsdp2 shards what
          each rank holds over the other axis of the 2-D mesh (N/T ranks; torchtitan's FSDP x TP layout:
          `init_device_mesh((N/T, T), ("dp", "tp"))`, TP within a group of consecutive ranks — one node —, FSDP
          across the groups). Each of the N/T groups trains its own share of the batch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from memfit.core.dtypes import dtype_name
from memfit.core.errors import ImpossibleCombination, MemfitError
from memfit.core.precision import Precision, get_precision
from memfit.steps.host import note_category, note_host
from memfit.steps.setup import StepSetup
from memfit.steps.stand_ins import stand_in
from memfit.techniques.base import Export, Technique, register
from memfit.techniques.blocks import repeated_blocks
from memfit.techniques.contracts import AnalyticProgram, CostCompute, CostStep, PlanQuery

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


def require_process_group(name: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise MemfitError(f"-t {name} needs a process group: run under torchrun (or `memfit measure "
                          "--world-size N`, which starts one).")


def _check_data_parallel(name: str, workload) -> None:
    if workload.world_size < 2:
        raise MemfitError(f"-t {name} runs over several ranks; pass --world-size N (N >= 2).")
    if workload.task != "train":
        raise MemfitError(f"-t {name} is for training; drop it for --task inference.")


@dataclass(frozen=True, kw_only=True)
class LayoutTechnique(Technique):
    """A way to lay the model out over the ranks: one per workload, or two on a 2-D mesh (`shares_mesh_with`)."""

    stage = "shard"
    conflicts_with = {"layout": ("each lays the model out over every rank (the 2-D meshes memfit runs are -t fsdp2 "
                                 "with -t tensor-parallel:size=T or -t pipeline-parallel:stages=S)",
                                 "keep one of them")}
    deepspeed_conflict = ("wraps the model itself (ZeRO data parallel)", "drop -t {other}")
    search_axis = "layout"

    def layout_shape(self, num_gpus: int) -> tuple[int, int, int]:
        """Over `num_gpus`: (ranks one step runs over, copies of the model the batch is split over, what the
        micro-batch must be a multiple of)."""
        return num_gpus, num_gpus, 1

    def cost_compute(self, compute: CostCompute) -> None:   # the FLOPs stay; the layout's time is its collectives
        pass


@register
@dataclass(frozen=True, kw_only=True)
class Ddp(LayoutTechnique):
    name = "ddp"
    examples = (("ddp:bucket_view=true", {"world_size": 2, "batch_size": 1, "seq_len": 16}),)
    risk = "numerical"     # gradients are averaged across ranks in buckets: a different summation order
    traits = frozenset({"layout", "reduces-gradients", "wraps-forward", "around-blocks"})
    summary = "DistributedDataParallel: a whole model per rank, gradients all-reduced in buckets"
    bucket_view: bool = False

    def export(self, tool, workload) -> Export | None:
        # the Trainer and DeepSpeed run data parallel themselves over the launched ranks
        return Export({"accelerate": {"distributed_type": "MULTI_GPU"},
                       "lightning": {"strategy": "ddp"}}.get(tool, {}))

    @classmethod
    def implied_by(cls, workload, techniques) -> bool:
        """`--world-size N` training with no layout and --zero 0 or 1 is DDP (with --zero 1 its optimizer is
        ZeroRedundancyOptimizer); DeepSpeed's engine is its own data parallel."""
        return (workload.task == "train" and workload.world_size > 1 and workload.zero_stage <= 1
                and workload.engine == "pytorch" and not any("layout" in t.traits for t in techniques))

    def cost_overhead(self, step: CostStep) -> None:
        step.add("communication", step.gradient_all_reduce_s(step.state_bytes("gradients")))

    def analytic_policy(self, workload) -> dict:   # bucket views: each gradient is copied in and freed
        return {"grads_leave": self.bucket_view}

    def analytic_buffers(self, program: AnalyticProgram) -> None:
        """The reduction buckets: a flat copy of every gradient, built with DDP, and rebuilt in gradient order in
        the second step, which holds both sets."""
        program.hold_gradient_buckets(2)

    def check(self, workload) -> None:
        _check_data_parallel(self.name, workload)
        if workload.zero_stage >= 2:
            raise MemfitError(f"-t ddp with --zero {workload.zero_stage} is modelled only; for sharded gradients "
                              "run -t fsdp2 (reshard=false is ZeRO-2-like).")

    def apply_(self, setup: StepSetup) -> None:
        from torch.nn.parallel import DistributedDataParallel

        require_process_group(self.name)
        traced = stand_in("ddp-trace", setup.model.parameters())
        if traced is not None:
            setup.model = traced(setup.model, bucket_view=self.bucket_view)
            return
        setup.model = DistributedDataParallel(setup.model, gradient_as_bucket_view=self.bucket_view)
        setup.model.register_comm_hook(None, _all_reduce)


def _all_reduce(state, bucket):
    """DDP's default hook (all-reduce, then average, in place), with the bucket noted as gradients."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    note_category([bucket.buffer()], "gradients")
    return allreduce_hook(state, bucket)


# fsdp2's mp= values: with a mixed precision, "policy" is torchtitan's and torchtune's FSDP2 MixedPrecisionPolicy
# (parameters gathered in the half type, every activation half, gradients reduced in float32, no autocast);
# "autocast" gathers float32 parameters and runs the forward under torch.autocast
MP_MODES = ("policy", "autocast")


@register
@dataclass(frozen=True, kw_only=True)
class Fsdp2(LayoutTechnique):
    name = "fsdp2"
    examples = (("fsdp2", {"world_size": 2}),)
    risk = "numerical"
    traits = frozenset({"layout", "dtensor", "shards-weights", "wraps-forward", "offloads-shards", "shards-on-mesh",
                        "around-blocks"})
    zero_stage = 3
    summary = ("fully_shard (ZeRO-3): parameters, gradients and optimizer states sharded over the ranks; "
               "reshard=false keeps each block gathered from its forward to its backward (ZeRO-2-like)")
    reshard: bool = True
    mp: str = "policy"

    def __post_init__(self) -> None:
        if self.mp not in MP_MODES:
            raise MemfitError(f"-t fsdp2: mp={self.mp!r}; choose one of {', '.join(MP_MODES)}.")

    def export(self, tool, workload) -> Export | None:
        if tool == "hf-trainer":
            return Export({"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": self.reshard}})
        if tool == "accelerate":
            return Export({"distributed_type": "FSDP", "fsdp_config": {
                "fsdp_version": 2, "fsdp_reshard_after_forward": self.reshard,
                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}})
        if tool == "lightning":
            return Export({"strategy": "fsdp"}, "Lightning's FSDPStrategy is FSDP1 (close, not the same memory); for "
                          "FSDP2 use ModelParallelStrategy and call fully_shard on each block in configure_model"
                          + ("" if self.reshard else "; reshard=false is FSDPStrategy(sharding_strategy="
                             "'SHARD_GRAD_OP')"))
        return Export({"zero_optimization": {"stage": 3 if self.reshard else 2}})

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [cls.name, f"{cls.name}:reshard=false"] if request.task == "train" and request.num_gpus > 1 else []

    def mixed_dtype(self, precision: Precision) -> torch.dtype | None:
        """The dtype FSDP2 gathers parameters in (MixedPrecisionPolicy's param_dtype), or None: no policy."""
        return precision.autocast_dtype if self.mp == "policy" else None

    def analytic_policy(self, workload) -> dict:
        policy: dict[str, bool | str | None] = {"fsdp": True, "fsdp_reshard": self.reshard}
        gathered = self.mixed_dtype(get_precision(workload.precision))
        if gathered is not None:   # the program computes in the gathered dtype, with no autocast
            policy.update(param_dtype=dtype_name(gathered), autocast_dtype=None,
                          state_dtype="float32")
        return policy

    def cost_overhead(self, step: CostStep) -> None:
        # an all-gather before forward and again before backward (once, without resharding), a reduce-scatter
        step.add("communication", step.sharded_gathers_s(2 if self.reshard else 1))

    def check(self, workload) -> None:
        _check_data_parallel(self.name, workload)
        if workload.zero_stage:
            raise MemfitError(f"-t fsdp2 is ZeRO-3 already; drop --zero {workload.zero_stage}.")

    def apply_(self, setup: StepSetup) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        require_process_group(self.name)
        options = {"mesh": setup.device_mesh("dp"), "reshard_after_forward": self.reshard}   # 2-D: its "dp" axis
        gathered = self.mixed_dtype(setup.precision)
        if gathered is not None:   # bf16 all-gathers and compute, float32 gradient reduction: no autocast left
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32)
            setup.precision = dataclasses.replace(setup.precision, autocast_dtype=None)
        if setup.layout_offloads:   # offload asked for: shards, gradients and states in host RAM
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=setup.device_type == "cuda")
            setup.states_on_host = True
        for _, block in repeated_blocks(setup.model):
            fully_shard(block, **options)
        fully_shard(setup.model, **options)
        if setup.states_on_host:
            note_host(setup.model.parameters())


LLAMA_LAYOUTS = ("llama", "mistral", "qwen2")   # the model types tensor and pipeline parallel split
COLLECTIVE_LATENCY_S = 15e-6   # per collective: what a decode step's small all-reduces cost (assumed)


def check_mesh_axis(technique, workload, param: str, size: int, what: str) -> None:
    """A layout that splits each copy of the model over `size` of the ranks (its `param`): at least 2, below the
    world size and dividing it, with a sharding layout across the copies (a 2-D mesh)."""
    n, spec = workload.world_size, f"-t {technique.name}:{param}={size}"
    if size < 2 or n % size or size >= n:
        raise MemfitError(f"{spec} splits {what}: it must be at least 2, below --world-size {n} and divide it (or "
                          f"drop {param}= to split over every rank).")
    partner = workload.layout
    if partner is None or not technique.shares_mesh_with(partner):
        raise MemfitError(f"{spec} over {n} ranks leaves {n // size} copies of the model to train side by side: add "
                          f"a sharding layout over them (-t fsdp2, torchtitan's 2-D mesh), or drop {param}= to split "
                          "over every rank.")


def check_split_over_ranks(name: str, workload, parts: str) -> None:
    """A technique that splits the model's `parts` over the ranks needs several ranks, no --zero and a
    Llama-layout model."""
    if workload.world_size < 2:
        raise MemfitError(f"-t {name} splits {parts} over several ranks; pass --world-size N (N >= 2).")
    if workload.zero_stage:
        raise MemfitError(f"-t {name} does not combine with --zero; drop --zero.")
    source = workload.source
    if not source.is_hf or source.model_type not in LLAMA_LAYOUTS:
        raise MemfitError(f"-t {name} splits {parts} of {', '.join(LLAMA_LAYOUTS)} layouts; {workload.model} has "
                          "other blocks.")
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # output features split over the ranks
ROWWISE = ("o_proj", "down_proj")                                   # input features split; outputs all-reduced


@register
@dataclass(frozen=True, kw_only=True)
class TensorParallel(LayoutTechnique):
    name = "tensor-parallel"
    examples = (("tensor-parallel", {"world_size": 2}),)
    stage = "split"
    traits = frozenset({"layout", "dtensor", "shards-weights", "splits-linears"})
    risk = "numerical"      # each rank sums a part of every row-parallel matmul; the all-reduce adds them
    summary = ("Megatron-style tensor parallel (DTensor): attention heads and MLP channels split over the ranks; "
               "size=T over groups of T ranks with -t fsdp2 sharding across the groups (2-D mesh)")
    # the norms and embeddings stay plain tensors beside the DTensor weights, and torch.optim's foreach and fused
    # kernels take a list of one kind (PyTorch's foreach default on CUDA fails on it)
    needs_optimizer_impl = "for-loop"
    size: int = 0   # ranks each block is split over; 0: all of them

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        """Over every GPU; from 16 GPUs (two nodes and more) also within each node of 8 or a half of it, with a
        sharding layout across them (the planner pairs it: planner/space.py)."""
        n = request.num_gpus
        if n < 2:
            return []
        meshes = [f"{cls.name}:size={t}" for t in (4, 8) if n >= 16 and n % t == 0 and request.task == "train"]
        return [cls.name] + meshes

    def split(self, world_size: int) -> int:
        return self.size or world_size

    def model_ranks(self, world_size: int) -> int:
        return self.split(world_size)

    def shares_mesh_with(self, other) -> bool:
        return self.size > 0 and "shards-on-mesh" in other.traits

    def mesh_axes(self, world_size: int) -> tuple[tuple[str, int], ...]:
        # groups of `size` consecutive ranks split each block; the sharding layout spans the groups
        return (("dp", world_size // self.size), ("tp", self.size)) if self.size else ()

    def layout_shape(self, num_gpus: int) -> tuple[int, int, int]:
        return num_gpus, num_gpus // self.split(num_gpus), 1   # each group of `size` ranks sees its share of the batch

    def cost_compute(self, compute: CostCompute) -> None:
        compute.split = self.split(compute.world_size)

    def analytic_spec(self, spec, workload):
        """One rank's blocks: its share of the heads and MLP channels (of what the techniques before it left: pruning
        may leave counts that do not split, which the real run would refuse too)."""
        n = self.split(workload.world_size)
        self._check_split(spec.heads, spec.kv_heads, spec.intermediate, n, ImpossibleCombination, " left")
        return dataclasses.replace(spec, heads=spec.heads // n, kv_heads=spec.kv_heads // n,
                                   intermediate=spec.intermediate // n)

    def cost_overhead(self, step: CostStep) -> None:
        """Every block all-reduces its attention and MLP outputs within its group (not overlapped: the next op
        waits): in training 4 per block (forward and backward), 2 more with recompute; in inference 2 per block
        for the prefill and for every decoded token. A group within one node talks over the node's own links."""
        w, c = step.workload, step.compute
        n, layers, hidden = self.split(w.world_size), c.shape.layers, c.shape.hidden
        per_token = 2 * (n - 1) / n * hidden * step.activation_bytes / step.group_link_bytes_per_s(n)
        if w.task == "train":
            step.add("communication", (4 + (2 if c.recompute else 0)) * layers * per_token * c.tokens * step.accum)
            return
        comm = 2 * layers * (per_token * c.tokens + COLLECTIVE_LATENCY_S)
        comm += w.new_tokens * 2 * layers * (per_token * w.batch_size + COLLECTIVE_LATENCY_S)
        step.add("communication", comm * step.accum)

    def check(self, workload) -> None:
        check_split_over_ranks(self.name, workload, "the q/k/v/o and gate/up/down projections")
        t = self.split(workload.world_size)
        if self.size:
            check_mesh_axis(self, workload, "size", self.size, "each block over groups of that many ranks")
        if workload.optimizer_impl in ("foreach", "fused"):
            raise MemfitError(f"-t {self.name} leaves the norms and embeddings plain tensors beside DTensor weights, "
                              f"and --optimizer-impl {workload.optimizer_impl} takes a list of one kind; use "
                              "--optimizer-impl for-loop.")
        shape = workload.source.shape
        self._check_split(shape.heads, shape.kv_heads, shape.intermediate, t, MemfitError)

    def _check_split(self, heads: int, kv_heads: int, intermediate: int, ranks: int, error: type[MemfitError],
                     left: str = "") -> None:
        for what, count in (("attention heads", heads), ("key/value heads", kv_heads), ("MLP channels", intermediate)):
            if count % ranks:
                raise error(f"-t {self.name}: the {count} {what}{left} do not split over {ranks} ranks.")

    def apply_(self, setup: StepSetup) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        require_process_group(self.name)
        mesh = setup.device_mesh("tp")   # with `size`: groups of that many consecutive ranks; else every rank
        for _, block in repeated_blocks(setup.model):
            plan: dict[str, ParallelStyle] = {
                name: ColwiseParallel() if name.rsplit(".", 1)[-1] in COLWISE else RowwiseParallel()
                for name, _ in block.named_modules() if name.rsplit(".", 1)[-1] in COLWISE + ROWWISE}
            if not plan:
                raise MemfitError(f"-t {self.name}: no {', '.join(COLWISE + ROWWISE)} modules in the blocks.")
            parallelize_module(block, mesh, plan)
