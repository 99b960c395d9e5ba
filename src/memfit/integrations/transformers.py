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

import weakref
from collections.abc import Callable

import torch

from memfit.core.errors import MemfitError
from memfit.integrations.watch import UNDER_DDP, StepWatch

try:
    from transformers import TrainerCallback
except ImportError as exc:  # transformers is one of memfit's own requirements; this is a broken install
    raise ImportError("memfit.integrations.transformers needs transformers (pip install transformers)") from exc


def trainer_autocast_dtype(args) -> torch.dtype | None:
    """The dtype TrainingArguments' bf16/fp16 autocast to (None: no mixed precision)."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


def loss_of(outputs) -> torch.Tensor:
    """The loss a model returns: `outputs["loss"]` (a ModelOutput or dict), else its first output if a scalar."""
    if isinstance(outputs, dict):
        loss = outputs.get("loss")
    else:
        loss = outputs if isinstance(outputs, torch.Tensor) else outputs[0]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise MemfitError("the model returned no loss: the Trainer computes it outside the model here (label "
                          "smoothing, compute_loss_func or a compute_loss of your own), which memfit does not "
                          "predict")
    return loss


class _FirstForward:
    """The forward pre-hook on the user's model. It holds the callback weakly, and a copy of the model (memfit's
    meta copy, an EMA copy, a pickle) gets a hook that does nothing: the callback and the live optimizer it holds
    are never copied with the model."""

    def __init__(self, callback: MemfitCallback) -> None:
        self.callback = weakref.ref(callback)

    def __call__(self, module, args, kwargs):
        callback = self.callback()
        return callback._before_forward(module, args, kwargs) if callback is not None else None

    def __deepcopy__(self, memo):
        return _no_hook

    def __reduce__(self):
        return _no_hook_factory, ()


def _no_hook(module, args, kwargs):
    return None


def _no_hook_factory():
    return _no_hook


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
        self._optimizer = self._args = None

    @property
    def report(self) -> dict:
        return self.watch.report

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.watch.meter is not None and self.watch.meter.running:   # a run before this one stopped mid-step
            self.watch.finish()
        self._remove_hook()
        self._args = args
        self._optimizer = getattr(optimizer, "optimizer", optimizer)   # accelerate's AcceleratedOptimizer wraps it
        if model is not None and self.watch.measuring:
            self._hook = model.register_forward_pre_hook(_FirstForward(self), with_kwargs=True)

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
        sharded = "DeepSpeed" if self._args.deepspeed else "FSDP" if self._args.fsdp else None
        if sharded and not self.watch.predicted:
            self.watch.not_predicted(f"the Trainer runs {sharded}: memfit predicts a single process's step here "
                                     "(estimate the sharded run with `memfit estimate --world-size N`)")
        if not self.watch.predicted:
            notes = ()
            if self._args.world_size > 1:
                notes += (UNDER_DDP,)
            if args and kwargs:
                notes += ("the model was called with positional and keyword arguments: predicted with the keywords",)
            self.watch.predict(module, batch, optimizer=self._optimizer,
                               autocast_dtype=trainer_autocast_dtype(self._args),
                               step=trainer_step(self._args.gradient_accumulation_steps, self._args.max_grad_norm),
                               notes=notes)
        self.watch.begin_step(module, self._optimizer, batch)

    def _remove_hook(self) -> None:
        self._step_open = False
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
