"""A model's repeated blocks as lists: the outermost nn.ModuleLists whose children (two or more) are alike."""
from __future__ import annotations

from collections.abc import Callable, Hashable

from torch import nn


def alike_lists(model: nn.Module, key: Callable[[nn.Module], Hashable] = type) -> list[nn.ModuleList]:
    """Every nn.ModuleList of `model` whose children (two or more) share one `key` (by default their type),
    outermost lists only: a list inside a found list's blocks (experts, heads) is not one of them."""
    found: list[nn.ModuleList] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({key(child) for child in module}) == 1:
            found.append(module)
            inside.update(id(m) for child in module for m in child.modules())
    return found
