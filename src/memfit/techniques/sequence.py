"""Sequence-length techniques for causal language models: truncation, chunks of long inputs,
chunked cross-entropy.

  truncate:max_len=N      inputs cut to their first N tokens: activations shrink in proportion
                          (attention scores quadratically); the rest of each sequence is lost (lossy).
  sequence-chunks:window=W,stride=S
                          a long sequence runs as windows of W tokens starting every S tokens, each
                          its own forward and backward with gradients accumulated; the first W - S
                          labels of every later window are masked so each token is learned once.
                          Memory of a W-token step; no attention across windows (lossy).
  chunked-ce:chunks=K     the LM head and cross-entropy run over K slices of the sequence, each
                          under checkpoint, so no `batch x seq x vocab` logits outlive their slice:
                          1/K of them at a time, recomputed in backward (the head inside the chunk, as
                          Liger's fused loss keeps no logits either). Results equal up to summation
                          order (numerical).
  chunked-ce:mode=upcast  torchtune's CEWithChunkedOutputLoss: the model's head runs over the K slices
                          in its forward and every slice's half-precision logits are kept for backward;
                          only the float32 upcast and the cross-entropy run a slice at a time. Eager,
                          each slice's float32 log-probabilities are kept (together as large as the
                          whole float32 logits); with -t compile the slice's upcast + cross-entropy is
                          compiled, as torchtune compiles it, and keeps its half-precision input and
                          the log-sum-exp only.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from memfit.core.errors import MemfitError, require_choice, require_positive_int
from memfit.steps.setup import StepSetup
from memfit.techniques.base import Technique, register
from memfit.techniques.checkpointing import step_checkpoint
from memfit.techniques.contracts import CostCompute, PlanQuery

IGNORE_INDEX = -100
CHUNKED_CE_MODES = ("recompute", "upcast")


def _require_causal_lm(workload, name: str) -> None:
    if not workload.source.is_hf or workload.source.head != "causal-lm":
        raise MemfitError(f"-t {name} works on causal language models (token batches); "
                          f"{workload.source.name!r} is not one.")


def _token_tensors(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() == 2}


@register
@dataclass(frozen=True, kw_only=True)
class Truncate(Technique):
    name = "truncate"
    examples = (("truncate:max_len=64", {}),)
    risk = "lossy"
    stage = "sequence"
    traits = frozenset({"shapes-batch"})
    summary = "cut every sequence to its first max_len tokens"
    max_len: int = 512

    def __post_init__(self) -> None:
        require_positive_int(self.max_len, "-t truncate: max_len")

    def check(self, workload) -> None:
        _require_causal_lm(workload, self.name)

    def analytic_windows(self, windows, workload):
        return dataclasses.replace(windows, sequence=min(windows.sequence, self.max_len))

    def apply_(self, setup: StepSetup) -> None:
        setup.batch_transform = functools.partial(_truncate, max_len=self.max_len)


def _truncate(batch: dict, *, max_len: int) -> dict:
    return {**batch, **{k: v[:, :max_len] for k, v in _token_tensors(batch).items()}}


@register
@dataclass(frozen=True, kw_only=True)
class SequenceChunks(Technique):
    name = "sequence-chunks"
    examples = (("sequence-chunks:window=64", {}),)
    risk = "lossy"
    stage = "sequence"
    traits = frozenset({"shapes-batch"})
    summary = "run a long sequence as windows of `window` tokens every `stride`, gradients accumulated"
    conflicts_with = {"own-backward": ("{other}'s schedule splits each batch into micro-batches itself",
                                       "drop sequence-chunks")}
    deepspeed_conflict = ("runs one micro-batch per step here", "drop sequence-chunks")
    window: int = 512
    stride: int | None = None       # default: window (no overlap)

    def __post_init__(self) -> None:
        require_positive_int(self.window, "-t sequence-chunks: window")
        if self.stride is not None:
            require_positive_int(self.stride, "-t sequence-chunks: stride")
            if self.stride > self.window:
                raise MemfitError(f"-t sequence-chunks: stride {self.stride} is larger than window {self.window}; "
                                  "tokens between windows would never be seen.")

    def check(self, workload) -> None:
        _require_causal_lm(workload, self.name)
        if workload.task != "train":
            raise MemfitError("-t sequence-chunks splits a training step; for inference use --seq-len.")

    def analytic_windows(self, windows, workload):
        return dataclasses.replace(windows, window=self.window, stride=self.stride)

    def apply_(self, setup: StepSetup) -> None:
        setup.micro_batches = functools.partial(sequence_windows, window=self.window,
                                                stride=self.stride or self.window)


def window_starts(seq_len: int, window: int, stride: int) -> list[int]:
    starts = list(range(0, max(seq_len - window, 0) + 1, stride))
    if starts[-1] + window < seq_len:
        starts.append(seq_len - window)
    return starts


def sequence_windows(batch: dict, *, window: int, stride: int) -> list[dict]:
    tokens = _token_tensors(batch)
    seq_len = batch["input_ids"].shape[1]
    chunks, covered = [], 0
    for start in window_starts(seq_len, window, stride):
        chunk = {**batch, **{k: v[:, start:start + window] for k, v in tokens.items()}}
        if "labels" in chunk and covered > start:
            labels = chunk["labels"].clone()
            labels[:, :covered - start] = IGNORE_INDEX      # already learned in an earlier window
            chunk["labels"] = labels
        covered = start + window
        chunks.append(chunk)
    return chunks


@register
@dataclass(frozen=True, kw_only=True)
class ChunkedCrossEntropy(Technique):
    name = "chunked-ce"
    examples = (("chunked-ce", {}), ("chunked-ce:mode=upcast", {}))
    risk = "numerical"
    stage = "loss"
    summary = ("LM head + cross-entropy over sequence slices under checkpoint: full logits never exist "
               "(mode=upcast: torchtune's, every slice's logits kept)")
    time_factor = 1.02
    traits = frozenset({"replaces-loss"})
    oom_fixes = ("chunked-ce",)
    search_axis = "loss"
    conflicts_with = {
        "wraps-forward": ("chunked-ce calls the base model and its LM head directly, past {other}'s own forward",
                          "drop chunked-ce"),
    }
    deepspeed_conflict = ("runs its forward around the model; chunked-ce would call the model past it",
                          "drop chunked-ce")
    chunks: int = 8
    mode: str = "recompute"

    def __post_init__(self) -> None:
        require_positive_int(self.chunks, "-t chunked-ce: chunks")
        require_choice(self.mode, CHUNKED_CE_MODES, "-t chunked-ce: mode")

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [cls.name] if request.task == "train" else []

    def analytic_policy(self, workload) -> dict:
        return {"loss_chunks": self.chunks, "loss_logits_kept": self.mode == "upcast"}

    def cost_compute(self, compute: CostCompute) -> None:   # the LM head runs again in backward (it is checkpointed)
        if self.mode == "recompute":
            compute.recompute += 2 * compute.shape.hidden * compute.shape.vocab * compute.tokens

    def check(self, workload) -> None:
        _require_causal_lm(workload, self.name)
        if workload.task != "train":
            raise MemfitError("-t chunked-ce changes the training loss; inference keeps only the last logits already.")

    def apply_(self, setup: StepSetup) -> None:
        if self.mode == "upcast":
            setup.loss = functools.partial(upcast_chunked_lm_loss, chunks=self.chunks, setup=setup)
        else:
            setup.loss = functools.partial(chunked_causal_lm_loss, chunks=self.chunks,
                                           checkpoint=step_checkpoint(setup))


def chunked_causal_lm_loss(model: torch.nn.Module, batch: dict, *, chunks: int, checkpoint) -> torch.Tensor:
    """Hugging Face's causal-LM loss (labels shifted left, -100 ignored, mean over the counted tokens),
    computed slice by slice from the base model's last hidden state; `checkpoint` is the step's
    (checkpointing.step_checkpoint)."""
    hidden, head, cap, targets = _loss_inputs(model, batch)
    total = None
    for h, y in zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)):
        part = checkpoint(_slice_loss, h, y, head, cap)
        total = part if total is None else total + part
    return total / (targets != IGNORE_INDEX).sum()


def upcast_chunked_lm_loss(model: torch.nn.Module, batch: dict, *, chunks: int, setup: StepSetup) -> torch.Tensor:
    """The same loss as torchtune's model and CEWithChunkedOutputLoss compute it: the head over every slice of the
    last hidden state first (the model's chunked output, kept), then each slice's float32 cross-entropy, compiled
    with -t compile (setup.compile_fn) as torchtune compiles its `compute_cross_entropy`."""
    hidden, head, cap, targets = _loss_inputs(model, batch)
    logits = [head(h) for h in hidden.chunk(chunks, dim=1)]
    cross_entropy = setup.compile_fn(_upcast_cross_entropy) if setup.compile_fn else _upcast_cross_entropy
    total = None
    for z, y in zip(logits, targets.chunk(chunks, dim=1)):
        part = cross_entropy(z, y, cap)
        total = part if total is None else total + part
    return total / (targets != IGNORE_INDEX).sum()


def _loss_inputs(model: Any, batch: dict):   # a Hugging Face causal LM, or peft's wrapper of one
    """The base model's last hidden state, the LM head, its logit soft-cap and the shifted targets."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model = model.get_base_model() if hasattr(model, "get_base_model") else model   # under peft's wrapper
    hidden = model.base_model(**inputs).last_hidden_state
    cap = getattr(model.config, "final_logit_softcapping", None)
    targets = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[..., 1:]
    return hidden, model.get_output_embeddings(), cap, targets


def _slice_loss(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, cap: float | None) -> torch.Tensor:
    return _upcast_cross_entropy(head(hidden), targets, cap)


def _upcast_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, cap: float | None) -> torch.Tensor:
    logits = logits.float()
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
