"""What the framework callbacks share: predict the trainer's step before it runs, measure its first steps, report.

The prediction is memfit's traced estimate of the trainer's own model, optimizer, precision and step (the
framework's order of forward, zero_grad, backward, clipping and optimizer step, written out in each integration),
made on a meta copy before the first step runs: it never reads the measurement. The measurement is the real peak
of each of the first `steps` optimizer steps (measurement/live_step.py). A failure to predict or measure is
reported, never raised: the callback must not stop a training run.
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.core.errors import MemfitError
from memfit.core.precision import autocast_precision, precision_of_model
from memfit.core.units import format_bytes
from memfit.measurement.live_step import StepPeakMeter, storage_bytes, training_tensors
from memfit.measurement.run import available_ram_bytes
from memfit.specs.hardware import gpu_of_device

# a note for a trainer running DistributedDataParallel: its step is predicted as one process's
UNDER_DDP = ("predicted as one process: DDP's gradient buckets (one more copy of the gradients) are not in the "
             "prediction")


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


class StepWatch:
    """The prediction and the measurements of one training run; `report` holds them (plain data)."""

    def __init__(self, framework: str, *, steps: int = 3, log: Callable[[str], None] | None = None) -> None:
        if not isinstance(steps, int) or steps < 1:
            raise MemfitError(f"steps={steps!r}: the callback measures the first N optimizer steps, N >= 1.")
        self.steps, self.log = steps, log or _to_stderr
        self.report: dict[str, Any] = {"framework": framework, "predicted_peak_bytes": None,
                                       "measured_peak_bytes": None, "measured_step_peaks": [], "notes": []}
        self.meter: StepPeakMeter | None = None
        self.predicted = self.finished = False

    @property
    def measuring(self) -> bool:
        return not self.finished and len(self.report["measured_step_peaks"]) < self.steps

    def predict(self, model: nn.Module, batch, *, optimizer, autocast_dtype: torch.dtype | None, step: Callable,
                notes: tuple[str, ...] = ()) -> None:
        """memfit's traced estimate of `step` on `model` and `batch`, before the first step (under the trainer's
        mixed precision, `autocast_dtype`, if any); warns when the step is predicted not to fit the device."""
        from memfit.estimators import estimate

        self.predicted = True
        device = device_of(model)
        gpu = gpu_of_device(str(device)) if device.type == "cuda" else None
        self.report["notes"] += list(notes)
        weights = precision_of_model(model)
        precision = autocast_precision(autocast_dtype).name if autocast_dtype is not None else None
        if precision is not None and weights.param_dtype != torch.float32:   # autocast over half weights: as they are
            self.report["notes"].append(f"the weights are {weights.name}: autocast computes in them as they are")
            precision = None
        self.report.update(device=str(device), precision=precision)
        if optimizer is None:
            self._failed("prediction_error", "the trainer has no optimizer: memfit predicts training steps with one")
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # the framework's own warnings, raised again in the fake run
                result = estimate(model, batch, optimizer=optimizer, step=step, precision=precision, gpu=gpu,
                                  method="traced")
        except Exception as exc:  # a callback never stops training: say what failed
            self._failed("prediction_error", exc)
            return
        self.report.update(predicted_peak_bytes=result.peak_bytes, predicted_phase=result.peak_phase,
                           predicted_reserved_bytes=result.reserved_bytes, method=result.method)
        # a CPU's free RAM excludes what the training already holds (its weights, states): add it back
        held = 0 if gpu is not None else storage_bytes(training_tensors(model, optimizer))
        free = available_ram_bytes()
        capacity = (gpu.memory_bytes, gpu.name) if gpu is not None else (
            None if free is None else free + held, "this machine's free RAM")
        if capacity[0] is not None:
            self.report["fits"] = result.peak_bytes <= capacity[0]
            if not self.report["fits"]:
                self.log(f"memfit: WARNING the training step is predicted to need {format_bytes(result.peak_bytes)}"
                         f", more than the {format_bytes(capacity[0])} of {capacity[1]}: expect an out-of-memory "
                         "error (`memfit plan` finds a configuration that fits)")

    def not_predicted(self, why: str) -> None:
        """No prediction for this run (the steps are still measured): `why` goes in the report."""
        self.predicted = True
        self._failed("prediction_error", why)

    def begin_step(self, model: nn.Module, optimizer, batch=None) -> None:
        if not self.measuring or (self.meter is not None and self.meter.running):
            return
        self.meter = self.meter or StepPeakMeter(device_of(model))
        try:
            self.meter.start(training_tensors(model, optimizer, batch))
        except Exception as exc:  # reported, never raised; and not tried again
            self._failed("measurement_error", exc)
            self.finish()

    def end_step(self) -> None:
        if self.meter is None or not self.meter.running:
            return
        peaks = self.report["measured_step_peaks"]
        try:
            peaks.append(self.meter.stop())
        except Exception as exc:  # reported, never raised
            self._failed("measurement_error", exc)
            self.finish()
            return
        self.report["measured_peak_bytes"] = max(peaks)
        if self.meter.reserved_bytes is not None:
            self.report["measured_reserved_bytes"] = max(self.report.get("measured_reserved_bytes") or 0,
                                                         self.meter.reserved_bytes)
        if len(peaks) == self.steps:
            self.finish()

    def finish(self) -> None:
        """Log the one line (once): the prediction beside what the first steps measured."""
        if self.finished:
            return
        self.finished = True
        if self.meter is not None and self.meter.running:   # training stopped inside a step
            try:
                self.meter.stop()
            except Exception as exc:  # reported, never raised
                self._failed("measurement_error", exc)
        predicted, measured = self.report["predicted_peak_bytes"], self.report["measured_peak_bytes"]
        if predicted and measured:
            self.report["measured/predicted"] = measured / predicted
        said = (f"predicted {format_bytes(predicted)} ({self.report.get('method')}, before step 1)" if predicted
                else f"not predicted ({self.report.get('prediction_error', 'no step ran')})")
        count = len(self.report["measured_step_peaks"])
        seen = (f"measured {format_bytes(measured)} over the first {count} step{'s' * (count > 1)}" if measured
                else f"not measured ({self.report.get('measurement_error', 'no step ran')})")
        ratio = f" (measured/predicted {self.report['measured/predicted']:.3f})" if predicted and measured else ""
        self.log(f"memfit: training step peak on {self.report.get('device', '?')}: {said}, {seen}{ratio}")

    def _failed(self, key: str, why: str | BaseException) -> None:
        """Report a failure in one line (memfit's own errors as they read, others with their type)."""
        if isinstance(why, BaseException) and not isinstance(why, MemfitError):
            why = f"{type(why).__name__}: {why}"
        self.report[key] = str(why).splitlines()[0] if str(why) else key
