"""A dispatch-level memory tracker: every tensor storage, when it is born and dies, and what it is.

It works the same on fake tensors (tracing) and real ones (measuring). A storage is counted once,
however many tensors view it. Categories are decided after the run, from what the step marked
(gradients, optimizer states, KV cache) and when a storage was born:

  marked by the step          -> that category
  parameter / buffer / input  -> parameters / buffers / inputs
  born in forward/prefill/decode -> activations
  born in backward/optimizer  -> temporaries

`round_to` rounds every storage up as an allocator would (CUDA's caching allocator: 512 bytes).
Storages that offload code keeps in host RAM (steps/host.py) are counted apart: `walk` and `summary`
are the device's, `host_peaks` the host's.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from torch.utils._python_dispatch import (
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from memfit.core.caching_allocator import PHASE_START, STEP_START, Event
from memfit.core.categories import CATEGORIES, zero_categories
from memfit.estimators.fake_patches import TraceMode
from memfit.steps.fusion import in_fused_region
from memfit.steps.hooks import plain_tensors
from memfit.steps.host import in_host_region, listening

_FORWARD_PHASES = {"forward", "prefill", "decode", "setup"}


@dataclass
class _Storage:
    nbytes: int
    phase: str
    module: str | None
    born: int                     # event index; -1 for storages alive before tracking began
    died: int | None = None
    category: str | None = None   # explicit category, when one was marked
    op: str = ""                  # the operator that created it ("" for watched tensors)
    shape: tuple = ()
    dtype: str = ""
    host: bool = False            # kept in host RAM by an offload technique (not device memory)
    paged: bool = False           # CUDA unified memory on a GPU (a paged optimizer's state), outside the allocator
    raw_nbytes: int = 0           # before rounding (batch_interpolation.py rebuilds a trace from these)


@dataclass
class PeakPoint:
    total: int
    at: dict[str, int]
    phase: str
    event: int


@dataclass
class Trace:
    """What a tracked run leaves behind: storages, an event log and the phase marks."""

    storages: list[_Storage]
    events: list[tuple[int, int]]           # (storage index, +nbytes | -nbytes)
    phase_marks: list[tuple[int, str]]      # (first event index of the phase, phase)
    start: int = 0                          # events before this index are the warm-up step
    block_marks: list[tuple[int, str, int, int, str]] = field(default_factory=list)
    # (event index, phase, stack, layer, "start" | "end"): where each repeated layer ran
    raw_deltas: list[int] = field(default_factory=list)   # each event's change before rounding
    round_to: int = 1

    def category_of(self, storage: _Storage) -> str:
        if storage.category:
            return storage.category
        return "activations" if storage.phase in _FORWARD_PHASES else "temporaries"

    def walk(self, weights: dict[str, int] | None = None, *, include_host: bool = False):
        """Yield (event index, category totals) after every event of the measured step.
        `weights` multiplies each category (per-rank sharding, see sharding.py); host storages count
        only with `include_host` (a CPU run, where host and device share one allocator)."""
        category = [self.category_of(s) for s in self.storages]
        weight = self._storage_weights(category, weights, include_host)
        totals = zero_categories()
        for index, storage in enumerate(self.storages):   # watched before tracking began
            if storage.born == -1:
                totals[category[index]] += storage.nbytes * weight[index]
        for sid, delta in self.events[:self.start]:       # the warm-up step: births, deaths and resizes
            totals[category[sid]] += delta * weight[sid]
        yield self.start - 1, totals
        for index in range(self.start, len(self.events)):
            sid, delta = self.events[index]
            totals[category[sid]] += delta * weight[sid]
            yield index, totals

    def _storage_weights(self, category: list[str], weights: dict[str, int] | None, include_host: bool) -> list[int]:
        weights = weights or {name: 1 for name in CATEGORIES}
        step_weight = weights.get("optimizer_temporaries", weights["temporaries"])
        paged = weights.get("paged", 1)   # 0: a GPU target, where paged storages live outside the allocator
        return [0 if (s.host and not include_host) or (s.paged and not paged)
                else step_weight if c == "temporaries" and s.phase == "optimizer" else weights[c]
                for c, s in zip(category, self.storages)]

    def paged_bytes(self) -> int:
        """Bytes of the storages in unified memory (a paged optimizer's states, alive from the first step on)."""
        return sum(s.nbytes for s in self.storages if s.paged)

    def allocations(self, weights: dict[str, int] | None = None, divisor: int = 1) -> list[Event]:
        """The device's allocations in order, for the caching allocator (caching_allocator.replay): (storage,
        bytes it holds from now on, stream 0) for the storages alive before tracking began, then every event in
        order: the set-up (the techniques applied, e.g. a quantization on the device) and the warm-up step, a
        STEP_START marker where the measured step begins, a PHASE_START marker where each of its phases begins;
        sharded bytes per rank with `weights` and `divisor` (sharding.py)."""
        weight = self._storage_weights([self.category_of(s) for s in self.storages], weights, False)
        size = {i: s.nbytes for i, s in enumerate(self.storages) if s.born == -1}
        out: list[Event] = [(i, -(-nbytes * weight[i] // divisor), 0) for i, nbytes in size.items() if weight[i]]
        phase_starts = {index for index, _ in self.phase_marks}
        for index, (sid, delta) in enumerate(self.events):
            if index == self.start:
                out.append((STEP_START, 0, 0))
            if index in phase_starts:
                out.append((PHASE_START, 0, 0))
            if weight[sid]:
                size[sid] = size.get(sid, 0) + delta
                out.append((sid, -(-size[sid] * weight[sid] // divisor), 0))
        return out

    def measured_marks(self) -> list[tuple[int, str]]:
        """The phase marks of the measured step: (first event index of the phase, phase)."""
        return [m for m in self.phase_marks if m[0] >= self.start]

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """The measured step's phases: (phase, first event index, end event index)."""
        marks = self.measured_marks()
        return [(name, begin, marks[i + 1][0] if i + 1 < len(marks) else len(self.events))
                for i, (begin, name) in enumerate(marks)]

    def in_phases(self, items):
        """(phase, event index, value) for each (event index, value) of the measured step, in order."""
        marks = self.measured_marks()
        phase, next_mark = (marks[0][1] if marks else "setup"), 0
        for index, value in items:
            while next_mark < len(marks) and marks[next_mark][0] <= index:
                phase = marks[next_mark][1]
                next_mark += 1
            yield phase, index, value

    def host_peaks(self) -> dict[str, int]:
        """Per phase of the measured step, the most host RAM the offloaded storages held at once."""
        live = sum(s.nbytes for s in self.storages if s.host and s.born == -1)
        live += sum(delta for sid, delta in self.events[:self.start] if self.storages[sid].host)
        marks = self.measured_marks()
        peaks = {marks[0][1] if marks else "setup": live}
        measured = ((index, self.events[index]) for index in range(self.start, len(self.events)))
        for phase, _, (sid, delta) in self.in_phases(measured):
            if self.storages[sid].host:
                live += delta
            peaks[phase] = max(peaks.get(phase, 0), live)
        return peaks

    def summary(self, *, include_host: bool = False) -> tuple[PeakPoint, dict[str, int], dict[str, PeakPoint]]:
        """(global peak, each category's own peak, each phase's peak) over the measured step."""
        best: PeakPoint | None = None
        component_peaks = zero_categories()
        phase_peaks: dict[str, PeakPoint] = {}
        for phase, index, totals in self.in_phases(self.walk(include_host=include_host)):
            total = sum(totals.values())
            for name, value in totals.items():
                component_peaks[name] = max(component_peaks[name], value)
            if best is None or total > best.total:
                best = PeakPoint(total, dict(totals), phase, index)
            if phase not in phase_peaks or total > phase_peaks[phase].total:
                phase_peaks[phase] = PeakPoint(total, dict(totals), phase, index)
        assert best is not None   # walk yields at least the measured step's baseline
        return best, component_peaks, phase_peaks

    def alive_at(self, event: int) -> list[_Storage]:
        return [s for s in self.storages if s.born <= event and (s.died is None or s.died > event)]


class MemoryTracker(TraceMode):
    """Use as a context manager around a step; `hooks` methods let the step mark phases and tensors."""

    def __init__(self, *, round_to: int = 1, module_names: dict[int, str] | None = None) -> None:
        super().__init__()
        self.round_to = round_to
        self._by_storage = WeakIdKeyDictionary()
        self._refs: list[weakref.ref] = []
        self.storages: list[_Storage] = []
        self.events: list[tuple[int, int]] = []
        self.phase_marks: list[tuple[int, str]] = []
        self._phase = "setup"
        self._module_stack: list[str | None] = []
        self._module_names = module_names or {}
        self._hook_handles: list = []
        self._stack_handles: list = []
        self.block_marks: list[tuple[int, str, int, int, str]] = []
        self.start = 0
        self._recording = False
        self._size: dict[int, int] = {}      # storages resized in place (FSDP2 frees by resizing to 0)
        self._raw_size: dict[int, int] = {}  # the same, before rounding
        self.raw_deltas: list[int] = []

    # ---- the step's hooks -----------------------------------------------------------------
    def phase(self, name: str) -> None:
        self._phase = name
        self.phase_marks.append((len(self.events), name))

    def mark(self, category: str, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            for plain in plain_tensors(tensor):
                self.storages[self._register(plain)].category = category

    def mark_host(self, tensors: Iterable[torch.Tensor]) -> None:
        """These tensors live in host RAM (steps/host.py calls this for offload code)."""
        for tensor in tensors:
            for plain in plain_tensors(tensor):
                self.storages[self._register(plain)].host = True

    def _noted(self, tensors: list[torch.Tensor], kind: str) -> None:
        if kind == "host":
            self.mark_host(tensors)
        elif kind == "paged":
            for tensor in tensors:
                for plain in plain_tensors(tensor):
                    self.storages[self._register(plain)].paged = True
        else:
            self.mark(kind, tensors)

    def begin_measured_step(self) -> None:
        """Everything before this point was warm-up; the measured step starts here."""
        self.start = len(self.events)

    # ---- registration ---------------------------------------------------------------------
    def watch(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Tensors that exist before tracking starts (parameters, buffers, inputs)."""
        for tensor in tensors:
            for plain in plain_tensors(tensor):
                index = self._register(plain, born=-1)
                self.storages[index].category = self.storages[index].category or category

    def watch_model(self, model: nn.Module) -> None:
        self.watch(model.parameters(), "parameters")
        self.watch(model.buffers(), "buffers")
        self._module_names = {id(m): name for name, m in model.named_modules()}

    def watch_stacks(self, stacks: list[nn.ModuleList]) -> None:
        """Mark where each layer of these repeated stacks starts and ends, in forward and backward."""
        for stack_id, stack in enumerate(stacks):
            for layer_id, layer in enumerate(stack):
                key = (stack_id, layer_id)
                self._stack_handles.append(layer.register_forward_pre_hook(self._layer_enter(key)))
                self._stack_handles.append(layer.register_forward_hook(self._layer_exit(key)))

    def _block_mark(self, key: tuple[int, int], kind: str, phase: str | None = None) -> None:
        self.block_marks.append((len(self.events), phase or self._phase, key[0], key[1], kind))

    def _layer_enter(self, key):
        def hook(module, args):
            self._block_mark(key, "start")
            first = _first_grad_tensor(args)
            if first is not None:  # its gradient arrives when this layer's backward ends
                first.register_hook(lambda grad: self._block_mark(key, "end", "backward"))
        return hook

    def _layer_exit(self, key):
        def hook(module, args, output):
            self._block_mark(key, "end")
            first = _first_grad_tensor(output)
            if first is not None:  # its gradient arrives when this layer's backward starts
                first.register_hook(lambda grad: self._block_mark(key, "start", "backward"))
        return hook

    def _register(self, tensor: torch.Tensor, born: int | None = None, op: str = "") -> int:
        storage = tensor.untyped_storage()
        index = self._by_storage.get(storage)
        if index is not None:
            return index
        raw = nbytes = storage.nbytes()
        if self.round_to > 1:
            nbytes = -(-nbytes // self.round_to) * self.round_to if nbytes else 0
        index = len(self.storages)
        module = next((m for m in reversed(self._module_stack) if m is not None), None)
        self.storages.append(_Storage(nbytes, self._phase, module, -1 if born == -1 else len(self.events),
                                      op=op, shape=tuple(tensor.shape), dtype=str(tensor.dtype).replace("torch.", ""),
                                      host=in_host_region(), raw_nbytes=raw))
        self._by_storage[storage] = index
        if born != -1:
            self.events.append((index, nbytes))
            self.raw_deltas.append(raw)
        self._refs.append(weakref.ref(storage, cast("Callable[[weakref.ref[torch.UntypedStorage]], None]",
                                                    lambda _ref, i=index: self._free(i))))
        return index

    def _free(self, index: int) -> None:
        if not self._recording:
            return
        storage = self.storages[index]
        storage.died = len(self.events)
        self.events.append((index, -self._size.pop(index, storage.nbytes)))
        self.raw_deltas.append(-self._raw_size.pop(index, storage.raw_nbytes))

    def _resized(self, storage, nbytes: int) -> None:
        index = self._by_storage.get(storage)
        if index is None:
            return
        raw_before = self._raw_size.get(index, self.storages[index].raw_nbytes)
        if nbytes == raw_before:
            return
        rounded = -(-nbytes // self.round_to) * self.round_to
        self.events.append((index, rounded - self._size.get(index, self.storages[index].nbytes)))
        self.raw_deltas.append(nbytes - raw_before)
        self._size[index], self._raw_size[index] = rounded, nbytes

    def live_bytes(self) -> int:
        """Bytes of the tracked storages alive now, host and device."""
        return sum(self._size.get(i, s.nbytes) for i, s in enumerate(self.storages) if s.died is None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented   # the subclass (DTensor) runs it, and its inner ops come back here
        out = func(*args, **(kwargs or {}))
        if in_fused_region():   # a compiled kernel's intermediate (steps/fusion.py): never in memory
            return out
        for tensor in tree_leaves(out):
            # a wrapper subclass (DTensor) owns no memory: its inner tensors are registered by their own ops
            if isinstance(tensor, torch.Tensor) and not is_traceable_wrapper_subclass(tensor):
                self._register(tensor, op=func.__name__)
        return out

    # ---- module context -------------------------------------------------------------------
    def __enter__(self):
        from torch.nn.modules import module as module_mod

        # inside a compiled graph (-t compile) the hooks are traced, not run: they would only add guards
        def pre(mod, args):
            if not torch.compiler.is_compiling():
                self._module_stack.append(self._module_names.get(id(mod)))

        def post(mod, args, out):
            if not torch.compiler.is_compiling() and self._module_stack:
                self._module_stack.pop()

        self._hook_handles = [module_mod.register_module_forward_pre_hook(pre),
                              module_mod.register_module_forward_hook(post)]
        resize, tracker = torch.UntypedStorage.resize_, self

        def resize_(storage, nbytes):   # not a dispatched op: FSDP2 frees and refills its buffers this way
            out = resize(storage, nbytes)
            tracker._resized(storage, nbytes)
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = resize_
        self._host_listener = listening(self._noted)
        self._host_listener.__enter__()
        self._recording = True
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        self._host_listener.__exit__(None, None, None)
        self._recording = False
        for handle in self._hook_handles + self._stack_handles:
            handle.remove()
        self._hook_handles, self._stack_handles = [], []
        return super().__exit__(*exc)

    def trace(self) -> Trace:
        return Trace(self.storages, list(self.events), list(self.phase_marks), self.start, list(self.block_marks),
                     list(self.raw_deltas), self.round_to)


def _first_grad_tensor(value) -> torch.Tensor | None:
    for tensor in tree_leaves(value):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
            return tensor
    return None
