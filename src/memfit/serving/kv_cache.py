"""A paged KV cache as the engines lay it out: the bytes one block of each attention layer takes on one GPU, how many
blocks a given space holds, how many tokens and requests at max_model_len that is, and the longest context that
would start.

Per layer and token on one rank: keys and values of max(1, kv_heads / TP) heads x head_dim (a model with fewer KV
heads than ranks replicates them), or one MLA latent (kv_lora_rank + qk_rope_head_dim) that tensor parallel does not
split. vLLM V1 gives every layer the same page: a model whose layers differ (sliding-window beside full attention)
is cut into groups of equal size, each group's layers sharing one pool of blocks, and a sliding-window layer keeps
only the blocks its window (plus the tokens one step schedules) can reach.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.core.dtypes import dtype_bytes
from memfit.serving.served_model import AttentionLayer, ServedModel

KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_dtype(kv_cache_dtype: str, served_dtype: str) -> str:
    return KV_DTYPES.get(kv_cache_dtype, served_dtype)


def token_bytes(model: ServedModel, layer: AttentionLayer, tp: int, dtype: str) -> int:
    """One token's keys and values of one layer on one rank."""
    if layer.kind == "mla":
        return model.mla_latent * dtype_bytes(dtype)
    return 2 * max(1, model.kv_heads // tp) * model.head_dim * dtype_bytes(dtype)


@dataclass(frozen=True)
class Group:
    """Layers that share one pool of blocks: `layers` of them, each keeping `window` tokens (None: all)."""

    layers: int
    window: int | None


@dataclass(frozen=True)
class KVLayout:
    block_size: int
    page_bytes: int                 # one block of one layer on one rank
    groups: tuple[Group, ...]       # vLLM V1's KV-cache groups (one, of every layer, for a uniform model)
    tensors: int                    # layer tensors the pool is split into: the group size

    @property
    def block_bytes(self) -> int:
        """One block in every tensor of the pool: what the available memory is divided by."""
        return self.page_bytes * self.tensors

    @property
    def token_bytes(self) -> int:
        """One token in every layer of the model (on one rank): the figure a calculator would divide by."""
        return sum(g.layers for g in self.groups) * self.page_bytes // self.block_size

    def blocks(self, available: int) -> int:
        return max(0, available // self.block_bytes) if self.block_bytes else 0

    def request_blocks(self, length: int, step_tokens: int) -> int:
        """Blocks one request of `length` tokens holds across the groups (a sliding group: its window plus the
        tokens one step schedules)."""
        total = 0
        for group in self.groups:
            tokens = length if group.window is None else min(length, group.window - 1 + step_tokens)
            total += math.ceil(tokens / self.block_size) + (group.window is not None)
        return total

    def cache_tokens(self, blocks: int) -> int:
        """vLLM's "GPU KV cache size: N tokens" (before its 2026 reporting): blocks per group x block size."""
        return blocks // len(self.groups) * self.block_size

    def max_concurrency(self, blocks: int, length: int, step_tokens: int) -> float:
        need = self.request_blocks(length, step_tokens)
        return blocks / need if need else 0.0

    def longest_fitting(self, blocks: int, step_tokens: int, limit: int) -> int:
        """The longest max_model_len (<= limit) one request of which fits in `blocks`: vLLM's estimate in its
        refusal (a bisection over the length)."""
        low, high = 0, limit
        while low < high:
            mid = (low + high + 1) // 2
            if self.request_blocks(mid, step_tokens) <= blocks:
                low = mid
            else:
                high = mid - 1
        return low


def layout(model: ServedModel, tp: int, dtype: str, block_size: int, layers: tuple[AttentionLayer, ...] | None = None,
           grouped: bool = True) -> KVLayout:
    """The layout of `layers` (default: every attention layer of the model) on one rank. `grouped`: vLLM V1's
    groups for a model whose layers differ; otherwise (V0, SGLang, TGI) every layer keeps every token."""
    layers = model.attention if layers is None else layers
    page = block_size * token_bytes(model, layers[0], tp, dtype)
    kinds: dict[int | None, int] = {}
    for layer in layers:
        window = layer.window if grouped and layer.kind == "sliding" else None
        kinds[window] = kinds.get(window, 0) + 1
    if len(kinds) == 1:
        window, count = next(iter(kinds.items()))
        return KVLayout(block_size, page, (Group(count, window),), count)
    # vLLM: groups of the rarer kind's count (the "1" of an n:1 pattern), or of the commoner's where the two are
    # within 1.5x (gpt-oss: 12 sliding + 12 full), each kind padded to whole groups
    size = min(kinds.values())
    if max(kinds.values()) < 1.5 * size:
        size = max(kinds.values())
    groups = tuple(Group(size, window) for window, count in kinds.items() for _ in range(math.ceil(count / size)))
    return KVLayout(block_size, page, groups, size)
