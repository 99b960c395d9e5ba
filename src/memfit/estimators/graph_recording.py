"""A traced step's autograd graph beside its storages: what each backward node saves, the gradients it takes and
passes on, and what it allocates while it runs (analytic/families/derived.py builds a program from this).

`GraphTracker` is the memory tracker (tracker.py) plus three records of the measured step:

  nodes       every backward node of the loss's graph, in the order forward created them: its name, its edges (the
              node each gradient goes to, or the parameter it accumulates into, with the gradient's shape and dtype),
              the storages it saved, and the events its backward ran between (`window`)
  event_seq   the autograd sequence number at each event: which nodes forward had created by then
  block       the first repeated layer's forward: its input and output storages, and the sequence numbers and
              events where it started and ended
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.estimators.tracker import MemoryTracker


@dataclass
class NodeRecord:
    seq: int
    name: str
    edges: list[tuple[int | None, int | None, tuple[int, ...], str]]   # (node seq | None, parameter storage | None,
    #                                                                     gradient shape, dtype)
    saved: list[int]                    # storage indices
    grad_shape: tuple[int, ...] = ()    # the gradient it receives (its forward output's shape)
    grad_dtype: str = ""
    window: list[int] = field(default_factory=lambda: [-1, -1])   # events before and after its backward ran
    packed: bool = False                # a hook packed what it saved (a checkpoint: its backward recomputes it)


@dataclass
class BlockRecord:
    inputs: list[int]        # storage indices of the layer's input hidden state(s)
    outputs: list[int]
    seq: tuple[int, int]     # sequence numbers at its start and end
    events: tuple[int, int]  # event indices at its start and end


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _sequence_nr() -> int:
    return torch._C._autograd._get_sequence_nr()


class GraphTracker(MemoryTracker):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.event_seq: list[int] = []
        self.nodes: list[NodeRecord] = []
        self.block: BlockRecord | None = None
        self._layer: nn.Module | None = None
        self._backward = None

    # ---- sequence numbers at each event -----------------------------------------------------------------------
    def _pad(self) -> None:
        self.event_seq += [_sequence_nr()] * (len(self.events) - len(self.event_seq))

    def _register(self, tensor, born=None, op=""):
        index = super()._register(tensor, born, op)
        self._pad()
        return index

    def _free(self, index: int) -> None:
        super()._free(index)
        self._pad()

    def _resized(self, storage, nbytes: int) -> None:
        super()._resized(storage, nbytes)
        self._pad()

    def storage_index(self, tensor: torch.Tensor) -> int | None:
        return self._by_storage.get(tensor.untyped_storage())

    # ---- the first layer's inputs and outputs -----------------------------------------------------------------
    def watch_stacks(self, stacks: list[nn.ModuleList]) -> None:
        super().watch_stacks(stacks)
        if not stacks:
            return
        layer = stacks[0][0]
        started: dict[str, Any] = {}

        def tensors(value) -> list[int]:
            leaves = [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
            return [i for t in leaves if t.is_floating_point() and (i := self.storage_index(t)) is not None]

        def enter(module, args, kwargs):
            started.update(inputs=tensors((args, kwargs.get("hidden_states"))), seq=_sequence_nr(),
                           event=len(self.events))

        def leave(module, args, kwargs, output):
            first = output[0] if isinstance(output, (tuple, list)) else output
            self.block = BlockRecord(started["inputs"], tensors(first), (started["seq"], _sequence_nr()),
                                     (started["event"], len(self.events)))

        self._stack_handles += [layer.register_forward_pre_hook(enter, with_kwargs=True),
                                layer.register_forward_hook(leave, with_kwargs=True)]

    # ---- the graph, as backward starts ------------------------------------------------------------------------
    def __enter__(self):
        self._backward = torch.autograd.backward
        tracker = self

        def backward(tensors, *args, **kwargs):
            tracker._record_graph(tensors)
            return tracker._backward(tensors, *args, **kwargs)

        torch.autograd.backward = backward
        return super().__enter__()

    def __exit__(self, *exc):
        torch.autograd.backward = self._backward
        return super().__exit__(*exc)

    def _record_graph(self, roots) -> None:
        roots = [roots] if isinstance(roots, torch.Tensor) else list(roots)
        seen: dict[Any, NodeRecord] = {}
        stack = [t.grad_fn for t in roots if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen[node] = self._node_record(node)
            stack += [nxt for nxt, _ in node.next_functions if nxt is not None and not hasattr(nxt, "variable")]
        for node, record in seen.items():
            def before(grad_outputs, record=record):
                record.window[0] = len(self.events)

            def after(grad_inputs, grad_outputs, record=record):
                record.window[1] = len(self.events)

            node.register_prehook(before)
            node.register_hook(after)
        self.nodes = sorted(seen.values(), key=lambda r: r.seq)

    def _node_record(self, node) -> NodeRecord:
        edges: list[tuple[int | None, int | None, tuple[int, ...], str]] = []
        for nxt, input_nr in node.next_functions:
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):   # AccumulateGrad: the parameter itself
                variable = nxt.variable
                edges.append((None, self.storage_index(variable), tuple(variable.shape), _dtype(variable.dtype)))
            else:
                meta = nxt._input_metadata[input_nr]
                edges.append((nxt._sequence_nr(), None, tuple(meta.shape), _dtype(meta.dtype)))
        saved, packed = [], False
        for name in dir(node):   # each saved variable through its raw handle: one a hook packed (a checkpoint's,
            if not name.startswith("_raw_saved_"):   # an offload's) is not unpacked, which would run the hook
                continue
            raws = getattr(node, name)
            raws = raws if isinstance(raws, (tuple, list)) else [raws]
            if any(getattr(raw, "unpack_hook", None) is not None for raw in raws):
                packed = True
                continue
            value = getattr(node, name.replace("_raw_saved_", "_saved_") if name != "_raw_saved_tensors"
                            else "saved_tensors")
            for tensor in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(tensor, torch.Tensor) and (index := self.storage_index(tensor)) is not None:
                    saved.append(index)
        meta = node._input_metadata[0] if node._input_metadata else None
        return NodeRecord(node._sequence_nr(), node.name(), edges, saved,
                          tuple(meta.shape) if meta is not None else (), _dtype(meta.dtype) if meta else "",
                          packed=packed)
