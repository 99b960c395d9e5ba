"""One simulated step: the context the techniques' analytic hooks work on (techniques/base.py).

A technique says how the analytic estimator accounts for it by calling the mechanisms here, with its own
parameters: declare a frozen teacher beside the model, quantize the linears, add adapters, keep one pipeline
stage's part, run a pipeline schedule, hold gradient buckets. Nothing here names a technique.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from memfit.core.weight_formats import WeightFormat
from memfit.estimators.analytic import weights
from memfit.estimators.analytic.distillation import declare_teacher_and_student, distillation_loss
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.symbols import Sym
from memfit.techniques.sequence import window_starts


@dataclass(frozen=True)
class Windows:
    """What the step's forwards see of each sequence (each technique's `analytic_windows` changes one field, so
    the order they run in does not matter)."""

    sequence: int               # tokens of each sequence the step sees
    window: int | None = None   # run as windows of this many tokens ...
    stride: int | None = None   # ... one starting every `stride` tokens (default: `window`)
    views: bool = False         # the whole batch is held; the model sees views of it

    @property
    def chunked(self) -> bool:
        return self.window is not None and self.window < self.sequence

    @property
    def tokens(self) -> int:
        """Tokens per sequence in one forward."""
        return cast(int, self.window) if self.chunked else self.sequence   # chunked: a window is set

    @property
    def count(self) -> int:
        """Forwards (with backward) per step."""
        return (len(window_starts(self.sequence, cast(int, self.window), cast(int, self.stride or self.window)))
                if self.chunked else 1)   # chunked: a window is set

    @property
    def overlap(self) -> bool:
        """Later windows copy their labels to mask the overlap."""
        return self.chunked and cast(int, self.stride or self.window) < cast(int, self.window)   # chunked: window set


class Program:
    def __init__(self, engine: Engine, family, spec, teacher_spec, workload, num_layers: int, rank: int) -> None:
        self.engine, self.family, self.spec, self.teacher_spec = engine, family, spec, teacher_spec
        self.workload, self.num_layers, self.rank = workload, num_layers, rank
        self.declared = False
        self.teacher: dict | None = None     # a frozen teacher's parameters (declare_teacher)
        self.student_layers = num_layers

    # ---- the model -----------------------------------------------------------------------------
    def declare(self) -> None:
        """The model's parameters, as its family declares them."""
        self.family.declare_params(self.engine, self.spec, self.num_layers)
        self.declared = True

    def declare_teacher(self, student_layers: int, *, int8: bool = False) -> None:
        """The model as a frozen teacher (int8 codes with `int8`), and a student of `student_layers` blocks that
        trains on its soft targets (the loss below)."""
        self.teacher = declare_teacher_and_student(self.engine, self.family, self.teacher_spec, self.spec,
                                                   self.num_layers, student_layers, int8)
        self.student_layers, self.declared = student_layers, True

    def quantize_linears(self, fmt: WeightFormat) -> None:
        """Store the linears' weights in `fmt` (the ones it stores: core/weight_formats.py)."""
        weights.quantize_linears(self.engine, self.family, self.spec, fmt)

    def fake_quantize_linears(self) -> None:
        weights.fake_quantize_linears(self.engine, self.family)

    def add_adapters(self, rank: int, targets: tuple[str, ...]) -> None:
        weights.add_adapters(self.engine, self.family, rank, targets)

    def keep_stage(self, *, first: bool, last: bool) -> None:
        """One pipeline stage's part: the embeddings only on the first, the final norm and head on the last."""
        dropped = (() if first else ("embed",)) + (() if last else ("norm", "lm_head"))
        for name in dropped:
            self.engine.params.pop(name, None)

    # ---- the step ------------------------------------------------------------------------------
    def hold_gradient_buckets(self, copies: int) -> None:
        """`copies` flat buffers the size of every trainable gradient, held through the step."""
        e = self.engine
        trainable = sum(p.numel for p in e.params.values() if p.grad)
        e.keep += [e.new(trainable, e.policy.param_dtype, category="gradients") for _ in range(copies)]

    def hold_master_weights(self) -> None:
        """A master copy and a gradient per trainable parameter in the policy's master dtype, held through the
        step (steps/master_weights.py: all the masters, then all their gradients)."""
        e = self.engine
        trainable = [p for p in e.params.values() if p.grad]
        for category in ("optimizer_states", "gradients"):
            # the technique that holds master weights sets the policy's master dtype
            e.keep += [e.new(p.numel, cast(str, e.policy.master_dtype), category=category) for p in trainable]

    def loss(self, batch: int, tokens: int) -> Sym:
        """One forward to the loss (the student's, on the teacher's soft targets, when there is a teacher)."""
        if self.teacher is not None:
            return distillation_loss(self.engine, self.family, (self.teacher_spec, self.spec), self.teacher,
                                     (self.num_layers, self.student_layers), batch, tokens)
        return self.family.train(self.engine, self.spec, self.num_layers, batch, tokens)

    def pipeline_schedule(self, schedule: str, microbatches: int, stage: int, stages: int) -> None:
        """This rank's micro-batches in the schedule's order (techniques/pipeline.py): "gpipe" runs every forward,
        then every backward; "1f1b" runs min(M, S - stage) forwards, then alternates a backward and a forward,
        then the remaining backwards. Each micro-batch's tape and output (the last stage's: its logits) live
        until its backward; a stage that is not the last starts its backward from the gradient the next one
        sends."""
        e, w = self.engine, self.workload
        n, m, rank = stages, microbatches, stage
        first, last = rank == 0, rank == n - 1
        micro = w.batch_size // m
        if schedule == "gpipe":
            order = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        else:
            warmup = min(m, n - rank)
            order = [("F", i) for i in range(warmup)]
            for i in range(m):
                order.append(("B", i))
                if warmup + i < m:
                    order.append(("F", warmup + i))
        in_flight: dict[int, tuple[list, Sym, list]] = {}
        held: list[Sym]
        for kind, i in order:
            if kind == "F":
                e.set_phase("forward")
                e.tape, held = [], []
                out = self.family.train(e, self.spec, self.num_layers, micro, w.effective_seq_len, first=first,
                                        last=last, stage_outputs=held)
                e.cast_cache.clear()
                in_flight[i] = (e.tape, out, held)
            else:
                e.set_phase("backward", segment="post")
                e.tape, out, held = in_flight.pop(i)
                e.backward(out, None if last else e.new(out.numel, out.dtype))
            del out, held
        e.tape = []
