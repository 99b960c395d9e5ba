"""Stand-ins with the exact state layout of optimizers whose real step cannot run on fake tensors.

torchao's AdamW4bit compiles its step and reads data, which FakeTensorMode forbids, so a trace runs
this optimizer instead: the same state tensors, created at the first step as torchao creates them
(torchao/optim/adam.py `_new_buffer`, subclass_4bit.py `OptimState4bit.zeros`), and an in-place
update. Its compiled step fuses dequantize-update-quantize into one kernel per parameter, so no
parameter-sized temporaries appear (checked against a real run in tests/test_techniques.py).
"""
from __future__ import annotations

import torch

BLOCK_4BIT = 128
QMAP_4BIT = 16
MIN_QUANTIZED_NUMEL = 4096


class Blockwise4bitLayout(torch.optim.Optimizer):
    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @staticmethod
    def _state(p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = p.numel()
        if n >= MIN_QUANTIZED_NUMEL and n % BLOCK_4BIT == 0:
            return (torch.zeros(n // 2, dtype=torch.uint8), torch.zeros(n // BLOCK_4BIT),
                    torch.zeros(QMAP_4BIT))
        return (torch.zeros_like(p),)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for name in ("exp_avg", "exp_avg_sq"):
                        for i, tensor in enumerate(self._state(p)):
                            state[f"{name}.{i}"] = tensor
                state["step"] += 1
                p.add_(p.grad, alpha=0.0)
