"""One configuration of the planner oracle timed on this CPU (benchmarks/planner_oracle.py): the step an accumulating
loop runs, its peak, and the hooks that stop a warm-up already too slow to be the fastest."""
from __future__ import annotations

import ctypes
import gc
import platform
import time
from statistics import median_high as median

import torch

from memfit.measurement import measure
from memfit.measurement.training import train_run
from memfit.specs.workload import Workload


class TooSlow(Exception):
    """A configuration already ran past what the fastest feasible step so far allows: in its warm-up (`seconds`
    None), or in its first timed step (`seconds`: that step's time for the whole batch)."""

    def __init__(self, seconds: float | None = None) -> None:
        super().__init__()
        self.seconds = seconds


class PhaseClock:
    """Step hooks that note when each step's optimizer phase starts: the step before it is its forward and backward.
    Given a limit, the first step (the warm-up) is stopped (TooSlow) once its forward and backward, times the
    accumulation steps, or the whole of it (one micro-batch and an optimizer step) run past the limit: watched as
    every module returns (a global forward hook) and as backward reaches each module's output (a hook on it) until
    its optimizer phase. Given `one_step_limit_s`, the first timed step is the last when the whole batch's step it
    gives is over that."""

    def __init__(self, limit_s: float | None = None, accum: int = 1, one_step_limit_s: float | None = None) -> None:
        self.step_started: list[float] = []
        self.optimizer_started: list[float] = []
        self.limit_s, self.accum, self.one_step_limit_s = limit_s, accum, one_step_limit_s
        self.watch = None
        self.gradient_hooks: list = []

    def phase(self, name: str) -> None:
        now = time.perf_counter()
        if self.limit_s is not None and len(self.step_started) == 1 and now - self.step_started[0] > self.limit_s:
            raise TooSlow   # the warm-up's micro-batch and optimizer step alone passed the limit
        if name == "forward" and len(self.step_started) == len(self.optimizer_started):   # a step's first forward
            if self.one_step_limit_s is not None and len(self.step_started) == 2:   # the first timed step is done
                first = (self.accum * (self.optimizer_started[1] - self.step_started[1])
                         + now - self.optimizer_started[1])
                if first > self.one_step_limit_s:
                    raise TooSlow(first)
            self.step_started.append(now)
            if self.limit_s is not None and len(self.step_started) == 1:
                self.watch = torch.nn.modules.module.register_module_forward_hook(self._module_called)
        elif name == "optimizer":
            self.stop_watching()
            self.optimizer_started.append(now)

    def _module_called(self, module, args, output) -> None:
        self._pass_within_limit()
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(first, torch.Tensor) and first.requires_grad:   # heard again when backward reaches it
            self.gradient_hooks.append(first.register_hook(self._gradient))

    def _gradient(self, grad) -> None:
        self._pass_within_limit()

    def _pass_within_limit(self) -> None:
        if (time.perf_counter() - self.step_started[0]) * self.accum > self.limit_s:
            raise TooSlow

    def stop_watching(self) -> None:
        if self.watch is not None:
            self.watch.remove()
            self.watch = None
        for handle in self.gradient_hooks:
            handle.remove()
        self.gradient_hooks = []

    def mark(self, category: str, tensors) -> None:
        pass


def step_seconds(workload: Workload, batches: list[dict], accum: int, limit_s: float | None = None,
                 one_step_limit_s: float | None = None) -> float:
    """Seconds of one optimizer step over `accum` micro-batches: the median forward and backward of a micro-batch
    `accum` times, and the median optimizer step once — as a loop that accumulates gradients runs (each timed step
    here runs one micro-batch and its own optimizer step; the steps after a warm-up one count). Given `limit_s`, a
    configuration whose warm-up step (one micro-batch and an optimizer step), or its forward and backward `accum`
    times, passes it is stopped there (TooSlow), and one whose first timed step passes `one_step_limit_s` after it."""
    clock = PhaseClock(limit_s, accum, one_step_limit_s)
    try:
        run = train_run(workload, batches, hooks=clock)
    finally:
        clock.stop_watching()
        release_freed_memory()
    passes = [o - s for s, o in zip(clock.step_started, clock.optimizer_started)][1:]
    optimizer = [step - p for step, p in zip(run.step_seconds[1:], passes)]
    return accum * median(passes) + median(optimizer)


def peak_bytes(workload: Workload) -> int:
    """The peak of one real step (memfit measure: the CPU allocator's own account)."""
    peak = measure(workload, device="cpu", estimates=()).peak_bytes
    release_freed_memory()
    return peak


def release_freed_memory() -> None:
    """Hundreds of runs in one process: collect, and give freed heap back to the system (glibc keeps it)."""
    gc.collect()
    if platform.system() == "Linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
