"""Pieces every family shares: the LM head and loss, the KV cache (as its kind stores it), the generation driver."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

from memfit.estimators.analytic import ops, recompute
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.symbols import Param, Sym, View


def lm_head(e: Engine, hidden: Sym, table: Param, vocab: int, *, batch: int, q_len: int, logits_to_keep: int = 0,
            bias: Param | None = None) -> Sym:
    """logits = lm_head(hidden_states[:, -logits_to_keep:, :])."""
    tokens = batch * (logits_to_keep or q_len)
    rows = hidden if tokens == batch * q_len else View(hidden, tokens * table.numel // vocab)
    return ops.linear(e, rows, table, vocab, bias)


def chunked_lm_loss(e: Engine, hidden: Sym, table: Param, vocab: int, *, batch: int, seq: int, chunks: int,
                    softcap: bool = False) -> Sym:
    """techniques/sequence.py `chunked_causal_lm_loss`: labels padded once, then per slice of the
    sequence a checkpointed LM head + float32 cross-entropy (sum), the sums added, divided by the count;
    or (policy.loss_logits_kept, `upcast_chunked_lm_loss`) the head over every slice first, its logits kept,
    then each slice's cross-entropy."""
    padded = e.new(batch * (seq + 1), "int64")          # F.pad(labels, (0, 1), value=-100)
    step = -(-seq // chunks)                           # torch.chunk's slice length
    hidden_per_token = hidden.numel // (batch * seq)
    slices = [(View(hidden, batch * size * hidden_per_token), size)
              for size in (min(step, seq - start) for start in range(0, seq, step))]
    kept = [_slice_head(e, rows, table, vocab, batch) for rows, _ in slices] if e.policy.loss_logits_kept else None
    total = None
    for i, (rows, size) in enumerate(slices):
        if kept:
            part = _slice_cross_entropy(e, [kept[i]], batch=batch, tokens=size, softcap=softcap, labels=padded)
        else:   # the checkpoint holds its inputs, the targets (a view of the padded labels) among them
            part = recompute.checkpointed(e, partial(_slice_loss, e, table=table, vocab=vocab, batch=batch,
                                                     tokens=size, softcap=softcap, labels=padded), rows)
        total = part if total is None else ops.add(e, total, part)
    counted = e.new(batch * seq, "bool")               # targets != -100
    count = e.new(1, "int64")
    del counted
    assert total is not None                           # at least one slice
    loss = ops.mul(e, total, count)                    # total / count
    del kept, padded                                   # the slices' logits live until the loss returns
    return loss


def _slice_head(e: Engine, hidden: Sym, table: Param, vocab: int, batch: int) -> Sym:
    rows = hidden if batch == 1 else ops.copy(e, hidden)    # a slice of (b, s, h) is contiguous only for b = 1
    return ops.linear(e, rows, table, vocab)


def _slice_loss(e: Engine, hidden: Sym, *, table: Param, vocab: int, batch: int, tokens: int, softcap: bool,
                labels: Sym) -> Sym:
    return _slice_cross_entropy(e, [_slice_head(e, hidden, table, vocab, batch)], batch=batch, tokens=tokens,
                                softcap=softcap, labels=labels)


def _slice_cross_entropy(e: Engine, held: list[Sym], *, batch: int, tokens: int, softcap: bool, labels: Sym) -> Sym:
    """logits.float(), soft-capped, and F.cross_entropy over the flattened slice; it saves its targets: a copy of
    the strided slice (batch > 1) or a view of the padded `labels`. `held`: the logits, handed over in a list so
    that they die here when nothing else holds them."""
    logits = held.pop()
    if softcap:                                             # tanh(logits / cap) * cap
        logits = ops.scalar_op(e, logits)
        logits = ops.unary_saving_output(e, logits, "tanh")
        logits = ops.scalar_op(e, logits)
    logits32 = ops.cast(e, logits, "float32")
    del logits
    target = e.new(batch * tokens, "int64") if batch > 1 else None   # flatten() of a strided slice copies
    log_probs = ops.softmax(e, ops.autocast_input(e, logits32, "cross_entropy"), "log_softmax")
    del logits32
    loss, total_weight = e.new(1, "float32"), e.new(1, "float32")
    return e.record(loss, [log_probs], [log_probs, total_weight, labels if target is None else target])


def asks_for_eager(cfg) -> bool:
    """The transformers config runs eager attention (attn_implementation "eager"), not SDPA."""
    return getattr(cfg, "_attn_implementation", None) == "eager"


def eager_attention(e: Engine, q: Sym, k: Sym, v: Sym, *, batch: int, heads: int, q_len: int, kv_len: int,
                    head_dim: int, dropout_p: float, masks: tuple[Sym, ...] = (), softmax_dtype: str | None = None,
                    weights_dtype: str | None = None) -> tuple[Sym, Sym]:
    """transformers' eager_attention_forward for q, k, v that are (b, heads, s, d) views of (b, s, heads*d)
    projections (BERT, GPT-2, T5, ViT): matmul(q, k^T) (both copied to fold (b, heads) unless the batch is 1),
    * scaling, + each of `masks` (T5's position bias, a float attention mask), softmax (with `softmax_dtype`: ViT),
    the weights cast to `weights_dtype` (ViT: the query's, GPT-2: the value's), dropout, matmul with v (copied the
    same way), the output transposed back and made contiguous. Returns (output, attention weights after dropout),
    as the function does."""
    fold = ops.copy if batch > 1 else (lambda _e, x: x)
    rows = batch * heads * q_len
    scores = ops.matmul(e, fold(e, q), fold(e, k), rows * kv_len)
    scores = ops.scalar_op(e, scores)
    for mask in masks:
        scores = ops.add(e, scores, mask)
    weights = ops.softmax(e, scores, "softmax", dtype=softmax_dtype)
    del scores
    if weights_dtype:
        weights = ops.cast(e, weights, weights_dtype)
    weights = ops.dropout(e, weights, dropout_p)
    out = ops.matmul(e, weights, fold(e, v), rows * head_dim)
    return ops.copy(e, out), weights


def dense(e: Engine, x: Sym, name: str, out_features: int) -> Sym:
    """nn.Linear with a bias, its parameters declared as `name.w` and `name.b`."""
    return ops.linear(e, x, e.params[name + ".w"], out_features, e.params[name + ".b"])


class CachedKV:
    """One layer's cached keys and values: each a list of tensors (the codes first, then their state), stored as the
    engine policy's KV-cache kind says (core/kv_caches.py): `tokens` tokens of `width` elements, computed in
    `dtypes` (the keys', the values': under autocast, rotary leaves the keys float32 and the values half)."""

    __slots__ = ("dtypes", "k", "tokens", "v", "v_width", "width")

    def __init__(self, width: int, tokens: int, dtypes: tuple[str, str], v_width: int | None = None) -> None:
        """`v_width`: the values' width where it differs from the keys' (DeepSeek's latent cache: the compressed
        latent as keys, the shared rotary key as values)."""
        self.width, self.tokens, self.dtypes = width, tokens, dtypes
        self.v_width = v_width or width
        self.k: list[Sym] = []
        self.v: list[Sym] = []

    def stored(self, e: Engine, dtype: str, width: int) -> list[Sym]:
        """The tensors its keys (or values), computed in `dtype`, `width` elements a token, are stored in: codes,
        then their quantization state."""
        kind = e.policy.kv_cache_kind
        elements = width * kind.stored_tokens(self.tokens)
        codes = e.new(elements, kind.dtype or dtype, category="kv_cache")
        return [codes] + [e.new(n, state, category="kv_cache") for _, n, state in kind.state_elements(elements)]

    def store(self, e: Engine, old: CachedKV | None = None) -> None:
        """Allocate the keys, then the values; each of `old`'s freed after its new one (a cat, then the rebind)."""
        self.k = self.stored(e, self.dtypes[0], self.width)
        if old is not None:
            old.k = []
        self.v = self.stored(e, self.dtypes[1], self.v_width)
        if old is not None:
            old.v = []

    def for_attention(self, e: Engine) -> tuple[Sym, Sym]:
        """What attention reads: the cached keys and values, or (a kind that stores codes) a copy of each
        dequantized to its compute dtype, alive while attention runs."""
        if not e.policy.kv_cache_kind.dequantizes:
            return self.k[0], self.v[0]
        return e.new(self.width * self.tokens, self.dtypes[0]), e.new(self.v_width * self.tokens, self.dtypes[1])


def grow_cache(e: Engine, cache: dict, key, k: Sym, v: Sym, width: int, tokens: int,
               v_width: int | None = None) -> tuple[Sym, Sym]:
    """DynamicLayer.update: keys = cat([keys, k]) then values = cat([values, v]), to `tokens` tokens of `width`
    (values: `v_width`) elements; each old tensor is freed when its attribute is rebound. Returns what attention
    reads."""
    old = cache.pop(key, None)
    new = cache[key] = CachedKV(width, tokens, (k.dtype, v.dtype), v_width)
    new.store(e, old)
    del old
    return new.for_attention(e)


def replace_cache(e: Engine, cache: dict, tokens: dict) -> None:
    """Swap each entry for one of `tokens[key]` tokens, one entry at a time."""
    for key, count in tokens.items():
        width, dtypes, v_width = cache[key].width, cache[key].dtypes, cache[key].v_width
        cache[key] = None
        new = cache[key] = CachedKV(width, count, dtypes, v_width)
        new.store(e)


def generate(e: Engine, forward: Callable, *, batch: int, seq: int, new_tokens: int,
             resize_cache: Callable[[dict, int], None]) -> None:
    """Prefill over `seq` tokens (logits of the last position), then decode steps: the first and the
    last, which holds the longest cache. `forward(cache, q_len, kv_len, logits_to_keep)` runs the
    model; `resize_cache(cache, tokens)` sets the cache to what it holds before a step."""
    cache: dict = {}
    e.set_phase("prefill")
    logits = forward(cache, seq, seq, 1)
    token = e.new(batch, "int64")
    del logits
    if not new_tokens:
        return
    e.set_phase("decode")
    logits = forward(cache, 1, seq + 1, 0)
    del logits
    if new_tokens > 1:
        resize_cache(cache, seq + new_tokens - 1)
        logits = forward(cache, 1, seq + new_tokens, 0)
        del logits
    del token, cache
