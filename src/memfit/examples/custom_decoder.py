"""A hand-written decoder-only language model (no transformers config): pre-norm blocks of PyTorch's own multi-head
attention and a GELU MLP in one nn.ModuleList, an untied output head. `build` is small (runs on a CPU in seconds);
`build_7b` has Llama-2-7B's width and depth (6.7 B parameters), for estimates and plans on the meta device:

    memfit plan memfit.examples.custom_decoder:build_7b --inputs memfit.examples.custom_decoder:make_inputs \\
        --gpu a100-80gb --seq-len 2048 --global-batch 8
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB = 32000


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=True,
                          attn_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device))[0]
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, dim: int = 256, heads: int = 4, layers: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build() -> nn.Module:
    return Decoder()


def build_7b() -> nn.Module:
    return Decoder(dim=4096, heads=32, layers=32)


def make_inputs(batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, seq_len))
