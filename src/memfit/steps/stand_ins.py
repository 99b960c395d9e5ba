"""Trace stand-ins: where a technique's library cannot run on fake tensors (it reads values, or wraps a tensor in a
type fake tensors refuse), a traced run calls a stand-in that allocates what the library would, instead.

A technique asks for its stand-in by name (`stand_in(NAME, tensors)`) and gets it only when `tensors` are fake (a
traced run), else None: the real run never sees one. The stand-ins themselves live with the tracer
(estimators/stand_ins.py registers them when memfit.estimators loads, and ARCHITECTURE.md lists each with the test
that pins it against a real run); this module is the registry, in the layer techniques may import.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

STAND_INS: dict[str, Callable[..., Any]] = {}


def register_stand_in(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def add(stand_in: Callable[..., Any]) -> Callable[..., Any]:
        if name in STAND_INS:
            raise ValueError(f"trace stand-in {name!r} is registered twice")
        STAND_INS[name] = stand_in
        return stand_in
    return add


def is_traced(tensors: Iterable[torch.Tensor]) -> bool:
    """True when any of `tensors` is fake: the step runs under a trace."""
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(t) for t in tensors)


def stand_in(name: str, tensors: Iterable[torch.Tensor]) -> Callable[..., Any] | None:
    """The stand-in registered as `name` when `tensors` are fake, else None."""
    if not is_traced(tensors):
        return None
    try:
        return STAND_INS[name]
    except KeyError:
        raise RuntimeError(f"no trace stand-in {name!r}: import memfit.estimators before tracing") from None
