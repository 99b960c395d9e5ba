"""The planner's estimates on every CPU core: its candidates are independent of each other, and a search spends
tens of milliseconds per analytic estimate (a 70B model's) and about a second per traced one (a custom model's).

Worker processes are forked from the planner, so they inherit the job and everything it reads (nothing is pickled
but what they send back). The planner asks for the results in its own order, so a plan is the one one process
would find; the workers keep computing the items after the one it waits for, work that the search's stopping rule
may throw away. One process where fork does not exist (Windows, macOS's default), inside a daemonic process (it may
not have children), once the process has started CUDA (a forked child could not use it) and on one core
(forked_workers).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from memfit.estimators.analytic.simulate import derive_ahead
from memfit.estimators.kernels import count_profile, counted, profile_key, remember
from memfit.planner.search import Evaluated, Search
from memfit.planner.space import Candidate, candidates
from memfit.techniques.base import parse_technique
from memfit.techniques.resolve import ResolvedWorkload

Item = tuple[Candidate, ResolvedWorkload, int]   # a candidate, its smallest workload, sequences per replica

_inherited_job: Callable[[int], Any] | None = None   # in a worker: the job it was forked with
RESULT_WAIT_S = 120.0   # the longest the planner waits for an item computed ahead before it stops the workers


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _start_worker(job: Callable[[int], Any]) -> None:
    global _inherited_job
    _inherited_job = job
    torch.set_num_threads(1)   # one core each: the workers share the machine


def _run(index: int) -> Any:
    assert _inherited_job is not None   # a worker runs it: _start_worker set the job
    return _inherited_job(index)


def forked_workers(count: int) -> int:
    """How many worker processes `count` items get: 0 (computed in this process) where fork does not exist, in a
    daemonic process, once CUDA has started (a forked child cannot use it) or on one core."""
    workers = min(usable_cores(), count)
    can_fork = ("fork" in multiprocessing.get_all_start_methods() and not multiprocessing.current_process().daemon
                and not torch.cuda.is_initialized())
    return workers if workers > 1 and can_fork else 0


@contextmanager
def forked(job: Callable[[int], Any], count: int) -> Iterator[Callable[[int], Any]]:
    """A function from i to `job(i)` (0 <= i < `count`, asked for in increasing order), computed ahead on every
    core where this machine allows it, else when asked."""
    workers = forked_workers(count)
    if not workers:
        yield job
        return
    pool = multiprocessing.get_context("fork").Pool(workers, _start_worker, (job,))
    pending: dict[int, multiprocessing.pool.AsyncResult] = {}
    submitted = 0

    def result(index: int) -> Any:
        nonlocal submitted
        while True:   # every worker kept busy: the items after `index` are computed while it is
            while submitted < count and sum(not p.ready() for p in pending.values()) < workers:
                pending[submitted] = pool.apply_async(_run, (submitted,))
                submitted += 1
            if pending[index].ready():
                return pending.pop(index).get()
            pending[index].wait(0.05)

    try:
        yield result
    finally:
        # items computed ahead that the planner no longer needs are dropped, but only once none is being sent back:
        # a worker killed while it sends its result keeps the result queue's lock, and Pool.terminate then waits
        # on that lock forever (seen once in the test suite)
        for ahead in pending.values():
            ahead.wait(RESULT_WAIT_S)
        pool.terminate()
        pool.join()


@contextmanager
def profiles_counted_alongside(search: Search) -> Iterator[None]:
    """The kernel profiles the search's candidates will read (one per precision and attention technique: the
    step-time model's, estimators/kernels.py), counted in a worker process while this one enumerates the
    candidates, and kept for this process as the block ends. Counting one first imports the model's own code
    (transformers' modeling module: about 1.5 s), which the enumeration now hides. Where no worker can be forked,
    they are counted when first read."""
    request, base = search.request, search.base
    capability = request.gpu.kernels
    keys = list(dict.fromkeys(
        profile_key(base, capability, precision=candidate.precision,
                    attention=tuple(spec for spec in candidate.techniques
                                    if parse_technique(spec).search_axis == "attention"))
        for candidate in candidates(request, base)))
    keys = [key for key in keys if not counted(key)]
    if not forked_workers(len(keys)):
        yield
        return
    pool = multiprocessing.get_context("fork").Pool(forked_workers(len(keys)), _start_worker, (None,))
    pending = pool.map_async(count_profile, keys)
    try:
        yield
        for key, profile in zip(keys, pending.get(), strict=True):
            remember(key, profile)
    finally:
        pool.terminate()
        pool.join()


def derive_programs_ahead(search: Search, workloads: list[ResolvedWorkload]) -> None:
    """The programs derived from traces (a model without a written family) that the workers will need, derived once
    here before they fork, not once in each."""
    if search.request.method != "traced":
        derive_ahead(workloads, None if search.request.on_cpu else search.request.gpu)


@contextmanager
def sizing(search: Search, items: list[Item]) -> Iterator[Callable[[int], Evaluated | None]]:
    """A function from a candidate's index in `items` to its sizing (search.evaluate), computed ahead on every core
    (see forked); the estimates a worker made and the refusals it met join the search's."""
    def size(index: int) -> tuple[Evaluated | None, dict, Counter, int]:
        known, rejected, made = set(search.estimated), Counter(search.rejected), search.num_estimates
        result = search.evaluate(*items[index])
        new = {key: value for key, value in search.estimated.items() if key not in known}
        return result, new, search.rejected - rejected, search.num_estimates - made

    if not forked_workers(len(items)):   # in this process: evaluate adds to the search itself
        yield lambda index: search.evaluate(*items[index])
        return
    derive_programs_ahead(search, [workload for _, workload, _ in items])
    with forked(size, len(items)) as sized:
        def merged(index: int) -> Evaluated | None:
            result, estimates, rejected, made = sized(index)
            search.estimated.update(estimates)
            search.rejected.update(rejected)
            search.num_estimates += made
            return result

        yield merged
