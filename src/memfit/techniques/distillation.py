"""Knowledge distillation: the workload's model becomes the frozen teacher of a smaller student.

  distill[:layers=N,temperature=2.0,alpha=0.5,teacher=full|int8]
          The student is the teacher's architecture with N of its blocks (default half), initialised from
          evenly spaced teacher blocks and the teacher's embeddings, norm and head (DistilBERT's recipe); it
          trains on alpha x T^2 x KL(teacher || student) over softened distributions (temperature T) plus
          (1 - alpha) x the cross-entropy with the labels. The teacher stays in memory frozen and runs
          without gradients; per step its logits and their log-softmax exist beside the student's.
          With -t prune-structured the student is also narrower: pruning applies after distill (canonical
          order), to the student, keeping the teacher's strongest head groups and channels.
          Memory: the teacher's weights and logits added to a smaller model's training step. teacher=int8
          keeps the teacher's linears as int8 codes (torchao weight-only, after the student has copied
          them): a quarter of its linear weights, at the cost of slightly different soft targets.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from memfit.core.errors import MemfitError, require_positive_int
from memfit.core.precision import get_precision, precision_names
from memfit.steps.setup import StepSetup
from memfit.techniques.base import Technique, register
from memfit.techniques.contracts import AnalyticProgram
from memfit.techniques.quantization import Int8WeightOnly

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@register
@dataclass(frozen=True, kw_only=True)
class Distill(Technique):
    name = "distill"
    examples = (("distill", {}),)
    risk = "lossy"          # another, smaller model is trained
    stage = "student"
    summary = "knowledge distillation: a student with fewer blocks trains on the frozen teacher's soft targets"
    time_factor = 0.8       # a smaller student's step plus the teacher's forward (assumed)
    traits = frozenset({"replaces-loss"})
    conflicts_with = {
        "layout": ("the teacher would stay outside the data-parallel, sharded or pipelined student", "drop -t {other}"),
        "replaces-loss": ("distillation needs the student's whole logits for the soft targets", "drop -t {other}"),
        "adapters": ("the student trains whole; adapters on a distilled student are not built here",
                     "drop -t {other}"),
    }
    deepspeed_conflict = ("wraps one model; the teacher would stay outside it", "use --engine pytorch")
    layers: int | None = None       # the student's blocks; default half the teacher's
    temperature: float = 2.0
    alpha: float = 0.5
    teacher: str = "full"

    def __post_init__(self) -> None:
        if self.layers is not None:
            require_positive_int(self.layers, "-t distill: layers")
        if not self.temperature > 0:
            raise MemfitError(f"-t distill: temperature must be positive, got {self.temperature}.")
        if not 0 <= self.alpha <= 1:
            raise MemfitError(f"-t distill: alpha must be between 0 and 1, got {self.alpha}.")
        if self.teacher not in ("full", "int8"):
            raise MemfitError(f"-t distill: teacher must be full or int8, not {self.teacher!r}.")

    depth_linear = False   # the student's depth is half the model's, rounded down

    def analytic_model(self, program: AnalyticProgram) -> None:
        program.declare_teacher(self.student_layers(program.num_layers), int8=self.teacher == "int8")

    def student_layers(self, teacher_layers: int) -> int:
        return self.layers if self.layers is not None else max(1, teacher_layers // 2)

    def check(self, workload) -> None:
        if workload.task != "train":
            raise MemfitError("-t distill trains a student; for inference, estimate the student itself.")
        if not workload.source.is_hf or workload.source.head != "causal-lm":
            raise MemfitError("-t distill works on Hugging Face causal language models (the teacher's logits).")
        teacher = workload.source.config().num_hidden_layers
        if self.student_layers(teacher) >= teacher:
            raise MemfitError(f"-t distill: the student needs fewer blocks than the teacher's {teacher}; "
                              f"got layers={self.layers}.")
        if self.teacher == "int8" and get_precision(workload.precision).autocast_dtype is not None:
            raise MemfitError("-t distill:teacher=int8 computes in the weights' own dtype; use --precision "
                              f"{precision_names(autocast=False)}.")

    def apply_(self, setup: StepSetup) -> None:
        teacher = setup.model
        blocks = _blocks(teacher)
        keep = self.student_layers(len(blocks))
        if keep >= len(blocks):
            raise MemfitError(f"-t distill: the student needs fewer blocks than the teacher's {len(blocks)}.")
        student = _student(cast("PreTrainedModel", teacher), keep)   # check(): a Hugging Face causal LM
        for p in teacher.parameters():
            p.requires_grad_(False)
        if self.teacher == "int8":   # after the student copied the full-precision weights
            Int8WeightOnly().apply_(StepSetup(model=teacher, precision=setup.precision, device_type=setup.device_type))
        setup.model = student
        setup.loss = DistillationLoss(teacher, self.temperature, self.alpha)


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise MemfitError("-t distill: the teacher has no model.layers block list (Llama-style decoders).")
    return layers


def _student(teacher: PreTrainedModel, keep: int) -> torch.nn.Module:
    """The teacher's architecture with `keep` blocks, built from its config, holding copies of evenly spaced
    teacher blocks (first and last included when keep > 1) and of its other weights."""
    n = len(_blocks(teacher))
    chosen = [round(i * (n - 1) / (keep - 1)) for i in range(keep)] if keep > 1 else [n - 1]
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = keep
    if getattr(config, "layer_types", None):
        config.layer_types = [teacher.config.layer_types[i] for i in chosen]
    weights, default = next(teacher.parameters()), torch.get_default_dtype()
    torch.set_default_dtype(weights.dtype)    # built in the teacher's dtype (a fake tensor cannot change it)
    try:
        with torch.device(weights.device):
            student = type(teacher)(config)
    finally:
        torch.set_default_dtype(default)
    prefix = "model.layers."
    source = {}
    for name, tensor in teacher.state_dict().items():
        if name.startswith(prefix):
            index, rest = name[len(prefix):].split(".", 1)
            if int(index) not in chosen:
                continue
            name = f"{prefix}{chosen.index(int(index))}.{rest}"
        source[name] = tensor
    student.load_state_dict(source)
    return student


class DistillationLoss:
    """alpha T^2 KL(teacher || student) at temperature T plus (1 - alpha) cross-entropy with the labels,
    averaged over tokens; the teacher runs in eval mode without gradients."""

    def __init__(self, teacher: torch.nn.Module, temperature: float, alpha: float) -> None:
        self.teacher, self.temperature, self.alpha = teacher, temperature, alpha

    def __call__(self, student: torch.nn.Module, batch: dict) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        self.teacher.eval()
        with torch.no_grad():
            logits = self.teacher(**inputs, use_cache=False).logits   # no KV cache: one forward
            soft_targets = F.log_softmax(logits.float() / self.temperature, dim=-1)
            del logits
        out = student(**batch)
        vocab = soft_targets.shape[-1]
        kl = F.kl_div(F.log_softmax(out.logits.float() / self.temperature, dim=-1).view(-1, vocab),
                      soft_targets.view(-1, vocab), log_target=True, reduction="batchmean")
        return self.alpha * self.temperature ** 2 * kl + (1 - self.alpha) * out.loss
