"""A step's trace at another micro-batch, from its traces at two: no third trace.

A step's code path does not depend on how many sequences it runs (the trace shows the same storages born and
freed in the same order, with the same phase and layer marks), and each of its allocations either keeps its size
(weights, their gradients and states, a causal mask) or grows in proportion to the micro-batch (activations,
logits, the batch itself: one of their dimensions is the micro-batch). Both are checked on the two traces,
allocation by allocation, before unrounded sizes, and a trace that passes is rebuilt at the third micro-batch,
rounded as the tracker rounds. Anything else (a size that grows otherwise, a code path that changes, one size
not a whole number at the new micro-batch) raises NotInterpolable and the step is traced.

A traced search sizes each candidate at its two smallest micro-batches above one sequence (a batch of one takes paths
of its own) and reads larger ones off them (traced.reusing_traces); an estimate made this way says so in its notes.
"""
from __future__ import annotations

from dataclasses import replace

from memfit.estimators.tracker import Trace


class NotInterpolable(Exception):
    """The two traces do not determine the third: trace it."""


def _scaled(a: int, b: int, batch_a: int, batch_b: int, batch: int, what: str) -> int:
    """An allocation of `a` bytes at `batch_a` and `b` at `batch_b`: its bytes at `batch`."""
    if a == b:
        return a
    if a * batch_b != b * batch_a or (a * batch) % batch_a:
        raise NotInterpolable(f"{what}: {a} B at micro-batch {batch_a}, {b} B at {batch_b}")
    return a * batch // batch_a


def _shape(a: tuple, b: tuple, batch_a: int, batch: int) -> tuple:
    return tuple(x if x == y else x * batch // batch_a for x, y in zip(a, b))


def _same_structure(a: Trace, b: Trace) -> None:
    if (len(a.storages) != len(b.storages) or len(a.events) != len(b.events) or a.start != b.start
            or a.phase_marks != b.phase_marks or a.block_marks != b.block_marks or a.round_to != b.round_to
            or [sid for sid, _ in a.events] != [sid for sid, _ in b.events]):
        raise NotInterpolable("the step runs other operations at the two micro-batches")
    for x, y in zip(a.storages, b.storages):
        if ((x.phase, x.module, x.born, x.died, x.category, x.op, x.dtype, x.host, x.paged)
                != (y.phase, y.module, y.born, y.died, y.category, y.op, y.dtype, y.host, y.paged)
                or len(x.shape) != len(y.shape)):
            raise NotInterpolable(f"storage of {x.op or x.category} differs between the two micro-batches")


def interpolate(a: Trace, batch_a: int, b: Trace, batch_b: int, batch: int) -> Trace:
    """The trace at `batch` of the step traced as `a` at `batch_a` and `b` at `batch_b`."""
    _same_structure(a, b)
    round_to = a.round_to

    def rounded(n: int) -> int:
        return -(-n // round_to) * round_to

    storages = []
    for x, y in zip(a.storages, b.storages):
        raw = _scaled(x.raw_nbytes, y.raw_nbytes, batch_a, batch_b, batch, x.op or x.category or "a storage")
        storages.append(replace(x, raw_nbytes=raw, nbytes=rounded(raw) if raw else 0,
                                shape=_shape(x.shape, y.shape, batch_a, batch)))
    alive = [s.born == -1 for s in storages]
    raw_size = [s.raw_nbytes if held else 0 for s, held in zip(storages, alive)]
    size = [s.nbytes if held else 0 for s, held in zip(storages, alive)]
    events, raw_deltas = [], []
    for index, ((sid, _), ra, rb) in enumerate(zip(a.events, a.raw_deltas, b.raw_deltas)):
        storage = storages[sid]
        if index == storage.born:
            new_raw = storage.raw_nbytes
        elif index == storage.died:
            new_raw = 0
        else:   # resized in place (FSDP2's buffers)
            new_raw = raw_size[sid] + _scaled(ra, rb, batch_a, batch_b, batch, "a resize")
        events.append((sid, rounded(new_raw) - size[sid]))
        raw_deltas.append(new_raw - raw_size[sid])
        raw_size[sid], size[sid] = new_raw, rounded(new_raw)
    return Trace(storages, events, list(a.phase_marks), a.start, list(a.block_marks), raw_deltas, round_to)
