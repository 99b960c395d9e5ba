"""A registry of named declarations (weight formats, KV-cache kinds): one entry per name, found by name with a
did-you-mean for a mistyped one."""
from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from memfit.core.errors import require_choice


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


class Registry(dict[str, T], Generic[T]):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def add(self, item: T) -> T:
        """Register `item` under its name; registering the same declaration again is allowed, another one is not."""
        if self.get(item.name, item) != item:
            raise ValueError(f"{self.what} {item.name} is already registered")
        self[item.name] = item
        return item

    def named(self, name: str) -> T:
        if name not in self:
            require_choice(name, self, self.what)
        return self[name]
