"""Pipeline parallel (torch.distributed.pipelining): each rank holds a contiguous run of the blocks.

  pipeline-parallel[:microbatches=M,schedule=1f1b|gpipe,stages=S]
          Stage s of N keeps blocks [s L/N, (s+1) L/N); the first stage also the embeddings, the last the
          final norm, the LM head and the loss. A step splits the batch into M micro-batches; the
          activations between ranks travel by send/recv. GPipe (Huang et al., 2019) runs every
          micro-batch's forward, then every backward: each rank holds M micro-batches' activations.
          1F1B (PipeDream-Flush, Narayanan et al., 2021) starts a micro-batch's backward as soon as the
          last rank has its loss: rank s holds at most N - s micro-batches' activations. Gradients are
          summed over the micro-batches and scaled by 1/M (the batch mean, as one process computes it).
          Memory per rank: its blocks' weights, gradients and optimizer states (1/N of the blocks), the
          embeddings or the head, and the activations of the micro-batches in flight, each 1/M of the
          batch. Llama, Mistral and Qwen2 layouts with untied embeddings.
          stages=S (torchtitan's PP x FSDP layout): S stages over a 2-D mesh ("pp" outermost, "dp"
          within), each stage's run of blocks sharded by -t fsdp2 over the N/S ranks of its "dp" axis;
          rank r is stage r // (N/S). Without stages=, every rank is a stage.

The loss is the model's own (`loss_function` of the Hugging Face model); the mean over micro-batches
is sent from the last rank to the others so every rank reports the step's loss.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from memfit.core.errors import MemfitError, require_choice, require_positive_int
from memfit.steps.setup import StepSetup
from memfit.techniques.base import register
from memfit.techniques.contracts import AnalyticProgram, CostCompute, PlanQuery
from memfit.techniques.distributed import (
    LayoutTechnique,
    check_mesh_axis,
    check_split_over_ranks,
    require_process_group,
)

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    from transformers import PreTrainedModel

SCHEDULES = ("1f1b", "gpipe")


@register
@dataclass(frozen=True, kw_only=True)
class PipelineParallel(LayoutTechnique):
    name = "pipeline-parallel"
    examples = (("pipeline-parallel", {"world_size": 2}),)
    risk = "numerical"      # the batch's loss is a mean of micro-batch means: another summation order
    traits = frozenset({"layout", "shards-weights", "splits-blocks", "own-backward", "wraps-forward"})
    summary = "pipeline parallel (torch.distributed.pipelining): each rank holds a run of the blocks; 1f1b or gpipe"
    stage = "split"     # the model is cut into stages before -t fsdp2 shards each stage (stages.ORDER)
    microbatches: int = 2
    schedule: str = "1f1b"
    stages: int = 0     # stages on a 2-D mesh with a sharding layout across each; 0: every rank is a stage

    def __post_init__(self) -> None:
        require_positive_int(self.microbatches, "-t pipeline-parallel: microbatches")
        if self.stages < 0:
            raise MemfitError(f"-t pipeline-parallel: stages must be 0 (every rank) or at least 2, got {self.stages}.")
        require_choice(self.schedule, SCHEDULES, "-t pipeline-parallel: schedule")

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        """Over every GPU; from 16 GPUs (two nodes and more) also one stage per node of 8, with a sharding layout
        within each stage (the planner pairs it: planner/space.py)."""
        n = request.num_gpus
        if request.task != "train" or n < 2:
            return []
        meshes = [f"{cls.name}:microbatches={n // 8},stages={n // 8}"] if n >= 16 and n % 8 == 0 else []
        return [f"{cls.name}:microbatches={n}"] + meshes

    def num_stages(self, world_size: int) -> int:
        return self.stages or world_size

    def stage_of(self, rank: int, world_size: int) -> int:
        """The stage `rank` runs: the mesh's "pp" axis is the outer one, so a stage is N/S consecutive ranks."""
        return rank // (world_size // self.num_stages(world_size))

    def layout_shape(self, num_gpus: int) -> tuple[int, int, int]:
        # each stage's "dp" ranks see their share of the batch, split into the schedule's micro-batches
        return num_gpus, num_gpus // self.num_stages(num_gpus), self.microbatches

    def model_ranks(self, world_size: int) -> int:
        return self.num_stages(world_size)

    def shares_mesh_with(self, other) -> bool:
        return self.stages > 0 and "shards-on-mesh" in other.traits

    def mesh_axes(self, world_size: int) -> tuple[tuple[str, int], ...]:
        # torchtitan's layout: "pp" the outer axis, the sharding layout over "dp" within a stage
        return (("pp", self.stages), ("dp", world_size // self.stages)) if self.stages else ()

    depth_linear = False   # each stage holds other blocks

    def analytic_layers(self, num_layers: int, rank: int, workload) -> int:
        n = workload.world_size
        return len(stage_layers(num_layers, self.stage_of(rank, n), self.num_stages(n)))

    def analytic_ranks(self, world_size: int, method: str):
        """Traced: every stage (its first rank on a 2-D mesh: the others shard the same blocks). Analytic: the first
        stage holds the most blocks (stage_layers gives the extra ones to the first stages), the embeddings and the
        most micro-batches in flight (1F1B), the last the head and the logits; a middle stage holds no more than the
        first of anything, so those two bound every rank."""
        per_stage = world_size // self.num_stages(world_size)
        firsts = list(range(0, world_size, per_stage))
        if method == "traced":
            return firsts, "each stage holds other blocks"
        return sorted({firsts[0], firsts[-1]}), "pipeline stages: the first and the last bound the rest"

    def analytic_weights(self, program: AnalyticProgram) -> None:
        n = program.workload.world_size
        stage = self.stage_of(program.rank, n)
        program.keep_stage(first=stage == 0, last=stage == self.num_stages(n) - 1)

    def analytic_windows(self, windows, workload):   # the schedule cuts the batch into micro-batch views
        return dataclasses.replace(windows, views=True)

    def analytic_train(self, program: AnalyticProgram) -> bool:
        n = program.workload.world_size
        program.pipeline_schedule(self.schedule, self.microbatches, self.stage_of(program.rank, n),
                                  self.num_stages(n))
        return True

    def cost_compute(self, compute: CostCompute) -> None:
        """Each rank computes 1/S of its copy's FLOPs; the schedule's bubble stretches the step by (M + S - 1) / M."""
        stages = self.num_stages(compute.world_size)
        compute.split = stages
        compute.bubble = (self.microbatches + stages - 1) / self.microbatches

    def check(self, workload) -> None:
        check_split_over_ranks(self.name, workload, "the embeddings, blocks and head")
        if workload.task != "train":
            raise MemfitError(f"-t {self.name} runs a training schedule; drop it for --task inference.")
        world, source = workload.world_size, workload.source
        if self.stages:
            check_mesh_axis(self, workload, "stages", self.stages, "the blocks over that many stages")
        n = self.num_stages(world)
        if source.config().tie_word_embeddings:
            raise MemfitError(f"-t {self.name}: {workload.model} ties its embeddings to the LM head, which would "
                              "live on the first and the last rank with gradients summed on neither.")
        if source.num_layers < n:
            raise MemfitError(f"-t {self.name}: {source.num_layers} blocks do not fill {n} ranks.")
        if workload.batch_size % self.microbatches:
            raise MemfitError(f"-t {self.name}: --batch-size {workload.batch_size} does not split into "
                              f"{self.microbatches} micro-batches.")
        if self.schedule == "1f1b" and self.microbatches < n:
            raise MemfitError(f"-t {self.name}: 1F1B needs at least as many micro-batches as ranks "
                              f"({self.microbatches} < {n}); raise microbatches or use schedule=gpipe.")

    def apply_(self, setup: StepSetup) -> None:
        require_process_group(self.name)
        group = setup.device_mesh("pp").get_group() if self.stages else None   # None: every rank a stage
        setup.pipeline = Pipeline(cast("PreTrainedModel", setup.model),   # check(): a Hugging Face causal LM
                                  microbatches=self.microbatches, schedule=self.schedule,
                                  device_type=setup.device_type, logits_dtype=setup.precision.autocast_dtype,
                                  group=group)
        setup.model = setup.pipeline.stage_module


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """Blocks of `stage`: contiguous, the first `num_layers % num_stages` stages one block more."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class _Stage(nn.Module):
    """One rank's part of a causal LM: token ids or hidden states in, hidden states or logits out."""

    def __init__(self, model: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.model: Any = model   # a Hugging Face causal LM: its base model (.model) and .lm_head
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.model.model
        hidden = (base(input_ids=x) if self.first else base(inputs_embeds=x)).last_hidden_state
        return self.model.lm_head(hidden) if self.last else hidden


class Pipeline:
    """This rank's stage of `model` (cut in place) and the schedule that runs a step over the ranks."""

    def __init__(self, model: PreTrainedModel, *, microbatches: int, schedule: str, device_type: str,
                 logits_dtype: torch.dtype | None = None, group=None) -> None:
        import torch.distributed as dist
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        rank, n = dist.get_rank(group), dist.get_world_size(group)   # this rank's stage, of the group's stages
        self.first, self.last, self.microbatches = rank == 0, rank == n - 1, microbatches
        base: Any = model.model   # the decoder: .embed_tokens, .layers, .norm
        base.layers = nn.ModuleList(base.layers[i] for i in stage_layers(len(base.layers), rank, n))
        if not self.first:
            base.embed_tokens = None
        if not self.last:
            base.norm, model.lm_head = nn.Identity(), None
        self.stage_module = _Stage(model, self.first, self.last)
        self._model = model
        self._logits_dtype = logits_dtype   # autocast's, else the weights'
        self._device, self._rank, self._ranks, self._group = torch.device(device_type), rank, n, group
        self._schedule_kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self._schedule: PipelineScheduleSingle | None = None

    def _build_schedule(self, batch_size: int, seq: int) -> PipelineScheduleSingle:
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage

        stage = PipelineStage(self.stage_module, self._rank, self._ranks, self._device,
                              input_args=self._example(batch_size, seq, first=True),
                              output_args=self._example(batch_size, seq, first=False), group=self._group)
        if dist.get_backend() == "fake":
            _vote_static(stage)
        return self._schedule_kind(stage, n_microbatches=self.microbatches, loss_fn=self._loss)

    def _example(self, batch_size: int, seq: int, *, first: bool) -> torch.Tensor:
        """The stage's input (first=True) or output, one micro-batch's shape: metadata for the schedule,
        so no shapes are exchanged between ranks (a traced run's fake process group carries none)."""
        config = self._model.config
        shape = (batch_size // self.microbatches, seq)
        with torch.device("meta"):
            if first and self.first:
                return torch.empty(shape, dtype=torch.long)
            weights = next(self.stage_module.parameters()).dtype   # the residual stream stays in it
            if not first and self.last:
                return torch.empty(*shape, config.vocab_size, dtype=self._logits_dtype or weights, requires_grad=True)
            return torch.empty(*shape, config.hidden_size, dtype=weights, requires_grad=True)

    def step(self, batch: dict) -> torch.Tensor:
        """Forward and backward of every micro-batch in the schedule's order; the batch's mean loss."""
        import torch.distributed as dist

        ids = batch["input_ids"]
        if self._schedule is None:
            self._schedule = self._build_schedule(*ids.shape)
        losses: list[torch.Tensor] = []
        # return_outputs=False: the last rank would otherwise concatenate every micro-batch's logits
        if self.first:
            self._schedule.step(ids, return_outputs=False)
        elif self.last:
            self._schedule.step(target=batch["labels"], losses=losses, return_outputs=False)
        else:
            self._schedule.step(return_outputs=False)
        loss = torch.stack([part.detach() for part in losses]).mean() if losses else torch.zeros((), device=ids.device)
        dist.broadcast(loss, group_src=self._ranks - 1, group=self._group)
        return loss

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._model.loss_function(logits=logits, labels=labels, vocab_size=self._model.config.vocab_size)


def _vote_static(stage) -> None:
    """The schedule's first step has the ranks vote, by send and receive, on whether every stage's shapes
    were given (they are: `_example`). A fake process group receives no values, so a traced rank casts
    the vote's known result itself."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        agreed = torch.ones(1, dtype=torch.int32)
    stage._warmup_forward_vote = lambda has_backward, received_acc=None: agreed
    stage._warmup_backward_result = lambda received_result=None: agreed
