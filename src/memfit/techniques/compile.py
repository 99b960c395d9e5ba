"""torch.compile of each repeated block, as torchtitan and torchtune compile their layers.

  compile   every repeated block's forward compiled with torch.compile (Inductor). AOTAutograd partitions
            each block's joint forward-backward graph with its min-cut rematerialisation: backward keeps the
            cheapest set of tensors to recompute pointwise work from (matmul and attention outputs, not the
            upcasts, norms and activations between them), and Inductor fuses chains of pointwise ops and
            reductions into kernels whose intermediates never reach memory. The loss, the embeddings and the
            head stay eager, but for chunked-ce:mode=upcast's per-slice cross-entropy, which torchtune
            compiles too. Same results up to rounding (numerical).
  compile:mode=reduce-overhead
            the same, its kernels replayed as CUDA graphs (torch.compile's mode): the host launches a step's
            kernels at once instead of one by one, which is what makes small-batch decoding fast (gpt-fast and
            torchao's generate run so). Capturing them (in the warm-up) calls torch.cuda.empty_cache() first
            (torch.cuda.graph's __enter__): the measured step starts from a trimmed cache, which the simulated
            allocator replays. A CPU has no CUDA graphs: it runs the default mode there. The graphs' private
            memory pool is not modelled (a decode step's few activations).

Measured: `memfit measure` runs Inductor for real (its C++ backend on a CPU). Traced (label: modelled): the same
blocks are compiled under fake tensors with Inductor's decompositions, joint-graph passes and partitioner, so the
tensors saved for backward are Inductor's; the graphs then run op by op, and what a fused kernel would keep in
registers — the output of a pointwise op or reduction whose every consumer is one too — is not counted
(estimators/stand_ins.py, steps/fusion.py). Inductor's buffer reuse inside a graph is not modelled. The analytic
estimator has no model of the compiled graphs and refuses it.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass, replace

import torch

from memfit.core.errors import MemfitError, require_choice
from memfit.steps.setup import StepSetup
from memfit.steps.stand_ins import stand_in
from memfit.techniques.base import Technique, register
from memfit.techniques.blocks import repeated_blocks
from memfit.techniques.contracts import CostCompute

MODES = ("default", "reduce-overhead")


@register
@dataclass(frozen=True, kw_only=True)
class Compile(Technique):
    name = "compile"
    examples = (("compile", {}),)
    risk = "numerical"
    stage = "compile"
    summary = "torch.compile each block: min-cut rematerialisation and fused pointwise kernels save less"
    traits = frozenset({"traced-only"})
    mode: str = "default"

    def __post_init__(self) -> None:
        require_choice(self.mode, MODES, "-t compile: mode")

    def estimate_notes(self, workload) -> list[str]:
        return ["torch.compile modelled: Inductor's partitioner run under fake tensors, fused pointwise intermediates "
                "not counted, Inductor's buffer reuse not modelled"]

    def allocator_settings(self, settings):
        return replace(settings, empty_cache_before_step=True) if self.mode == "reduce-overhead" else settings

    def cost_compute(self, compute: CostCompute) -> None:
        # fused pointwise kernels: the kernel profile's fused figures
        compute.fused = True
        compute.graphs = self.mode == "reduce-overhead"

    def check(self, workload) -> None:
        if any(str(getattr(t, "mode", "")).startswith("selective") for t in workload.technique_configs):
            raise MemfitError("-t compile: a block under a selective checkpoint policy runs inside the policy's "
                              "dispatch mode, where torch.compile falls back to eager; use mode=full with it.")

    def apply_(self, setup: StepSetup) -> None:
        traced = stand_in("inductor-trace", setup.model.parameters())   # Inductor's partitioner, graphs run op by op
        on_cuda = any(p.is_cuda for p in setup.model.parameters())
        options = {"mode": self.mode} if on_cuda and self.mode != "default" else {}

        @functools.cache   # one compiled function per function, whatever calls it each step
        def compile_fn(function):
            if traced is not None:
                return traced(_own_code(function))
            return torch.compile(_own_code(function), backend="inductor", **options)

        for _, block in repeated_blocks(setup.model):   # one compiled forward per block class, the block an input
            block.forward = functools.partial(compile_fn(type(block).forward), block)
        setup.compile_fn = compile_fn


def _own_code(function):
    """`function` with a code object of its own. Dynamo keeps its compiled graphs on the code object and falls back
    to eager after `recompile_limit` of them: estimates made one after another (a planner's points, a benchmark's
    rows, one trace per depth) would reach it on a shared code object (transformers' decorators share theirs)."""
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return functools.update_wrapper(copy, function)
