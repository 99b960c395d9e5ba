"""Optimizer-state compression: 8-bit and 4-bit AdamW, Adafactor.

Mechanism and memory per parameter (fp32 AdamW keeps m and v: 8 bytes):
  adamw8bit (bitsandbytes AdamW8bit): m and v as uint8 codes in blocks of 256 with one float32
    absmax per block: 2 bytes + 8/256; tensors under 4,096 elements keep float32 states.
    Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022.
  adamw4bit (torchao AdamW4bit): 4-bit codes in blocks of 128 with one float32 scale per block:
    1 byte + 8/128; tensors under 4,096 elements (or not a multiple of 128) keep float32 states.
    Li et al., "Memory Efficient Optimizers with 4-bit States", 2023.
  adafactor (torch.optim.Adafactor): factored second moment (a row and a column vector per
    matrix), no first moment. Shazeer & Stern, 2018.
These set the workload's optimizer (`--optimizer` and `-t` are the same setting).
"""
from __future__ import annotations

from dataclasses import dataclass

from memfit.techniques.base import Technique, register
from memfit.techniques.setup import StepSetup


@dataclass(frozen=True, kw_only=True)
class _Optimizer(Technique):
    stage = "optimizer"
    workload_field = "optimizer"
    risk = "numerical"

    def apply_(self, setup: StepSetup) -> None:
        setup.optimizer_name = self.name


@register
@dataclass(frozen=True, kw_only=True)
class AdamW8bit(_Optimizer):
    name = "adamw8bit"
    summary = "AdamW with block-wise 8-bit m and v (bitsandbytes): ~2 bytes of state per parameter"


@register
@dataclass(frozen=True, kw_only=True)
class AdamW4bit(_Optimizer):
    name = "adamw4bit"
    # measured: +24 % held-out perplexity after 60 steps from scratch (benchmarks/results/technique_table.txt)
    risk = "lossy"
    summary = "AdamW with block-wise 4-bit m and v (torchao): ~1 byte of state per parameter"


@register
@dataclass(frozen=True, kw_only=True)
class Adafactor(_Optimizer):
    name = "adafactor"
    risk = "lossy"      # a different update rule (and learning rate) than AdamW: the training path changes
    summary = "Adafactor: factored second moment, no first moment (rows + columns per matrix)"
