"""vLLM V1's pool of KV-cache blocks as its scheduler uses it (vllm/v1/core/block_pool.py, kv_cache_manager.py), for
the prefix cache: which blocks are free, which full blocks carry a hash a later request can hit, and how many
requests share each block.

- Allocation takes blocks from the front of the free queue; a block taken that carried a hash leaves the cache.
- A request's full blocks are hashed when it is scheduled to compute them (a later request, even in the same step,
  can hit them). A block's hash here is its content's identity: ("prefix", i) for the i-th block inside the prompt
  prefix every request shares, else (the request, i).
- A new (or preempted) request hits the longest run of its leading blocks the cache holds, at most its tokens - 1
  (the last token is recomputed for its logits); a hit block nobody holds leaves the free queue ("touched").
- Freeing walks a request's blocks last to first: a block with a hash goes to the back of the queue (least recently
  freed is evicted first), one without to the front (reused first).
With the prefix cache off no block has a hash, and the pool is a count of free blocks.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockPool:
    def __init__(self, blocks: int, caching: bool) -> None:
        self.caching = caching
        self.free: deque[int] = deque(range(blocks))
        self.refs = [0] * blocks
        self.key_of: dict[int, Hashable] = {}
        self.cached: dict[Hashable, int] = {}
        self.total = blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def hits(self, keys: list[Hashable]) -> list[int]:
        """The cached blocks of the longest leading run of `keys`."""
        found = []
        if self.caching:
            for key in keys:
                block = self.cached.get(key)
                if block is None:
                    break
                found.append(block)
        return found

    def evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` sit in the free queue (nobody holds them): touching them takes free blocks."""
        return sum(1 for b in blocks if self.refs[b] == 0)

    def touch(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.refs[block] == 0:
                self.free.remove(block)
            self.refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        taken = [self.free.popleft() for _ in range(count)]
        for block in taken:
            key = self.key_of.pop(block, None)
            if key is not None and self.cached.get(key) == block:
                del self.cached[key]
            self.refs[block] = 1
        return taken

    def cache(self, block: int, key: Hashable) -> None:
        if self.caching and key not in self.cached and block not in self.key_of:
            self.cached[key] = block
            self.key_of[block] = key

    def release(self, blocks: list[int]) -> None:
        """A request lets go of `blocks` (in its order)."""
        first: list[int] = []
        last: list[int] = []
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                (last if block in self.key_of else first).append(block)
        self.free.extendleft(reversed(first))
        self.free.extend(last)
