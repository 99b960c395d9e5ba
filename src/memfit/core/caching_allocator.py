"""PyTorch's CUDA caching allocator, simulated: a step's allocations and frees replayed through the allocator's
rules give what `torch.cuda.max_memory_reserved()` would report, and how much of it no tensor used.

The rules, by the function of c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.13) that each follows:

- round_size: a request rounds up to a multiple of 512 bytes (kMinBlockSize); a 0-byte tensor allocates nothing.
- get_pool: a request of at most 1 MiB (kSmallSize) uses the small pool, the rest the large pool. Blocks are
  found per stream (BlockComparatorSize orders the free blocks by stream, size, then address).
- get_free_block: best fit, the smallest free block of the stream that is large enough (the lowest address among
  equals). With max_split_size, a request under it never takes a block at or over it, and a request at or over
  it takes no block kLargeBuffer (20 MiB) or more larger than itself.
- get_allocation_size: no free block fits, so a new segment is cudaMalloc'd: 2 MiB (kSmallBuffer) for a small
  request, 20 MiB (kLargeBuffer) under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge).
- should_split: the block found is split when what remains is at least 512 bytes (small pool, or expandable
  segments), or more than 1 MiB for a large-pool request under max_split_size; the request takes the front.
- free_block / try_merge_blocks: a freed block merges with free neighbours of its segment.
- malloc, when cudaMalloc fails (the device is full): release_available_cached_blocks (only with max_split_size:
  free cached oversize segments), retry; release_cached_blocks (every free block that is a whole segment), retry;
  else out of memory.
- expandable segments (find_expandable_block, map_block, try_allocate_expandable_block, unmap_block): one segment
  per stream and pool, a reserved address range mapped in pages of 2 MiB (small pool) or 20 MiB (large pool). A
  request no free block holds maps pages at the lowest address with room, starting in the free block just before
  the unmapped range when there is one. Releasing the cache unmaps the whole pages inside free blocks.

Not modelled: CUDA graphs' private pools, cross-stream uses (record_stream) that delay a free until an event,
garbage_collection_threshold, roundup_power2_divisions, and the allocator of another library (NCCL's own
buffers). cuBLAS's workspaces come through this allocator: gpu_overhead.py adds them to the events it replays, and
predicts a deep model's reserve from a replay at fewer layers (predict_reserve).
"""
from __future__ import annotations

import itertools
from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field, replace
from typing import Literal, TypeGuard

from memfit.core.units import MiB

MIN_BLOCK_SIZE = 512            # kMinBlockSize
SMALL_SIZE = 1 * MiB            # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 * MiB          # kSmallBuffer: a small-pool segment, and an expandable small-pool page
LARGE_BUFFER = 20 * MiB         # kLargeBuffer: a segment for requests under kMinLargeAlloc; an expandable page
MIN_LARGE_ALLOC = 10 * MiB      # kMinLargeAlloc
ROUND_LARGE = 2 * MiB           # kRoundLarge
_ADDRESS_SPACE = LARGE_BUFFER << 24   # one segment's address range (an expandable one reserves it, unmapped):
#                                        segments start on a multiple of both page sizes


@dataclass(frozen=True)
class AllocatorSettings:
    """PYTORCH_CUDA_ALLOC_CONF, as far as this module simulates it."""

    expandable_segments: bool = False
    max_split_size: int | None = None   # bytes (max_split_size_mb); None: no limit
    empty_cache_between_phases: bool = False   # torch.cuda.empty_cache() as each phase starts (release-cache)
    empty_cache_before_step: bool = False      # the cache emptied before the measured step: CUDA graphs' capture
    #                                            in the warm-up (compile:mode=reduce-overhead) calls empty_cache


@dataclass(eq=False)
class _Block:
    stream: Hashable
    small: bool
    address: int
    size: int
    expandable: bool = False
    allocated: bool = False
    mapped: bool = True
    prev: _Block | None = None
    next: _Block | None = None
    serial: int = field(default_factory=itertools.count().__next__)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.size, self.address, self.serial)

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class OutOfMemory(Exception):
    """cudaMalloc failed even after the allocator released its cache."""


@dataclass
class _Pool:
    free: list[tuple[int, int, int]] = field(default_factory=list)   # sorted keys of the free, mapped blocks
    unmapped: list[tuple[int, int]] = field(default_factory=list)    # sorted (address, serial) of unmapped ranges


class CachingAllocator:
    """One device's caching allocator. `capacity`: the bytes cudaMalloc can still get (None: unlimited)."""

    def __init__(self, settings: AllocatorSettings | None = None, capacity: int | None = None) -> None:
        self.settings = settings or AllocatorSettings()
        self.capacity = capacity
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.allocated_at_peak_reserved = 0
        self.cache_flushes = 0
        self._pools: dict[tuple[bool, Hashable], _Pool] = {}
        self._blocks: dict[int, _Block] = {}    # every free or unmapped block by serial (the pools' keys name them)
        self._next_address = 0

    # ---- the allocator's entry points ------------------------------------------------------------
    def malloc(self, nbytes: int, stream: Hashable = 0) -> _Block | None:
        if nbytes <= 0:
            return None
        size = max(MIN_BLOCK_SIZE, -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE)
        small = size <= SMALL_SIZE
        pool = self._pool(small, stream)
        block: _Block | Literal[False] | None   # False: a cache release below made no room
        block = self._free_block(pool, size)
        if block is None:
            block = (self._new_block(pool, small, stream, size)
                     or (self._release_oversize(pool, size) and self._new_block(pool, small, stream, size))
                     or (self._release_cache() and self._new_block(pool, small, stream, size)))
            if not block:
                raise OutOfMemory(f"a {size:,}-byte request with {self.reserved:,} bytes reserved")
        if self._should_split(block, size):
            rest = _Block(stream, small, block.address + size, block.size - size, block.expandable,
                          prev=block, next=block.next)
            if block.next:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(pool, rest)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        # fragmentation at the peak: reserved less allocated at the busiest moment of the reserved peak (with a warm
        # cache the reserved figure stays flat while the tensors fill it)
        if self.reserved > self.peak_reserved or (self.reserved == self.peak_reserved
                                                  and self.allocated > self.allocated_at_peak_reserved):
            self.peak_reserved, self.allocated_at_peak_reserved = self.reserved, self.allocated
        return block

    def free(self, block: _Block | None) -> None:
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        pool = self._pool(block.small, block.stream)
        for neighbour in (block.prev, block.next):
            self._merge(pool, block, neighbour)
        self._insert(pool, block)

    def reset_peaks(self) -> None:
        """torch.cuda.reset_peak_memory_stats(): the peaks restart from what is reserved and allocated now."""
        self.peak_reserved, self.peak_allocated = self.reserved, self.allocated
        self.allocated_at_peak_reserved = self.allocated

    def empty_cache(self) -> bool:
        """release_cached_blocks: whole free segments go back to the driver; expandable ones unmap free pages."""
        for pool in list(self._pools.values()):
            for key in list(pool.free):
                block = self._blocks.get(key[2])
                if block is None or block.allocated:
                    continue
                if block.expandable:
                    self._unmap(pool, block)
                elif not block.is_split():
                    self._remove(pool, block)
                    self.reserved -= block.size
        return True

    # ---- finding and making blocks -----------------------------------------------------------------
    def _pool(self, small: bool, stream: Hashable) -> _Pool:
        return self._pools.setdefault((small, stream), _Pool())

    def _free_block(self, pool: _Pool, size: int) -> _Block | None:
        """get_free_block."""
        index = bisect_left(pool.free, (size, -1, -1))
        if index == len(pool.free):
            return None
        block = self._blocks[pool.free[index][2]]
        if block.expandable:   # best fit counts the unmapped room after a block as its own
            def room(b: _Block) -> int:
                return b.size + (b.next.size if b.next and not b.next.mapped else 0)
            for later in itertools.islice(pool.free, index + 1, None):
                candidate = self._blocks[later[2]]
                if not (block.expandable and room(candidate) < room(block)):
                    break
                block = candidate
        limit = self.settings.max_split_size
        if limit is not None and (size < limit <= block.size
                                  or (size >= limit and block.size >= size + LARGE_BUFFER)):
            return None
        self._remove(pool, block)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.settings.expandable_segments:
            return remaining >= MIN_BLOCK_SIZE
        limit = self.settings.max_split_size
        return (limit is None or size < limit) and remaining > SMALL_SIZE

    def _fits_device(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _new_block(self, pool: _Pool, small: bool, stream: Hashable, size: int) -> _Block | None:
        """alloc_block: a new cudaMalloc'd segment, or more pages of an expandable one."""
        if self.settings.expandable_segments:
            return self._expand(pool, small, stream, size)
        if size <= SMALL_SIZE:
            segment = SMALL_BUFFER
        elif size < MIN_LARGE_ALLOC:
            segment = LARGE_BUFFER
        else:
            segment = -(-size // ROUND_LARGE) * ROUND_LARGE
        if not self._fits_device(segment):
            return None
        self.reserved += segment
        return _Block(stream, small, self._new_address(), segment)

    def _new_address(self) -> int:
        self._next_address += _ADDRESS_SPACE
        return self._next_address

    def _release_oversize(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks: with max_split_size, free cached oversize segments (the smallest one
        large enough, else the largest first until enough is freed)."""
        limit = self.settings.max_split_size
        if limit is None:
            return False
        wanted = max(size, limit)
        whole = [self._blocks[k[2]] for k in pool.free if not self._blocks[k[2]].is_split()
                 and self._blocks[k[2]].size >= limit and not self._blocks[k[2]].expandable]
        large_enough = [b for b in whole if b.size >= wanted]
        chosen = large_enough[:1] if large_enough else []
        if not chosen:
            released = 0
            for block in reversed(whole):
                if released >= wanted:
                    break
                chosen.append(block)
                released += block.size
            if released < wanted:
                return False
        for block in chosen:
            self._remove(pool, block)
            self.reserved -= block.size
        return True

    def _release_cache(self) -> bool:
        """malloc's last resort before out of memory (counted: each one synchronizes the device)."""
        self.cache_flushes += 1
        return self.empty_cache()

    # ---- expandable segments -----------------------------------------------------------------------
    def _page(self, small: bool) -> int:
        return SMALL_BUFFER if small else LARGE_BUFFER

    def _expand(self, pool: _Pool, small: bool, stream: Hashable, size: int) -> _Block | None:
        """try_allocate_expandable_block: map pages at the lowest address with `size` bytes of room."""
        candidate = self._expandable_room(pool, small, stream, size)
        if not candidate.mapped and not self._map(pool, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None   # _expandable_room found `size` bytes of room from `candidate` on
            if not self._map(pool, following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        self._remove(pool, candidate)
        return candidate

    def _expandable_room(self, pool: _Pool, small: bool, stream: Hashable, size: int) -> _Block:
        """find_expandable_block."""
        def available(b: _Block | None) -> TypeGuard[_Block]:
            return b is not None and not b.allocated

        for _, block_id in pool.unmapped:
            start = self._blocks[block_id]
            if available(start.prev):
                start = start.prev
            b: _Block | None
            room, b = 0, start
            while room < size and available(b):
                room += b.size
                b = b.next
            if room >= size:
                return start
        segment = _Block(stream, small, self._new_address(), _ADDRESS_SPACE - self._page(small), expandable=True,
                         mapped=False)
        self._blocks[segment.serial] = segment
        insort(pool.unmapped, (segment.address, segment.serial))
        return segment

    def _map(self, pool: _Pool, block: _Block, size: int) -> bool:
        """map_block: map the pages that hold the first `size` bytes of an unmapped range."""
        page = self._page(block.small)
        mapped = min(block.size, -(-size // page) * page)
        if not self._fits_device(mapped):
            return False
        pool.unmapped.remove((block.address, block.serial))
        if mapped < block.size:
            rest = _Block(block.stream, block.small, block.address + mapped, block.size - mapped, True,
                          mapped=False, prev=block, next=block.next)
            if block.next:
                block.next.prev = rest
            block.next, block.size = rest, mapped
            self._blocks[rest.serial] = rest
            insort(pool.unmapped, (rest.address, rest.serial))
        block.mapped = True
        for neighbour in (block.prev, block.next):
            self._merge(pool, block, neighbour)
        self._insert(pool, block)
        self.reserved += mapped
        return True

    def _unmap(self, pool: _Pool, block: _Block) -> None:
        """unmap_block: the whole pages inside a free block are unmapped; its partial pages stay mapped."""
        page = self._page(block.small)
        begin = -(-block.address // page) * page
        end = (block.address + block.size) // page * page
        if end <= begin:
            return
        self._remove(pool, block)
        if begin > block.address:
            before = _Block(block.stream, block.small, block.address, begin - block.address, True,
                            prev=block.prev, next=block)
            if block.prev:
                block.prev.next = before
            block.prev = before
            self._insert(pool, before)
        if end < block.address + block.size:
            after = _Block(block.stream, block.small, end, block.address + block.size - end, True,
                           prev=block, next=block.next)
            if block.next:
                block.next.prev = after
            block.next = after
            self._insert(pool, after)
        block.address, block.size, block.mapped = begin, end - begin, False
        self.reserved -= block.size
        for neighbour in (block.prev, block.next):
            self._merge(pool, block, neighbour)
        self._blocks[block.serial] = block
        insort(pool.unmapped, (block.address, block.serial))

    # ---- free lists -----------------------------------------------------------------------------------
    def _insert(self, pool: _Pool, block: _Block) -> None:
        self._blocks[block.serial] = block
        insort(pool.free, block.key)

    def _remove(self, pool: _Pool, block: _Block) -> None:
        index = bisect_left(pool.free, block.key)
        if index < len(pool.free) and pool.free[index] == block.key:
            del pool.free[index]
        self._blocks.pop(block.serial, None)

    def _merge(self, pool: _Pool, block: _Block, neighbour: _Block | None) -> None:
        """try_merge_blocks: `block` takes in a free neighbour in the same mapped state."""
        if neighbour is None or neighbour.allocated or neighbour.mapped != block.mapped:
            return
        if neighbour.mapped:
            self._remove(pool, neighbour)
        else:
            pool.unmapped.remove((neighbour.address, neighbour.serial))
            self._blocks.pop(neighbour.serial, None)
        if neighbour is block.prev:
            block.address, block.prev = neighbour.address, neighbour.prev
            if block.prev:
                block.prev.next = block
        else:
            block.next = neighbour.next
            if block.next:
                block.next.prev = block
        block.size += neighbour.size


@dataclass(frozen=True)
class Replay:
    """What the simulated allocator reports over a replayed step."""

    reserved_bytes: int          # the peak of reserved memory (max_memory_reserved)
    allocated_bytes: int         # the peak of allocated memory (max_memory_allocated)
    fragmentation_bytes: int     # reserved minus allocated at the busiest moment of the reserved peak
    cache_flushes: int = 0       # times the allocator released its cache to retry a failed cudaMalloc
    out_of_memory: bool = False  # the device ran out even after releasing the cache
    setup_reserved_bytes: int = 0   # the reserved peak before the measured step (loading, quantizing, warm-up)
    start_reserved_bytes: int = 0   # what the set-up (before the warm-up) leaves reserved into the step

    def to_json(self) -> dict:
        return {"reserved_bytes": self.reserved_bytes, "allocated_bytes": self.allocated_bytes,
                "fragmentation_bytes": self.fragmentation_bytes, "cache_flushes": self.cache_flushes,
                "out_of_memory": self.out_of_memory, "setup_reserved_bytes": self.setup_reserved_bytes,
                "start_reserved_bytes": self.start_reserved_bytes}


Event = tuple[Hashable, int, Hashable]   # (tensor, the bytes it holds from now on (0: freed), stream)
PHASE_START = "<phase start>"            # an event's tensor: a phase of the step (forward, backward, ...) starts
STEP_START = "<measured step>"           # an event's tensor: the measured step starts (its peaks reset there)


def replay(events: Iterable[Event], settings: AllocatorSettings | None = None, capacity: int | None = None) -> Replay:
    """Run the events through a fresh allocator. A tensor whose size changes (a storage resized in place, as
    FSDP2 does) frees its block and takes a new one; a phase start empties the cache when the settings say so.
    The measured step's start resets the peaks, as `torch.cuda.reset_peak_memory_stats()` does there (the
    reserved peak restarts from what is reserved then: the cache that loading and the warm-up left, unless the
    settings empty it first); what came before is reported as `setup_reserved_bytes`, and what the set-up alone
    (the events before the first marker: loading, a conversion on the device) leaves reserved into the measured
    step as `start_reserved_bytes`."""
    allocator = CachingAllocator(settings, capacity)
    blocks: dict[Hashable, _Block | None] = {}
    setup_peak = 0
    left_by_setup: int | None = None   # reserved as the set-up ends; 0 once the cache is emptied after it
    try:
        for key, nbytes, stream in events:
            if key in (PHASE_START, STEP_START):
                left_by_setup = allocator.reserved if left_by_setup is None else left_by_setup
                if key == STEP_START:
                    setup_peak = allocator.peak_reserved
                if (allocator.settings.empty_cache_between_phases if key == PHASE_START
                        else allocator.settings.empty_cache_before_step):
                    allocator.empty_cache()
                    left_by_setup = 0   # what stays is the step's own fragmentation, which the step's reserve has
                if key == STEP_START:
                    allocator.reset_peaks()
                continue
            allocator.free(blocks.pop(key, None))
            if nbytes > 0:
                blocks[key] = allocator.malloc(nbytes, stream)
    except OutOfMemory:
        return Replay(max(allocator.peak_reserved, allocator.reserved), allocator.peak_allocated,
                      allocator.peak_reserved - allocator.allocated_at_peak_reserved, allocator.cache_flushes, True,
                      setup_peak, left_by_setup or 0)
    return Replay(allocator.peak_reserved, allocator.peak_allocated,
                  allocator.peak_reserved - allocator.allocated_at_peak_reserved, allocator.cache_flushes,
                  setup_reserved_bytes=setup_peak, start_reserved_bytes=left_by_setup or 0)


def simulate_reserved(events: list[Event], settings: AllocatorSettings, capacity: int | None) -> Replay:
    """The reserved peak on a device that leaves `capacity` bytes to the allocator. When the unbounded run would
    reserve more, the allocator releases its cache and retries as it would; if even that runs out, the unbounded
    figure is reported with `out_of_memory` set."""
    unbounded = replay(events, settings)
    if capacity is None or unbounded.reserved_bytes <= capacity:
        return unbounded
    bounded = replay(events, settings, capacity)
    return replace(unbounded, out_of_memory=True) if bounded.out_of_memory else bounded
