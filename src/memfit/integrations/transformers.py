"""`MemfitCallback` for the Hugging Face Trainer: the step's peak predicted before it runs, measured over the first
steps, side by side.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[MemfitCallback()])
    trainer.train()            # logs: memfit: training step peak on cpu: predicted ..., measured ... (ratio)
    callback.report            # predicted_peak_bytes, measured_peak_bytes, measured_step_peaks, ...

The prediction uses what the Trainer really runs: its model (gradient checkpointing as the Trainer enabled it, and
accelerate's precision wrapper), its optimizer (the Trainer's default is fused AdamW), `bf16`/`fp16`, the
micro-batch the Trainer feeds the model (caught at the first forward, before anything of the step has run), its
gradient accumulation and clipping, in the Trainer's order (transformers 5.24 `Trainer._inner_training_loop`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.core.precision import autocast_precision
from memfit.integrations.watch import StepWatch

try:
    from transformers import TrainerCallback
except ImportError as exc:  # transformers is one of memfit's own requirements; this is a broken install
    raise ImportError("memfit.integrations.transformers needs transformers (pip install transformers)") from exc


def trainer_precision(args) -> str | None:
    """memfit's precision for TrainingArguments' bf16/fp16 (autocast; None: the weights' own dtype)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    return autocast_precision(dtype).name if dtype is not None else None


def loss_of(outputs) -> torch.Tensor:
    """The loss a model returns: `outputs["loss"]` (a ModelOutput or dict), else the first output."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict) and outputs.get("loss") is not None:
        return outputs["loss"]
    return outputs[0]


def trainer_step(accumulation: int, max_grad_norm: float | None) -> Callable:
    """The Trainer's optimizer step as fn(model, batch, optimizer): `accumulation` forwards and backwards (outputs
    dropped before backward, as `compute_loss` does), clipping, the step, then `model.zero_grad()`. The precision's
    region covers the forward only, as accelerate's wrapper of `model.forward` does."""
    def step(model, batch, optimizer, autocast):
        for _ in range(accumulation):
            with autocast():
                loss = loss_of(model(**batch) if isinstance(batch, dict) else model(*batch)) / accumulation
            loss.backward()
            del loss
        if max_grad_norm and max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        model.zero_grad()
    return step


class MemfitCallback(TrainerCallback):
    """Predicts the Trainer's step peak before the first step and measures the first `steps` optimizer steps
    (CUDA: allocator statistics; CPU: the profiler's allocator events). `log`: where the line goes (stderr)."""

    def __init__(self, *, steps: int = 3, log: Callable[[str], None] | None = None) -> None:
        self.watch = StepWatch("transformers.Trainer", steps=steps, log=log)
        self._hook = None
        self._step_open = False
        self._model = self._optimizer = self._args = None

    @property
    def report(self) -> dict:
        return self.watch.report

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._args, self._model = args, model
        self._optimizer = getattr(optimizer, "optimizer", optimizer)   # accelerate's AcceleratedOptimizer wraps it
        if model is not None and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_open = True   # the next forward is the step's first: measure from there

    def on_step_end(self, args, state, control, **kwargs):
        self.watch.end_step()
        if not self.watch.measuring:
            self._remove_hook()

    def on_train_end(self, args, state, control, **kwargs):
        self.watch.finish()
        self._remove_hook()

    def _before_forward(self, module, args, kwargs):
        if not self._step_open or not module.training:
            return
        self._step_open = False
        batch = kwargs if kwargs else args
        if not self.watch.predicted:
            notes = ()
            if args and kwargs:
                notes = ("the model was called with positional and keyword arguments: predicted with the keywords",)
            self.watch.predict(module, batch, optimizer=self._optimizer, precision=trainer_precision(self._args),
                               step=trainer_step(self._args.gradient_accumulation_steps, self._args.max_grad_norm),
                               notes=notes)
        self.watch.begin_step(module, self._optimizer, batch)

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
