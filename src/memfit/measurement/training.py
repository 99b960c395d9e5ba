"""Real training steps on real text: what a technique does to results and to step time.

The bundled corpus (memfit/data/tinyshakespeare.txt) is read as bytes, one token per byte; the first
90 % is training text and the last 10 % held out. `train_run` builds the workload's model from one
seed, applies the workload's techniques with the same code `measure` uses, and trains on the same
batches, so two runs differ only by their techniques.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import resources

import torch

from memfit.core.precision import get_precision
from memfit.specs.workload import Workload
from memfit.steps.hooks import StepHooks
from memfit.steps.runner import train_loop
from memfit.steps.setup import model_loss
from memfit.techniques.compose import prepare_step
from memfit.techniques.resolve import resolve

HELD_OUT_FRACTION = 0.1


def corpus_bytes() -> bytes:
    return resources.files("memfit.data").joinpath("tinyshakespeare.txt").read_bytes()


def text_batches(*, batch_size: int, seq_len: int, num_batches: int, split: str = "train",
                 seed: int = 0) -> list[dict]:
    """Random windows of the corpus as causal-LM batches (`input_ids` = `labels`, byte tokens)."""
    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    cut = int(len(data) * (1 - HELD_OUT_FRACTION))
    data = data[:cut] if split == "train" else data[cut:]
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_batches):
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        ids = torch.stack([data[s:s + seq_len] for s in starts.tolist()])
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


@dataclass
class TrainRun:
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    eval_loss: float | None = None
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def median_step_seconds(self) -> float:
        ordered = sorted(self.step_seconds)
        return ordered[len(ordered) // 2]


def train_run(workload: Workload, batches: list[dict], *, seed: int = 0, lr: float | None = None,
              eval_batches: list[dict] | None = None, keep_parameters: bool = False,
              start_from: dict[str, torch.Tensor] | None = None, hooks: StepHooks | None = None) -> TrainRun:
    """Train the workload's model (built on CPU from `seed`, or loaded with the weights `start_from`) on
    `batches`, one step each; `hooks` hear each step's phases."""
    workload = resolve(workload)
    if workload.task != "train":
        raise ValueError("train_run needs a training workload")
    torch.manual_seed(seed)
    precision = get_precision(workload.precision)
    model = workload.source.build(device="cpu", dtype=precision.param_dtype)
    if start_from is not None:
        model.load_state_dict(start_from)
    model.train()
    setup = prepare_step(model, workload, device_type="cpu")
    setup.lr = lr
    loop = train_loop(setup, workload, hooks=hooks)
    run = TrainRun()
    for batch in batches:
        started = time.perf_counter()
        loss = loop.step(batch)
        run.step_seconds.append(time.perf_counter() - started)
        run.losses.append(float(loss))
    run.skipped_steps = loop.skipped_steps
    if eval_batches:
        run.eval_loss = evaluate(setup.model, setup, eval_batches)   # what trained (a LoRA wrapper, a student)
    if keep_parameters:
        run.parameters = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    return run


@torch.no_grad()
def evaluate(model: torch.nn.Module, setup, batches: list[dict]) -> float:
    """Mean causal-LM loss over `batches` (perplexity = exp of it), with the model's own loss."""
    model.eval()
    losses = []
    for batch in batches:
        with setup.autocast():
            losses.append(float(model_loss(model, batch)))
    model.train()
    return sum(losses) / len(losses)
