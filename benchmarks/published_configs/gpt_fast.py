"""A gpt-fast style Llama and its generation loop, as torchao's `_models/llama` runs them (model.py, generate.py),
for memfit's traced estimator: `--step` runs `generate_*` on the model `llama_3_1_8b` builds.

Written for memfit from what those files do to memory; the arithmetic is simplified where memory does not depend on
it (sampling, rotary). What the published KV-cache table depends on:

- `setup_caches` builds, on the GPU, a dense `bool[cache, cache]` causal mask as `torch.tril(torch.ones(...))` (two
  such tensors for a moment), or, with the linear mask, one `bool[1, 1, 1, cache]` row; a static KV cache of
  `[batch, kv_heads, cache, head_dim]` per layer for keys and values (bf16, or int8 codes with bf16 per-token scales);
  the rotary table for the model's whole block size.
- each forward indexes the mask for the positions it runs; keys and values are read back from the whole cache
  (an int8 cache dequantizes it first) and `repeat_interleave`d to every query head;
- the prefill runs SDPA as PyTorch picks it; every decode step runs inside
  `sdpa_kernel(SDPBackend.MATH)`, the composite that works in float32 on half inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass
class Args:
    block_size: int = 131072
    vocab_size: int = 128256
    n_layer: int = 32
    n_head: int = 32
    n_local_heads: int = 8
    dim: int = 4096
    intermediate_size: int = 14336
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


class StaticKV(nn.Module):
    def __init__(self, batch: int, heads: int, length: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        shape = (batch, heads, length, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v", torch.zeros(shape, dtype=dtype))

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v
        return self.k, self.v


class Int8KV(nn.Module):
    """int8 codes with a bf16 scale per token; read back as codes * scales over the whole cache."""

    def __init__(self, batch: int, heads: int, length: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("k", torch.zeros((batch, heads, length, head_dim), dtype=torch.int8))
        self.register_buffer("v", torch.zeros((batch, heads, length, head_dim), dtype=torch.int8))
        self.register_buffer("k_scale", torch.ones((batch, heads, length, 1), dtype=dtype))
        self.register_buffer("v_scale", torch.ones((batch, heads, length, 1), dtype=dtype))

    @staticmethod
    def _quantize(x: torch.Tensor):
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5) / 127
        return (x / scale).round().clamp(-127, 127).to(torch.int8), scale

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        out = []
        for codes, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = self._quantize(new)
            codes[:, :, pos] = q
            scales[:, :, pos] = scale
            full = codes * scales
            full[:, :, pos] = new
            out.append(full)
        return out[0], out[1]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on float32 pairs, back in x's dtype (the table holds cos and sin per position)."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    table = table.view(1, pairs.size(1), 1, pairs.size(3), 2)
    out = torch.stack([pairs[..., 0] * table[..., 0] - pairs[..., 1] * table[..., 1],
                       pairs[..., 1] * table[..., 0] + pairs[..., 0] * table[..., 1]], -1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.a = a
        self.wqkv = nn.Linear(a.dim, (a.n_head + 2 * a.n_local_heads) * a.head_dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        self.cache: nn.Module | None = None

    def forward(self, x, table, mask, pos):
        a = self.a
        b, s, _ = x.shape
        kv = a.n_local_heads * a.head_dim
        q, k, v = self.wqkv(x).split([a.dim, kv, kv], dim=-1)
        q = rotate(q.view(b, s, a.n_head, a.head_dim), table).transpose(1, 2)
        k = rotate(k.view(b, s, a.n_local_heads, a.head_dim), table).transpose(1, 2)
        v = v.view(b, s, a.n_local_heads, a.head_dim).transpose(1, 2)
        k, v = self.cache.update(pos, k, v)
        k = k.repeat_interleave(a.n_head // a.n_local_heads, dim=1)
        v = v.repeat_interleave(a.n_head // a.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, a.dim))


class Block(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.attention = Attention(a)
        self.w1 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w3 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=False)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, table, mask, pos):
        h = x + self.attention(self.attention_norm(x), table, mask, pos)
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Transformer(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layer))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.linear_mask = False

    def setup_caches(self, batch: int, length: int, *, device, linear_mask: bool, prompt_length: int,
                     int8_cache: bool) -> None:
        a, dtype = self.a, self.output.weight.dtype
        length = -(-length // 8) * 8
        self.length, self.linear_mask = length, linear_mask
        if linear_mask:
            self.mask = torch.zeros(1, 1, 1, length, dtype=torch.bool, device=device)
            self.mask[..., :prompt_length] = True
        else:
            self.mask = torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))
        kind = Int8KV if int8_cache else StaticKV
        with torch.device(device):
            for block in self.layers:
                block.attention.cache = kind(batch, a.n_local_heads, length, a.head_dim, dtype)
        self.table = rotary_table(a.block_size, a.head_dim, dtype, device)

    def forward(self, ids, pos):
        if not self.linear_mask:
            mask = self.mask[None, None, pos]
        elif len(pos) > 1:   # the prefill of a linear mask
            mask = torch.tril(torch.ones(len(pos), self.length, dtype=torch.bool, device=ids.device))[None, None]
        else:
            self.mask[0, 0, 0, pos] = True
            mask = self.mask
        table = self.table[pos]
        x = self.tok_embeddings(ids)
        for block in self.layers:
            x = block(x, table, mask, pos)
        return self.output(self.norm(x))


def rotary_table(positions: int, head_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    freqs = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(positions, device=device), freqs)
    polar = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([polar.real, polar.imag], dim=-1).to(dtype)


def sample(logits: torch.Tensor, top_k: int = 200, temperature: float = 0.8) -> torch.Tensor:
    logits = logits[:, -1] / temperature
    pivot = torch.topk(logits, top_k)[0].select(-1, -1).unsqueeze(-1)
    probs = torch.softmax(torch.where(logits < pivot, -float("inf"), logits), dim=-1)
    noise = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / noise, dim=-1, keepdim=True).to(torch.int)


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, *, new_tokens: int = 100, cache_size: int | None = None,
             linear_mask: bool = False, int8_cache: bool = False) -> torch.Tensor:
    batch, length = prompt.shape
    total = length + new_tokens
    model.setup_caches(batch, max(cache_size or total, total), device=prompt.device, linear_mask=linear_mask,
                       prompt_length=length, int8_cache=int8_cache)
    pos = torch.arange(length, device=prompt.device)
    token = sample(model(prompt, pos)).clone()
    tokens = [token]
    pos = torch.tensor([length], device=prompt.device)
    for _ in range(new_tokens - 1):
        with sdpa_kernel(SDPBackend.MATH):
            token = sample(model(token.view(batch, -1), pos)).clone()
        pos += 1
        tokens.append(token.clone())
    return torch.cat([prompt, *tokens], dim=-1)


def llama_3_1_8b() -> Transformer:
    return Transformer(Args())


def prompt(batch_size: int, seq_len: int) -> torch.Tensor:
    """`seq_len` prompt tokens (the BOS and "Hello, my name is" are 6 with Llama 3's tokenizer)."""
    return torch.randint(0, Args().vocab_size, (batch_size, seq_len), dtype=torch.int)


def generate_cache_8192(model, batch, optimizer):
    return generate(model, batch, cache_size=8192)


def generate_cache_32768(model, batch, optimizer):
    return generate(model, batch, cache_size=32768)


def generate_cache_131072(model, batch, optimizer):
    return generate(model, batch, cache_size=131072)


def generate_cache_131072_int8_linear_mask(model, batch, optimizer):
    return generate(model, batch, cache_size=131072, linear_mask=True, int8_cache=True)
