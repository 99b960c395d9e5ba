"""A text classifier fine-tuned on top of a frozen encoder: the embeddings and the first blocks are frozen
(taken as they are, like a pretrained feature extractor), the last blocks and the head train. No gradient
flows through the frozen part, so backward never needs its weights: `-t park-frozen` keeps them in host
RAM outside their own forward."""
from __future__ import annotations

import torch
from torch import nn


class FrozenEncoderClassifier(nn.Module):
    def __init__(self, vocab: int = 8192, width: int = 256, frozen_blocks: int = 4, trained_blocks: int = 2,
                 classes: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.frozen = nn.ModuleList(self._block(width) for _ in range(frozen_blocks))
        self.trained = nn.ModuleList(self._block(width) for _ in range(trained_blocks))
        self.head = nn.Linear(width, classes)
        for module in (self.embed, self.frozen):
            module.requires_grad_(False)

    @staticmethod
    def _block(width: int) -> nn.Module:
        return nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True,
                                          dropout=0.0)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.embed(input_ids)
        for block in self.frozen:
            x = block(x)
        for block in self.trained:
            x = block(x)
        logits = self.head(x.mean(dim=1))
        if labels is None:
            return logits
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def build() -> nn.Module:
    return FrozenEncoderClassifier()


def make_inputs(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 8192, (batch_size, seq_len)),
            "labels": torch.randint(0, 16, (batch_size,))}
