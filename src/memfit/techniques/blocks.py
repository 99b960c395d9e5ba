"""Finding a model's repeated blocks (the units that checkpointing and sharding wrap)."""
from __future__ import annotations

import re

from torch import nn

from memfit.core.errors import ImpossibleCombination, MemfitError
from memfit.specs.blocks import alike_lists


def repeated_blocks(model: nn.Module, pattern: str | None = None) -> list[tuple[int, nn.Module]]:
    """(index in its list, block): the children of every ModuleList whose children (two or more) share
    one type, outermost lists only; or, with `pattern`, every module whose qualified name matches that
    regular expression (indexed in the order found)."""
    if pattern is not None:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise MemfitError(f"blocks={pattern!r} is not a valid regular expression: {exc}.") from None
        found = [module for name, module in model.named_modules() if name and regex.fullmatch(name)]
        if not found:
            raise MemfitError(f"blocks={pattern!r} matches no module of {type(model).__name__}; "
                              "module names look like 'model.layers.0'.")
        return list(enumerate(found))
    found = [item for stack in alike_lists(model) for item in enumerate(stack)]
    if not found:
        raise ImpossibleCombination(f"{type(model).__name__} has no ModuleList of repeated blocks; name the blocks "
                                    "with blocks=REGEX (e.g. -t checkpointing:blocks='encoder\\.layer\\.\\d+').")
    return found
