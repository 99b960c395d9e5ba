"""Activation checkpointing in the symbolic engine (torch.utils.checkpoint, non-reentrant), and saved tensors
offloaded to the host (torch.autograd.graph.save_on_cpu)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from memfit.estimators.analytic.symbols import Sym

if TYPE_CHECKING:
    from memfit.estimators.analytic.engine import Engine, Node

T = TypeVar("T")


class RecomputeDone(Exception):
    """Non-reentrant checkpoint stops re-running a block once every saved tensor is back."""


class Region:
    """A checkpointed block (torch.utils.checkpoint, non-reentrant). In the forward its nodes keep
    nothing: the block's inputs stay alive through `fn`, as checkpoint holds its arguments. The
    first backward node that needs a saved tensor re-runs `fn`; the re-run's saved tensors go to the
    original nodes, in recording order, and the re-run stops after the last of them. Selective
    (SAC): the outputs of the ops the policy names are kept from the forward and reused, not recomputed."""

    def __init__(self, fn, x: Sym, selective: str | None) -> None:
        self.fn, self.x, self.selective = fn, x, selective
        self.kept: list[Sym] = []         # selective: op outputs stored in the forward, in order
        self.reuse: list[Sym] | None = None   # during the re-run: kept outputs still to hand out
        self.done = False
        self.mm_count = 0                 # selective-op: aten.mm calls so far in this pass

    def keeps(self, kind: str) -> bool:
        """Whether the policy saves this op's output: `selective` every matmul and attention kernel;
        `selective-op` (torchtitan) attention and every odd-numbered mm of the pass."""
        if self.selective == "selective":
            return True
        if self.selective != "selective-op":
            return False
        if kind == "mm":
            self.mm_count += 1
            return self.mm_count % 2 == 1
        return kind == "attention"


def offloaded(e: Engine, fn: Callable[[Sym], T], x: Sym) -> T:
    """`fn(x)` with its saved tensors copied to the host as they are saved (one copy per tensor)."""
    if not e.policy.train:
        return fn(x)
    e.offloading = {}
    try:
        return fn(x)
    finally:
        e.offloading = None


def checkpointed(e: Engine, fn: Callable[[Sym], T], x: Sym, *, selective: str | None = None) -> T:
    """`fn(x)` under torch.utils.checkpoint (non-reentrant: it applies when only the block's parameters
    need gradients too, as under LoRA, whose first block's input needs none)."""
    if not e.policy.train:
        return fn(x)
    region = Region(fn, x, selective)
    start = len(e.tape)
    e.region = region
    try:
        out = fn(x)
    finally:
        e.region = None
    for node in e.tape[start:]:
        node.saved = [True] * len(node.saved)   # placeholders: what the re-run must bring back
    return out


def recompute(e: Engine, region: Region, nodes: list[Node]) -> None:
    """Re-run `region`; `nodes` are its nodes still on the tape, in recording order."""
    saving = [node for node in nodes if node.saved]
    outer_tape, e.tape = e.tape, []
    e.region, region.reuse = region, list(region.kept)
    region.kept, region.mm_count = [], 0
    e.rerun_left = len(saving)
    autocast = e.autocast_on
    e.autocast_on = e.policy.autocast_dtype is not None   # checkpoint re-enters the autocast state
    try:
        region.fn(region.x)
    except RecomputeDone:
        pass
    finally:
        e.rerun_left, e.region, e.autocast_on = None, None, autocast
        e.cast_cache.clear()
    rerun = [node for node in e.tape if node.saved]
    e.tape = outer_tape
    assert len(rerun) == len(saving), (len(rerun), len(saving))
    for node, again in zip(saving, rerun):
        node.saved = again.saved
    region.reuse, region.done = None, True
