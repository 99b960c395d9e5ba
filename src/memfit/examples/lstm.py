"""A two-layer LSTM language model; its output is a tensor of logits (loss: the mean, memfit's rule)."""
from __future__ import annotations

import torch
from torch import nn


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab_size: int = 2048, hidden: int = 256, num_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        return self.head(hidden)


def build() -> nn.Module:
    return LSTMLanguageModel()


def make_inputs(batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, 2048, (batch_size, seq_len))
