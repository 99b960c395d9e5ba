"""How a step tells an observer (tracker, profiler) which phase it is in and what a tensor is."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch


class StepHooks(Protocol):
    def phase(self, name: str) -> None:
        """A new phase starts now (forward, backward, optimizer, prefill, decode)."""

    def mark(self, category: str, tensors: Iterable[torch.Tensor]) -> None:
        """These tensors belong to `category` (gradients, optimizer_states, kv_cache, ...)."""


class NullHooks:
    def phase(self, name: str) -> None:
        pass

    def mark(self, category: str, tensors: Iterable[torch.Tensor]) -> None:
        pass


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A tensor subclass that wraps others (torchao's quantized states, DTensor) as the tensors it holds."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return [tensor]
    names, _ = flatten()
    inner = (getattr(tensor, name) for name in names)
    return [t for value in inner if isinstance(value, torch.Tensor) for t in plain_tensors(value)]


def tensors_in(obj, depth: int = 4) -> list[torch.Tensor]:
    """Every tensor reachable from `obj` through containers and object attributes (a KV cache).
    Iterative on purpose: a recursive closure would form a reference cycle that keeps the tensors
    alive until the garbage collector runs, which is a memory leak in exactly what memfit measures."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [(obj, 0)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
            continue
        if level > depth or id(value) in seen:
            continue
        seen.add(id(value))
        items: Iterable[Any]
        if isinstance(value, dict):
            items = value.values()
        elif isinstance(value, (list, tuple, set)):
            items = value
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            items = vars(value).values()
        else:
            continue
        stack.extend((item, level + 1) for item in items)
    return found
