"""Live objects of a Python session (a notebook's model, batch, optimizer and step) as a memfit workload:
`memfit.estimate(model, batch, optimizer=..., step=...)`.

The objects are registered here under names (`live:model:Decoder#0`, ...) that a Workload carries like any other
model, inputs or step spec. memfit never runs the live model: it builds a copy on the meta device (the same
modules, hooks and attributes; every parameter and buffer replaced by a meta tensor of its shape and dtype, tied
weights kept tied), so nothing model-sized is allocated and the model, its gradients and the optimizer's state are
left exactly as they were. The batch is kept as a description (shapes and dtypes), not as the tensors. The names
live in this process only: a live workload cannot be measured in other processes or saved for a later session.
"""
from __future__ import annotations

import copy
import itertools
import weakref
from typing import Any

import torch
from torch import nn

from memfit.core.errors import MemfitError
from memfit.core.precision import PRECISIONS, precision_of_model
from memfit.specs.workload import Workload

PREFIX = "live:"
_objects: dict[str, Any] = {}
_count = itertools.count()


def is_live(spec: str | None) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def register(obj: Any, role: str) -> str:
    """A name for `obj` (a model held weakly; a batch description or a step function held as given)."""
    name = f"{PREFIX}{role}:{getattr(obj, '__name__', type(obj).__name__)}#{next(_count)}"
    _objects[name] = weakref.ref(obj) if isinstance(obj, nn.Module) else obj
    return name


def lookup(name: str | None) -> Any:
    if name not in _objects:
        raise MemfitError(f"{name!r} names a live object of another Python session; pass the object itself "
                          "(memfit.estimate(model, batch, ...)) or name the model by module:function.")
    value = _objects[name]
    value = value() if isinstance(value, weakref.ref) else value
    if value is None:
        raise MemfitError(f"the live model {name!r} no longer exists; pass it again.")
    return value


def meta_copy(model: nn.Module) -> nn.Module:
    """`model` copied with every parameter and buffer on the meta device (a parameter shared by several modules
    stays shared; its requires_grad is kept)."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in memo:
                memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                               requires_grad=param.requires_grad)
        for buffer in module._buffers.values():
            if buffer is not None and id(buffer) not in memo:
                memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def describe_batch(batch: Any) -> Any:
    """The batch's structure with each tensor replaced by (shape, dtype)."""
    if isinstance(batch, torch.Tensor):
        if not batch.numel():
            raise MemfitError(f"the batch holds an empty tensor (shape {tuple(batch.shape)}); pass a batch of the "
                              "size you train or serve with.")
        return ("tensor", tuple(batch.shape), batch.dtype)
    if isinstance(batch, (tuple, list)) and batch and all(isinstance(t, torch.Tensor) for t in batch):
        return ("tuple", tuple(describe_batch(t) for t in batch))
    if isinstance(batch, dict) and batch and all(isinstance(k, str) for k in batch):
        return ("dict", {k: describe_batch(v) if isinstance(v, torch.Tensor) else ("value", v)
                         for k, v in batch.items()})
    raise MemfitError(f"a live batch is a tensor, a tuple of tensors or a dict of keyword arguments, got "
                      f"{type(batch).__name__}.")


def batch_like(description: Any) -> Any:
    """Empty tensors of the described shapes and dtypes, on the current default device (fake in a trace)."""
    kind, value = description[0], description[1:]
    if kind == "tensor":
        shape, dtype = value
        return torch.empty(shape, dtype=dtype)
    if kind == "tuple":
        return tuple(batch_like(t) for t in value[0])
    if kind == "dict":
        return {k: batch_like(v) for k, v in value[0].items()}
    return value[0]   # a plain value given as a keyword argument


def batch_shape(description: Any) -> tuple[int, int | None]:
    """(batch size, sequence length) of the batch's first tensor, for reports."""
    kind, value = description[0], description[1:]
    if kind == "tensor":
        shape = value[0]
        return (shape[0] if shape else 1), (shape[1] if len(shape) > 1 else None)
    tensors = value[0] if kind == "tuple" else [v for v in value[0].values() if v[0] != "value"]
    return batch_shape(tensors[0]) if tensors else (1, None)


def live_workload(model: nn.Module, batch: Any, *, optimizer: tuple[str, str | None] = ("adamw", None),
                  step: Any = None, task: str = "train", precision: str | None = None, techniques=()) -> Workload:
    """A Workload over live objects: `model` an nn.Module (real weights or on the meta device), `batch` a tensor,
    tuple or dict (real or meta), `optimizer` (memfit's name, --optimizer-impl), `step` fn(model, batch,
    optimizer)."""
    if not isinstance(model, nn.Module):
        raise MemfitError(f"expected a torch.nn.Module or a memfit Workload, got {type(model).__name__}.")
    if step is not None and not callable(step):
        raise MemfitError(f"step must be a function fn(model, batch, optimizer), got {type(step).__name__}.")
    description = describe_batch(batch)
    name, impl = optimizer
    batch_size, seq_len = batch_shape(description)
    names = [getattr(t, "name", None) or str(t).partition(":")[0] for t in techniques]   # specs or configs
    if precision is None and not any(name in PRECISIONS for name in names):
        precision = precision_of_model(model).name   # the weights' own, unless a precision technique is asked for
    given_precision: dict[str, Any] = {"precision": precision} if precision else {}
    return Workload(model=register(model, "model"), inputs=register(description, "batch"),
                    step=register(step, "step") if step is not None else None, task=task, batch_size=batch_size,
                    seq_len=seq_len, **given_precision, optimizer=name,
                    optimizer_impl=impl if task == "train" else None, techniques=tuple(techniques))
