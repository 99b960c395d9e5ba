"""Liger-Kernel's memory benchmarks of PyTorch's own loss ops (benchmark_cross_entropy.py and
benchmark_fused_linear_cross_entropy.py, the `torch` / `huggingface` providers), for memfit's traced estimator.

Written for memfit from what those scripts do to memory. Each builds its modules and a `requires_grad` input once,
then times `full()` (the forward, then `backward()`) ten times, resetting the peak before each: from the second call
on the gradients of the call before are there and the new ones are added to them. The step below runs `full()`
twice; its peak is the steady state the published median reports. Run with `--task inference`: memfit gives the
step no optimizer (the benchmarks have none).
"""
from __future__ import annotations

import torch
from torch import nn

HIDDEN, LLAMA3_VOCAB = 4096, 128256
CE_VOCAB = 131072


class LMHeads(nn.Module):
    """The fused-linear benchmark builds two LM heads (its torch module and Liger's) and runs the torch one."""

    def __init__(self, hidden: int = HIDDEN, vocab: int = LLAMA3_VOCAB):
        super().__init__()
        self.torch_head = nn.Linear(hidden, vocab, bias=False)
        self.liger_head = nn.Linear(hidden, vocab, bias=False)   # resident, unused by the torch provider
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, target):
        return self.loss(self.torch_head(x), target)


def lm_heads() -> nn.Module:
    return LMHeads()


def hidden_states(batch_size: int, seq_len: int) -> dict:
    tokens = batch_size * seq_len
    return {"x": torch.randn(tokens, HIDDEN, dtype=torch.bfloat16),
            "target": torch.randint(LLAMA3_VOCAB, (tokens,))}


def cross_entropy() -> nn.Module:
    return nn.CrossEntropyLoss()


def logits(batch_size: int, seq_len: int) -> dict:
    tokens = batch_size * seq_len
    return {"x": torch.randn(tokens, CE_VOCAB), "target": torch.randint(CE_VOCAB, (tokens,))}


def forward_backward(model, batch, optimizer):
    x = batch["x"].requires_grad_()
    for _ in range(2):
        model(x, batch["target"]).backward()
