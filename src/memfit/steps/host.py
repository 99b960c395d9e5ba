"""Host (CPU) memory that offload techniques use, kept apart from the device's.

memfit runs the device's step on the CPU too (traces on fake tensors, CPU measurements), where host
and device are one pool and `tensor.to("cpu")` moves nothing. Offload code therefore says which
tensors it keeps on the host (`note_host`; `host_copy` copies and says so; everything allocated
inside `on_host()` is host memory, e.g. a CPU optimizer's step), and a tracker listening
(estimators/tracker.py) counts them as host RAM instead of device memory. On a real GPU
the same code moves the bytes, and pins host buffers so the copies can run asynchronously.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

_listeners: list[Callable[[list[torch.Tensor], str], None]] = []
_host_regions = 0


@contextmanager
def on_host():
    """What is allocated inside is host memory (code that runs on the CPU next to a device step)."""
    global _host_regions
    _host_regions += 1
    try:
        yield
    finally:
        _host_regions -= 1


def in_host_region() -> bool:
    return _host_regions > 0


def note_host(tensors: Iterable[torch.Tensor]) -> None:
    """These tensors live in host RAM (whatever device the step runs on)."""
    _notify(tensors, "host")


def note_paged(tensors: Iterable[torch.Tensor]) -> None:
    """These tensors live in CUDA unified memory on a GPU (bitsandbytes' paged optimizer states), outside PyTorch's
    allocator; on a CPU they are ordinary tensors."""
    _notify(tensors, "paged")


def note_category(tensors: Iterable[torch.Tensor], category: str) -> None:
    """These device tensors belong to `category` (weights streamed in are "parameters", DDP's buckets
    "gradients"): for code that runs inside a step, where memfit's step hooks cannot reach."""
    _notify(tensors, category)


def _notify(tensors: Iterable[torch.Tensor], kind: str) -> None:
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    for listener in _listeners:
        listener(tensors, kind)


@contextmanager
def listening(listener: Callable[[list[torch.Tensor], str], None]):
    """`listener(tensors, kind)` hears every note; kind is "host", "paged" or a category."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


def host_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new host tensor with `tensor`'s values (pinned when a GPU is present, for asynchronous copies)."""
    pin = torch.cuda.is_available() and tensor.device.type == "cuda"
    out = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device="cpu", pin_memory=pin)
    out.copy_(tensor.detach(), non_blocking=pin)
    note_host([out])
    return out
