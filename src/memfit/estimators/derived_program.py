"""An analytic program derived from traces of one repeated block: a traceable transformer's training step at
analytic speed.

The model is traced with one layer at three shapes (micro-batches 2 and 3 at the target length, 2 at a second
length) on fake tensors, recording the autograd graph beside the storages (graph_recording.py). The three runs
must do the same thing in the same order; each dimension of each tensor is then a closed form in the micro-batch
B and the sequence length S — B^i·(a + b·S) — read off them, and a fourth trace (3 sequences at the second length)
checks every size. What the program keeps is the measured step's forward, split where the layer starts and ends,
and each backward node: the gradients it passes on, the storages it saved, the scratch it allocates while it runs.
The symbolic engine (analytic/families/derived.py) runs it at any micro-batch and depth, and composes what the
engine composes for every family (activation checkpointing and its offload, data parallel and FSDP2 sharding,
optimizers and their offload); a technique that replaces the loss is traced into the program with the block (a
checkpointed chunked loss: what its backward recomputes is carried from the node that runs it to the node that
frees it); one that changes what runs inside the block is traced.

Known gaps: a micro-batch of one takes paths of its own (views where larger ones copy: the program may count a
copy the real step skips); a gradient accumulated from two uses is added in place (autograd may allocate the sum).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction

from memfit.core.errors import NotModelled
from memfit.estimators.graph_recording import GraphTracker, NodeRecord
from memfit.estimators.traced import _trace_rank, tracking_granularity
from memfit.estimators.tracker import Trace
from memfit.specs.hardware import GPU
from memfit.specs.workload import Workload
from memfit.techniques.base import REGISTRY, Technique
from memfit.techniques.resolve import ResolvedWorkload, resolve

Factor = tuple[int, Fraction, Fraction]   # B^i·(a + b·S)


def numel(dims: tuple[Factor, ...], batch: int, seq: int) -> int:
    total = Fraction(1)
    for power, a, b in dims:
        total *= batch ** power * (a + b * seq)
    if total.denominator != 1 or total < 0:
        raise NotModelled(f"a derived size is not a whole number at micro-batch {batch}, length {seq}")
    return int(total)


@dataclass(frozen=True)
class Storage:
    dims: tuple[Factor, ...]
    dtype: str


@dataclass(frozen=True)
class Node:
    part: str                        # "pre" | "block" | "post"
    edges: tuple                     # (node index | None, parameter name | None, dims, dtype)
    saved: tuple[int, ...]           # storage ids
    scratch: tuple[int, ...]         # storage ids born and freed while it runs
    held: tuple[int, ...]            # storages the step held to here without autograd (freed as it runs)
    passthrough: bool                # passes its gradient on without allocating
    carries: tuple[int, ...] = ()    # storages a checkpoint recomputes as it runs, each freed by a later node ...
    drops: tuple[int, ...] = ()      # ... as that node runs


@dataclass(frozen=True)
class Parameter:
    name: str                        # "layers.{i}.<rest>" for the block's, else the model's own name
    storage: int
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    in_block: bool


@dataclass(frozen=True)
class DerivedProgram:
    storages: dict[int, Storage]
    parameters: tuple[Parameter, ...]
    buffers: tuple[int, ...]
    inputs: tuple[int, ...]
    parts: dict[str, tuple]          # "pre" | "block" | "post" -> (("birth" | "death", storage) | ("node", index))
    nodes: tuple[Node, ...]
    block_inputs: tuple[int, ...]
    block_outputs: tuple[int, ...]
    block_output_node: int
    root: int                        # the loss's node
    shapes: tuple[tuple[int, int], ...]   # (micro-batch, length) traced

    period = 1   # one layer traced: the depth extrapolation samples single layers

    @property
    def note(self) -> str:
        *traced, checked = (f"{b}x{s}" for b, s in self.shapes)
        return (f"analytic program derived from the model's traced block (one layer traced at micro-batch x length "
                f"{', '.join(traced)}, every size checked by a trace at {checked}; estimators/derived_program.py)")


class _Run:
    def __init__(self, workload: ResolvedWorkload, gpu: GPU | None) -> None:
        self.tracker = GraphTracker(round_to=tracking_granularity(gpu))
        run = _trace_rank(workload, gpu, 1, tracker=self.tracker)
        self.trace: Trace = run.trace
        if self.tracker.block is None or not self.tracker.nodes:
            raise NotModelled("no repeated layer or no backward graph was found in the trace")
        self.names: dict[int, tuple[str, tuple[int, ...], bool]] = {}
        for name, param in run.model.named_parameters():
            index = self.tracker.storage_index(param)
            if index is not None:
                self.names.setdefault(index, (name, tuple(param.shape), param.requires_grad))
        self.stack = next((name for name, module in run.model.named_modules() if module is run.stacks[0]), "")

    def measured(self) -> list[tuple[int, int]]:
        return list(self.trace.events[self.trace.start:])


def _structure(run: _Run) -> tuple:
    trace, nodes = run.trace, run.tracker.nodes
    base = nodes[0].seq
    return ([(sid, delta > 0) for sid, delta in run.measured()],
            [(s.op, s.dtype, len(s.shape), s.born == -1, s.category) for s in trace.storages],
            [(n.name, n.seq - base, [(q - base if q is not None else None, p) for q, p, _, _ in n.edges], n.saved)
             for n in nodes], trace.phase_marks[-3:])


def _fit(values: list[int], batches: tuple[int, int], seqs: tuple[int, int]) -> Factor:
    """One dimension at (B1, S1), (B2, S1), (B1, S2) -> B^i·(a + b·S)."""
    d1, d2, d3 = values
    (b1, b2), (s1, s2) = batches, seqs
    power = 0 if d1 == d2 else 1
    if power and d1 * b2 != d2 * b1:
        raise NotModelled(f"a size grows with the micro-batch other than in proportion ({d1} at {b1}, {d2} at {b2})")
    u1, u3 = Fraction(d1, b1 ** power), Fraction(d3, b1 ** power)
    slope = (u3 - u1) / (s2 - s1)
    return power, u1 - slope * s1, slope


def _dims(shapes: list[tuple[int, ...]], batches, seqs) -> tuple[Factor, ...]:
    if len({len(s) for s in shapes}) != 1:
        raise NotModelled("a tensor's rank changes with the shape")
    return tuple(_fit([s[k] for s in shapes], batches, seqs) for k in range(len(shapes[0])))


def _storage_shape(run: _Run, sid: int) -> tuple[int, ...]:
    """The storage's shape, or its element count where its first tensor did not cover it."""
    s = run.trace.storages[sid]
    count = math.prod(s.shape)
    itemsize = s.raw_nbytes // count if count else 0
    return s.shape if count and itemsize * count == s.raw_nbytes else (s.raw_nbytes,)


def _parts(run: _Run) -> tuple[dict[str, list], dict[int, str]]:
    """The measured forward's births, deaths and node creations, by part; each node's part."""
    trace, tracker, block = run.trace, run.tracker, run.tracker.block
    assert block is not None   # _Run checked
    marks = dict((name, index) for index, name in trace.measured_marks())
    forward, backward = marks.get("forward"), marks.get("backward")
    if forward is None or backward is None:
        raise NotModelled("the trace has no forward or backward phase")
    if not forward <= block.events[0] <= block.events[1] <= backward:
        raise NotModelled("the layer's forward was not found in the measured step")

    def part_of_event(index: int) -> str:
        return "pre" if index < block.events[0] else "block" if index < block.events[1] else "post"

    def part_of_seq(seq: int) -> str:
        return "pre" if seq < block.seq[0] else "block" if seq < block.seq[1] else "post"

    parts: dict[str, list] = {"pre": [], "block": [], "post": []}
    node_part = {}
    pending = list(enumerate(tracker.nodes))
    for index in range(forward, backward):
        while pending and tracker.event_seq[index] > pending[0][1].seq + 1:
            i, node = pending.pop(0)
            node_part[i] = part_of_seq(node.seq)
            parts[node_part[i]].append(("node", i))
        sid, delta = trace.events[index]
        parts[part_of_event(index)].append(("birth" if delta > 0 else "death", sid))
    for i, node in pending:
        node_part[i] = part_of_seq(node.seq)
        parts[node_part[i]].append(("node", i))
    return parts, node_part


def _node_extras(run: _Run, node: NodeRecord) -> tuple[list[int], bool]:
    """(storages born and freed while `node` ran, whether it passed its gradient on without allocating)."""
    trace = run.trace
    start, end = node.window
    if start < 0:
        return [], True
    born = [sid for sid, delta in trace.events[start:end] if delta > 0]
    died = {sid for sid, delta in trace.events[start:end] if delta < 0}
    return [sid for sid in born if sid in died], all(sid in died for sid in born)


def _node_running(run: _Run, event: int) -> int | None:
    """The backward node that was running at `event`, if one was."""
    return next((i for i, n in enumerate(run.tracker.nodes) if n.window[0] <= event < n.window[1]), None)


def _recomputed(run: _Run) -> dict[int, tuple[int, int]]:
    """What a checkpoint recomputes while a node whose saved tensors it packed runs: each storage born then that
    outlives that node, with the node whose run frees it (by storage: (carrying node, dropping node))."""
    trace, nodes = run.trace, run.tracker.nodes
    carried = {}
    for i, node in enumerate(nodes):
        start, end = node.window
        if not node.packed or start < 0:
            continue
        for index in range(start, end):
            sid, delta = trace.events[index]
            died = trace.storages[sid].died
            if delta > 0 and died is not None and died >= end and (at := _node_running(run, died)) is not None:
                carried[sid] = (i, at)
    return carried


def _held(run: _Run, saved: set[int]) -> dict[int, list[int]]:
    """Storages born in forward, saved by no node and freed in backward: the node whose run freed each."""
    trace, marks = run.trace, dict((n, i) for i, n in run.trace.measured_marks())
    held: dict[int, list[int]] = {}
    for index in range(marks["backward"], marks.get("optimizer", len(trace.events))):
        sid, delta = trace.events[index]
        s = trace.storages[sid]
        if (delta < 0 and s.born is not None and marks["forward"] <= s.born < marks["backward"] and sid not in saved
                and (at := _node_running(run, index)) is not None):
            held.setdefault(at, []).append(sid)
    return held


def _program(runs: list[_Run], batches, seqs) -> DerivedProgram:
    first = runs[0]
    trace, tracker = first.trace, first.tracker
    structure = _structure(first)
    if any(_structure(run) != structure for run in runs[1:]):
        raise NotModelled("the step runs other operations at other shapes")
    relevant = {sid for sid, _ in first.measured()} | {i for i, s in enumerate(trace.storages) if s.born == -1}
    storages = {sid: Storage(_dims([_storage_shape(run, sid) for run in runs], batches, seqs),
                             trace.storages[sid].dtype) for sid in sorted(relevant)}
    parts, node_part = _parts(first)
    block = tracker.block
    assert block is not None   # _Run checked
    prefix = first.stack + ".0."
    params, param_names = [], {}
    for sid, (name, shape, trainable) in first.names.items():
        in_block = name.startswith(prefix)
        short = "layers.{i}." + name[len(prefix):] if in_block else name
        params.append(Parameter(short, sid, shape, trace.storages[sid].dtype, trainable, in_block))
        param_names[sid] = short
    saved_anywhere = {sid for node in tracker.nodes for sid in node.saved}
    held = _held(first, saved_anywhere)
    by_seq = {node.seq: i for i, node in enumerate(tracker.nodes)}
    recomputed = _recomputed(first)
    nodes = []
    for i, node in enumerate(tracker.nodes):
        edges = []
        for k, (seq, param, _, dtype) in enumerate(node.edges):
            shapes = [run.tracker.nodes[i].edges[k][2] for run in runs]
            target = by_seq.get(seq) if seq is not None else None
            if seq is not None and target is None:
                continue   # a node outside the loss's graph (nothing reaches it)
            edges.append((target, param_names.get(param) if param is not None else None,
                          _dims([s if s else (1,) for s in shapes], batches, seqs), dtype))
        scratch, passthrough = _node_extras(first, node)
        nodes.append(Node(node_part[i], tuple(edges), tuple(node.saved), tuple(scratch), tuple(held.get(i, ())),
                          passthrough, tuple(sid for sid, (at, _) in recomputed.items() if at == i),
                          tuple(sid for sid, (_, at) in recomputed.items() if at == i)))
    posts = {edge[0] for node in nodes if node.part == "post" for edge in node.edges
             if edge[0] is not None and nodes[edge[0]].part == "block"}
    if len(posts) != 1:
        raise NotModelled("the layer's output could not be told apart")
    root = max(range(len(nodes)), key=lambda i: tracker.nodes[i].seq)
    if not block.inputs or not block.outputs:
        raise NotModelled("the layer's input or output hidden state was not found")
    inputs = tuple(i for i, s in enumerate(trace.storages) if s.born == -1 and s.category == "inputs")
    buffers = tuple(i for i, s in enumerate(trace.storages) if s.born == -1 and s.category == "buffers")
    return DerivedProgram(storages, tuple(params), buffers, inputs, {k: tuple(v) for k, v in parts.items()},
                          tuple(nodes), tuple(block.inputs), tuple(block.outputs), posts.pop(), root,
                          ((batches[0], seqs[0]), (batches[1], seqs[0]), (batches[0], seqs[1]), (batches[1], seqs[1])))


def _check(program: DerivedProgram, run: _Run, batch: int, seq: int) -> None:
    for sid, storage in program.storages.items():
        if numel(storage.dims, batch, seq) != math.prod(_storage_shape(run, sid)):
            raise NotModelled(f"the derived size of a {run.trace.storages[sid].op or 'storage'} misses the trace at "
                              f"micro-batch {batch}, length {seq}")


# ---- which workloads, and the cache --------------------------------------------------------------------------
_CACHE: dict[str, DerivedProgram | NotModelled] = {}


COMPOSED = frozenset({"around-blocks", "allocator-only"})   # the symbolic engine applies them to the program
RECORDED = frozenset({"replaces-loss"})   # they change the part after the blocks: traced into the program
# a recorded technique must leave the model the engine declares as it is (distillation's teacher does not)
_MODEL_HOOKS = ("analytic_spec", "analytic_layers", "analytic_model", "analytic_weights", "analytic_train")


def _takes(cls) -> bool:
    """Whether a derived program takes technique class `cls`: composed around the blocks, or recorded with them."""
    recorded = bool(cls.traits & RECORDED) and all(getattr(cls, hook) is getattr(Technique, hook)
                                                   for hook in _MODEL_HOOKS)
    return bool(cls.traits & COMPOSED) or recorded


def derived_techniques() -> list[str]:
    """The techniques a derived program takes that change a step's tensors."""
    return sorted(name for name, cls in REGISTRY.items() if _takes(cls) and "allocator-only" not in cls.traits)


def derivable(workload: ResolvedWorkload) -> bool:
    """A transformer's training step that only techniques composed around its blocks change, or ones traced into the
    program with it (their traits say which; the precision and optimizer are the workload's own)."""
    source = workload.source
    return (source.is_hf and source.model_type is not None and bool(source.num_layers)
            and workload.task == "train" and workload.step is None and workload.engine == "pytorch"
            and all(_takes(type(t)) for t in workload.technique_configs if t.workload_field is None))



def _recorded(workload: ResolvedWorkload) -> tuple[str, ...]:
    return tuple(t.spec for t in workload.technique_configs if t.workload_field is None and t.traits & RECORDED)


def _key(workload: ResolvedWorkload, gpu: GPU | None, seq: int) -> str:
    return json.dumps([workload.source.config_fields, workload.precision, _recorded(workload),
                       gpu.name if gpu else None, seq], sort_keys=True, default=str)


def _lengths(seq: int) -> tuple[int, int]:
    return (seq, seq // 2) if seq >= 16 else (seq, seq + 8)


def derived_program(workload: ResolvedWorkload, gpu: GPU | None,
                    peak_of: Callable[[ResolvedWorkload], int]) -> DerivedProgram:
    """The program of `workload`'s model at its precision on `gpu`'s kernels, derived once per config and length;
    `peak_of` runs it (one layer, on `gpu`) for the check against the fourth trace."""
    seq = workload.effective_seq_len
    key = _key(workload, gpu, seq)
    if key not in _CACHE:
        try:
            program, check = _derive(workload, gpu, _lengths(seq))
            # the check runs this program at the check's length: that length's key names it while it runs
            check_key = _key(workload, gpu, check[0].effective_seq_len)
            earlier = _CACHE.get(check_key)
            _CACHE[check_key] = program
            try:
                _held_to_its_trace(check, peak_of)
            finally:
                if earlier is None:
                    del _CACHE[check_key]
                else:
                    _CACHE[check_key] = earlier
            _CACHE[key] = program
        except NotModelled as exc:
            _CACHE[key] = exc
        except Exception as exc:   # a model the recording cannot follow: its trace still estimates it
            _CACHE[key] = NotModelled(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    found = _CACHE[key]
    if isinstance(found, NotModelled):
        raise NotModelled(f"no program could be derived from the trace ({found}); use --method traced.")
    return found


TOLERANCE = 0.02   # the program's peak against the fourth trace's, at that shape: beyond it the model is traced


def _held_to_its_trace(check: tuple[ResolvedWorkload, _Run], peak_of: Callable[[ResolvedWorkload], int]) -> None:
    """The program just cached, run at the fourth shape (`peak_of`: the symbolic engine's peak), against that
    shape's trace."""
    workload, run = check
    derived = peak_of(workload)
    traced = run.trace.summary()[0].total
    if abs(derived - traced) > TOLERANCE * traced:
        raise NotModelled(f"its peak at the check shape is {derived:,} B against the trace's {traced:,} B")


def _derive(workload: ResolvedWorkload, gpu: GPU | None,
            seqs: tuple[int, int]) -> tuple[DerivedProgram, tuple[ResolvedWorkload, _Run]]:
    plain = Workload(model=workload.model, task="train", precision=workload.precision,
                     allow_long_seq=workload.allow_long_seq, techniques=_recorded(workload))
    batches = (2, 3)

    def shaped(batch: int, seq: int) -> ResolvedWorkload:
        return resolve(replace(plain, batch_size=batch, seq_len=seq))

    runs = [_Run(shaped(b, s), gpu) for b, s in ((batches[0], seqs[0]), (batches[1], seqs[0]), (batches[0], seqs[1]))]
    program = _program(runs, batches, seqs)
    check = shaped(batches[1], seqs[1])
    checked = _Run(check, gpu)
    if _structure(checked) != _structure(runs[0]):
        raise NotModelled("the step runs other operations at a fourth shape")
    _check(program, checked, batches[1], seqs[1])
    return program, (check, checked)
