"""Tensors a compiler never writes to memory: the intermediates of a chain of pointwise ops and reductions that
Inductor fuses into one kernel. Code that runs such ops for their values only (memfit's model of a compiled
graph, techniques/compile.py) runs them inside `fused()`, and a tracker listening (estimators/tracker.py) does
not count what they return."""
from __future__ import annotations

from contextlib import contextmanager

_fused_regions = 0


@contextmanager
def fused():
    """What is computed inside stays in a fused kernel's registers: no device memory."""
    global _fused_regions
    _fused_regions += 1
    try:
        yield
    finally:
        _fused_regions -= 1


def in_fused_region() -> bool:
    return _fused_regions > 0
