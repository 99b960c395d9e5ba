"""`MemfitCallback` for Lightning (`lightning.pytorch` or `pytorch_lightning`, 2.x; `pip install memfit[lightning]`):
the training step's peak predicted before the first batch, measured over the first steps, side by side.

    trainer = L.Trainer(max_steps=100, callbacks=[MemfitCallback()])
    trainer.fit(module, loader)   # logs: memfit: training step peak on cpu: predicted ..., measured ... (ratio)

The prediction runs the module's own `training_step` in Lightning's automatic-optimization order (Lightning 2.6
`_AutomaticOptimization`: the step's forward, then `zero_grad` on the first batch of an accumulation window, then
backward of loss / accumulate_grad_batches, clipping and the optimizer step on its last), with the trainer's
optimizer and precision (`bf16-mixed`, `16-mixed`; `*-true` precisions are the weights' own dtype). Manual
optimization runs its own backward through the trainer and is not predicted (the report says so).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.integrations.watch import UNDER_DDP, StepWatch

# Lightning's mixed precisions -> the dtype they autocast to (the others: the dtype the weights already have)
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _callback_bases() -> tuple[type, ...]:
    """Lightning's Callback class of every Lightning package installed: the callback is an instance of each, so
    either package's Trainer accepts it."""
    bases = []
    for module in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(__import__(module, fromlist=["Callback"]).Callback)
        except ImportError:
            continue
    if not bases:
        raise ImportError("memfit.integrations.lightning needs Lightning: pip install 'memfit[lightning]' "
                          "(pytorch-lightning) or lightning")
    return tuple(bases)


def lightning_step(accumulation: int, clip_value: float | None, clip_algorithm: str | None) -> Callable:
    """One optimizer step of Lightning's automatic optimization as fn(model, batch, optimizer); the precision's
    region covers `training_step` only (Lightning's `train_step_context`)."""
    def step(model, batch, optimizer, autocast):
        for index in range(accumulation):
            with autocast():
                output = model.training_step(batch, index)
            loss = output["loss"] if isinstance(output, dict) else output
            if index == 0:
                optimizer.zero_grad()
            (loss / accumulation).backward()
            del output, loss
        if clip_value:
            if clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_value)
        optimizer.step()
    return step


class MemfitCallback(*_callback_bases()):  # type: ignore[misc]  # bases: the Lightning packages installed
    """Predicts the step's peak at the first training batch, before it runs, and measures the first `steps`
    optimizer steps (each batch of an accumulation window counts in its step). `log`: where the line goes."""

    def __init__(self, *, steps: int = 3, log: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.watch = StepWatch("lightning", steps=steps, log=log)

    @property
    def report(self) -> dict:
        return self.watch.report

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        if not self.watch.predicted:
            self._predict(trainer, pl_module, batch, optimizer)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.watch.begin_step(pl_module, optimizer, batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # the optimizer steps at the end of each accumulation window, and on an epoch's last batch
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or trainer.is_last_batch:
            self.watch.end_step()

    def on_train_end(self, trainer, pl_module):
        self.watch.finish()

    def on_exception(self, trainer, pl_module, exception):
        self.watch.finish()   # the profiler a CPU measurement runs must not outlive the run

    def _predict(self, trainer, pl_module, batch, optimizer) -> None:
        if not pl_module.automatic_optimization:
            self.watch.not_predicted("manual optimization runs its own backward through the Trainer; memfit "
                                     "predicts automatic optimization only")
            return
        strategy = type(trainer.strategy).__name__
        if strategy not in ("SingleDeviceStrategy", "DDPStrategy"):
            self.watch.not_predicted(f"{strategy} shards or splits the model: memfit predicts a single process's "
                                     "step here (estimate the sharded run with `memfit estimate`)")
            return
        notes = []
        if strategy == "DDPStrategy":
            notes.append(UNDER_DDP)
        if len(trainer.optimizers) > 1:
            notes.append(f"{len(trainer.optimizers)} optimizers: predicted with the first")
        step = lightning_step(trainer.accumulate_grad_batches, trainer.gradient_clip_val,
                              trainer.gradient_clip_algorithm)
        self.watch.predict(pl_module, batch, optimizer=optimizer, step=step, notes=tuple(notes),
                           autocast_dtype=AUTOCAST_DTYPES.get(str(trainer.precision)))
