"""KV-cache kinds: how decoding stores each layer's keys and values, declared once and read by the analytic
estimator's families (estimators/analytic/families/common.py: every cache tensor is allocated there), the cost
model (a decode step reads the cache's bytes: planner/cost.py) and the techniques that choose one (through the
analytic policy's `kv_cache`, which two techniques cannot set differently).

A kind is the dtype its keys and values are stored in (None: the compute dtype, as transformers' DynamicCache
keeps them), the quantization state stored beside quantized codes (`entries` values per `per` cached elements),
and paging (storage in whole pages of `page_tokens` tokens). A kind stored in another dtype than the compute
dtype is dequantized for attention: each layer's attention reads a compute-dtype copy of its keys and values.
Which layers attend to what (full, or a sliding window that caps their cache) is the model's, not the cache's:
the families read it from the model's config.
"""
from __future__ import annotations

from dataclasses import dataclass

from memfit.core.dtypes import dtype_bytes
from memfit.core.registry import Registry


@dataclass(frozen=True)
class KVState:
    """A tensor of quantization state beside the cached codes."""

    suffix: str
    dtype: str
    per: int          # cached elements per entry
    entries: int = 1


@dataclass(frozen=True)
class KVCacheKind:
    name: str
    summary: str
    dtype: str | None = None          # None: the compute dtype
    state: tuple[KVState, ...] = ()
    page_tokens: int = 0              # storage in pages of this many tokens; 0: exactly the tokens cached

    def __post_init__(self) -> None:
        if self.dtype is not None:
            dtype_bytes(self.dtype)
        for state in self.state:
            dtype_bytes(state.dtype)
        if self.page_tokens < 0:
            raise ValueError(f"KV-cache kind {self.name}: page_tokens must be >= 0")

    @property
    def dequantizes(self) -> bool:
        """Attention reads a compute-dtype copy (the cache holds codes)."""
        return self.dtype is not None

    def stored_tokens(self, tokens: int) -> int:
        """Tokens of storage `tokens` cached tokens take (whole pages when paged)."""
        page = self.page_tokens
        return -(-tokens // page) * page if page else tokens

    def state_elements(self, elements: int) -> list[tuple[str, int, str]]:
        """(suffix, elements, dtype) of the state beside `elements` cached codes."""
        return [(s.suffix, s.entries * -(-elements // s.per), s.dtype) for s in self.state]

    def stored_bytes(self, elements: int, compute_dtype: str) -> int:
        """Bytes of `elements` cached keys (or values) and their state."""
        return (elements * dtype_bytes(self.dtype or compute_dtype)
                + sum(n * dtype_bytes(dtype) for _, n, dtype in self.state_elements(elements)))


KV_CACHE_KINDS: Registry[KVCacheKind] = Registry("KV-cache kind")
register_kv_cache_kind = KV_CACHE_KINDS.add
kv_cache_kind = KV_CACHE_KINDS.named


DYNAMIC = register_kv_cache_kind(KVCacheKind(
    "dynamic", "transformers' DynamicCache: keys and values in the compute dtype, grown by a cat per step"))
