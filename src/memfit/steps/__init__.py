"""The real training and inference steps memfit traces and measures: one code path for both.

Tracing runs these functions on fake tensors, measuring runs them on real ones; anything that
differs between the two runs is a bug in memfit, not a modelling choice.
"""
from memfit.steps.hooks import NullHooks, StepHooks
from memfit.steps.inference import run_inference
from memfit.steps.optim import make_optimizer
from memfit.steps.runner import run_workload
from memfit.steps.train import TrainLoop

__all__ = ["NullHooks", "StepHooks", "TrainLoop", "make_optimizer", "run_inference", "run_workload"]
