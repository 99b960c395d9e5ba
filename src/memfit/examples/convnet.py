"""A small ResNet-style image classifier: conv, batch norm (with running-stat buffers), residual blocks."""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class ConvNet(nn.Module):
    def __init__(self, channels: int = 32, num_blocks: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.blocks = nn.ModuleList(Block(channels) for _ in range(num_blocks))
        self.head = nn.Linear(channels, num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x.mean(dim=(2, 3)))
        if labels is None:
            return logits
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def build() -> nn.Module:
    return ConvNet()


def make_inputs(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """`seq_len` is the image side in pixels."""
    return {"images": torch.randn(batch_size, 3, seq_len, seq_len),
            "labels": torch.randint(0, 10, (batch_size,))}
