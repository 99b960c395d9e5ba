"""The engine's scheduler, simulated step by step over a load (load.py), each step timed by step_model.py.

Policies, as the engines schedule:
  vllm-v1   (vLLM >= 0.8) one token budget per step (max_num_batched_tokens): the running requests first (a decode's
            one token, or the next chunk of an unfinished prompt), then waiting requests in arrival order while
            fewer than max_num_seqs run and the budget and the KV cache's free blocks allow — prompts chunked to fit
            the budget. A running request that needs a block when none is free preempts the latest-admitted one
            (recompute: its blocks are freed and it waits again at the queue's head); no new request is admitted
            in a step that preempted.
  vllm-v0   (vLLM < 0.8) without chunked prefill: a step prefills whole prompts (up to max_num_batched_tokens, if the
            cache holds them) whenever any wait, else decodes every running request; with chunked prefill (a long
            context) as vllm-v1.
  sglang    a step prefills waiting prompts (chunks of chunked_prefill_size) whenever they fit, else decodes.

A request's first token comes at the end of the step that computes its prompt's last token, then one token per step
it is scheduled in; it finishes at output_len tokens and frees its blocks. The client's side: requests are sent at
their arrival times, at most max_concurrency outstanding (a slot frees when its last token comes). Not modelled: the
API server's own time (HTTP, chat template, tokenizing in; detokenizing and one JSON chunk per token out), which the
client's figures include.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from memfit.serving.block_pool import BlockPool
from memfit.serving.load import Load
from memfit.serving.step_model import StepModel

POLICIES = ("vllm-v1", "vllm-v0", "sglang")
TIMELINE = ("time_s", "running", "waiting", "kv_blocks", "tokens", "requests", "preempted", "output_tokens")
MAX_STEPS = 2_000_000


@dataclass
class Request:
    index: int
    prompt: int
    output: int
    prefix: int = 0            # leading prompt tokens every request shares (the prefix cache can hit them)
    sent: float = 0.0
    computed: int = 0          # tokens whose keys and values are cached
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    hashed: int = 0            # of its blocks, how many the prefix cache holds a hash of
    first: float | None = None         # when its first token comes (the end of that step)
    end: float | None = None           # and its last

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        """Tokens to compute before the next token is sampled (a resumed request recomputes its answer so far)."""
        return self.tokens - self.computed

    def key(self, block: int, size: int) -> tuple:
        """The identity of the content of its `block`-th block (what vLLM hashes)."""
        return ("prefix", block) if (block + 1) * size <= self.prefix else (self.index, block)


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int
    token_budget: int          # max_num_batched_tokens (SGLang: chunked_prefill_size for prefills)
    blocks: int                # KV blocks the requests may hold
    block_size: int
    chunked: bool = True       # a prompt may be split over steps
    whole_prompt_fits: bool = False   # vLLM from 0.19: a new request waits until its whole prompt's blocks are free
    prefix_caching: bool = False      # vLLM V1: full blocks are hashed and hit by later requests (block_pool.py)


@dataclass
class Run:
    requests: list[Request]
    steps: int = 0
    preemptions: int = 0
    # per step: when it ends; as scheduled (before the step's finished requests leave): requests running and waiting,
    # KV blocks held, tokens and requests scheduled, requests preempted; then the tokens it output
    timeline: dict = field(default_factory=lambda: {key: [] for key in TIMELINE})


def simulate(load: Load, limits: Limits, model: StepModel, policy: str) -> Run:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    size = limits.block_size
    requests = [Request(i, p, o, prefix=load.prefix_len) for i, (p, o) in enumerate(load.requests())]
    arrivals = load.arrivals()
    slots = load.max_concurrency or len(requests)
    free_slots = [0.0] * min(slots, len(requests))   # when each client slot is next free
    heapq.heapify(free_slots)
    unsent = list(range(len(requests)))[::-1]        # popped from the end: arrival order
    waiting: deque[Request] = deque()
    running: list[Request] = []
    finished: set[int] = set()
    pool = BlockPool(limits.blocks, limits.prefix_caching)
    run = Run(requests)
    now = 0.0

    def send_due() -> None:
        while unsent and free_slots:
            index = unsent[-1]
            at = max(arrivals[index], free_slots[0])
            if at > now:
                return
            heapq.heappop(free_slots)
            unsent.pop()
            requests[index].sent = at
            waiting.append(requests[index])

    def hash_full_blocks(request: Request, tokens: int) -> None:
        for block in range(request.hashed, tokens // size):
            pool.cache(request.blocks[block], request.key(block, size))
        request.hashed = max(request.hashed, tokens // size)

    def preempt(victim: Request) -> None:
        pool.release(victim.blocks)
        victim.blocks, victim.hashed, victim.computed = [], 0, 0
        run.preemptions += 1
        waiting.appendleft(victim)

    while unsent or waiting or running:
        send_due()
        if not waiting and not running:
            now = max(arrivals[unsent[-1]], free_slots[0])
            continue
        scheduled: list[tuple[Request, int]] = []
        budget = limits.token_budget
        preempted = False
        preemptions = run.preemptions
        prefill_only = policy != "vllm-v1" and not (policy == "vllm-v0" and limits.chunked) and \
            _admissible(waiting, running, limits, pool.num_free, budget)
        index = 0
        while not prefill_only and index < len(running):
            request = running[index]
            new = min(request.pending, budget)
            if new <= 0:
                break
            need = max(0, -(-(request.computed + new) // size) - len(request.blocks))
            while need > pool.num_free:   # preempt the latest-admitted request (recompute)
                victim = running.pop()
                preempt(victim)
                preempted = True
                if victim is request:
                    break
            if index >= len(running):   # the request preempted itself
                break
            request.blocks += pool.allocate(need)
            hash_full_blocks(request, request.computed + new)
            budget -= new
            scheduled.append((request, new))
            index += 1
        if not preempted and (policy == "vllm-v1" or prefill_only or (policy == "vllm-v0" and limits.chunked)):
            while waiting and len(running) < limits.max_num_seqs and budget > 0:
                request = waiting[0]
                hits = pool.hits([request.key(b, size) for b in range((request.tokens - 1) // size)])
                cached = len(hits) * size
                new = min(request.tokens - cached, budget)
                if new < request.tokens - cached and not limits.chunked:
                    break
                touched = pool.evictable(hits)
                need = -(-(cached + new) // size) - len(hits) + touched
                whole = -(-request.tokens // size) - len(hits) + touched
                if need > pool.num_free or (limits.whole_prompt_fits and whole > pool.num_free):
                    break
                waiting.popleft()
                running.append(request)
                pool.touch(hits)
                request.blocks = hits + pool.allocate(need - touched)
                request.hashed, request.computed = len(hits), cached
                hash_full_blocks(request, cached + new)
                budget -= new
                scheduled.append((request, new))
        if not scheduled:   # nothing fits: the head of the queue can never run (a prompt beyond the cache)
            raise RuntimeError("a request cannot be scheduled: its prompt needs more KV blocks than the cache has")
        as_scheduled = (len(running), len(waiting), pool.total - pool.num_free, sum(new for _, new in scheduled),
                        len(scheduled), run.preemptions - preemptions)
        prefills = [(new, r.computed) for r, new in scheduled if not (r.generated and r.pending == 1)]
        decodes = [r.computed for r, new in scheduled if r.generated and r.pending == 1]
        sampled = sum(1 for r, new in scheduled if new == r.pending)
        now += model.seconds(prefills, decodes, sampled)
        out = 0
        for request, new in scheduled:
            request.computed += new
            if request.computed == request.prompt + request.generated:
                request.generated += 1
                out += 1
                if request.first is None:
                    request.first = now
                if request.generated >= request.output:
                    request.end = now
                    pool.release(request.blocks)
                    request.blocks = []
                    finished.add(id(request))
                    heapq.heappush(free_slots, now)
        if finished:
            running = [r for r in running if id(r) not in finished]
            finished.clear()
        run.steps += 1
        for key, value in zip(TIMELINE, (now, *as_scheduled, out)):
            run.timeline[key].append(value)
        if run.steps > MAX_STEPS:
            raise RuntimeError("the simulation did not finish")
    return run


def _admissible(waiting: deque[Request], running: list[Request], limits: Limits, free_blocks: int,
                budget: int) -> bool:
    """Whether a prefill step can start the queue's head (prefill-first policies)."""
    if not waiting or len(running) >= limits.max_num_seqs:
        return False
    head = waiting[0]
    new = min(head.pending, budget)
    if new < head.pending and not limits.chunked:
        return False
    return math.ceil((head.computed + new) / limits.block_size) - len(head.blocks) <= free_blocks
