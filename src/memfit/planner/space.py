"""The search space: every combination of techniques the planner may propose for a request.

One candidate is one way to run the step (precision, optimizer, techniques, how the GPUs are used);
the micro-batch is chosen later, per candidate, by the search. A combination the composition rules
(techniques/compose.py) or a technique's own check refuse never becomes a candidate: building its
Workload raises, and the search records why.

Left out on purpose: techniques that change what is computed rather than how (truncate, sequence-chunks,
sliding-window change the sequence the model sees; distillation trains another model), and unstructured
pruning (it saves no memory, measured).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from memfit.planner.request import PlanRequest
from memfit.specs.workload import Workload

CHECKPOINTING = (None, "checkpointing", "checkpointing:mode=selective", "checkpointing:mode=offload")
LOSSLESS_OPTIMIZERS = ("adamw", "adamw8bit")
LOSSY_OPTIMIZERS = ("adamw4bit", "adafactor")
LOSSY_TRAIN = (None, "lora", "qlora", "prune-structured:ratio=0.25")
LOSSY_INFERENCE = (None, "int8-weight-only", "int8-dynamic", "bnb-4bit", "prune-structured:ratio=0.25")


@dataclass(frozen=True)
class Candidate:
    precision: str
    optimizer: str = "adamw"
    techniques: tuple[str, ...] = ()
    world_size: int = 1          # ranks one step runs over (the Workload's)
    zero_stage: int = 0
    engine: str = "pytorch"
    data_parallel: int = 1       # copies of the model the batch is split over
    batch_multiple: int = 1      # the micro-batch must be a multiple of this (pipeline micro-batches)

    def workload(self, request: PlanRequest, micro_batch: int) -> Workload:
        return Workload(model=request.model, task=request.task, batch_size=micro_batch, seq_len=request.seq_len,
                        new_tokens=request.new_tokens, precision=self.precision, optimizer=self.optimizer,
                        world_size=self.world_size, zero_stage=self.zero_stage, engine=self.engine,
                        techniques=self.techniques)

    @property
    def num_gpus(self) -> int:
        return max(self.world_size, self.data_parallel)

    def labels(self) -> list[str]:
        """The plan's techniques as a user reads them: precision, optimizer and parallelism included."""
        names = [self.precision] + ([self.optimizer] if self.optimizer != "adamw" else [])
        if self.engine == "deepspeed":
            names.append(f"deepspeed-zero{self.zero_stage}")
        elif self.world_size > 1 and not any(t.split(":")[0] in ("fsdp2", "tensor-parallel", "pipeline-parallel")
                                             for t in self.techniques):
            names.append("ddp" if self.zero_stage == 0 else "ddp+zero1")
        elif self.data_parallel > 1 and self.world_size == 1:
            names.append(f"{self.data_parallel} replicas")
        return names + list(self.techniques)


def _precisions(request: PlanRequest) -> tuple[str, ...]:
    if request.on_cpu:   # CPUs run float32 fastest more often than not
        return ("fp32", "bf16") if request.task == "inference" else ("fp32", "bf16-mixed", "bf16")
    if request.task == "inference":
        return ("bf16",) if request.gpu.bf16_tflops else ("fp16-mixed", "fp32")
    return ("bf16-mixed", "bf16") if request.gpu.bf16_tflops else ("fp16-mixed", "fp32")


def _parallel_layouts(request: PlanRequest) -> list[Candidate]:
    """How the GPUs are used: each layout a partial candidate (precision filled in later)."""
    n = request.num_gpus
    if n == 1:
        return [Candidate("fp32")]
    if request.task == "inference":
        return [Candidate("fp32", data_parallel=n), Candidate("fp32", techniques=("tensor-parallel",), world_size=n)]
    layouts = [Candidate("fp32", world_size=n, data_parallel=n),                    # DDP
               Candidate("fp32", world_size=n, zero_stage=1, data_parallel=n),      # DDP + ZeRO-1
               Candidate("fp32", techniques=("fsdp2",), world_size=n, data_parallel=n),
               Candidate("fp32", techniques=("fsdp2:reshard=false",), world_size=n, data_parallel=n),
               Candidate("fp32", techniques=("tensor-parallel",), world_size=n),
               Candidate("fp32", techniques=(f"pipeline-parallel:microbatches={n}",), world_size=n,
                         batch_multiple=n)]
    layouts += [Candidate("fp32", world_size=n, zero_stage=stage, engine="deepspeed", data_parallel=n)
                for stage in (1, 2, 3)]
    return layouts


def candidates(request: PlanRequest, *, eager_attention: bool) -> list[Candidate]:
    """Every combination to consider, before the rules are checked (the search builds each Workload)."""
    lossy = request.allow == "lossy"
    attention = (None, "sdpa") if eager_attention else (None,)
    out = []
    for layout, precision in itertools.product(_parallel_layouts(request), _precisions(request)):
        if layout.engine == "deepspeed" and not precision.endswith("-mixed"):
            continue
        if request.task == "inference":
            extras = itertools.product(attention, (None, "stream-layers"), LOSSY_INFERENCE if lossy else (None,))
            for parts in extras:
                out.append(replace(layout, precision=precision,
                                   techniques=layout.techniques + tuple(p for p in parts if p)))
            continue
        optimizers = LOSSLESS_OPTIMIZERS + (LOSSY_OPTIMIZERS if lossy else ())
        for optimizer, change in itertools.product(optimizers, LOSSY_TRAIN if lossy else (None,)):
            if change and optimizer != "adamw":   # one lossy change at a time keeps the space small
                continue
            for parts in itertools.product(attention, CHECKPOINTING, (None, "chunked-ce"), (None, "cpu-offload")):
                techniques = layout.techniques + tuple(p for p in (change, *parts) if p)
                out.append(replace(layout, precision=precision, optimizer=optimizer, techniques=techniques))
    return out
