"""The FLOPs of a model's forward, counted on a fake copy: what the step-time model needs of a model that has no
transformer shape to compute them from (a custom nn.Module, `memfit plan ./net.py:build`).

PyTorch's own FlopCounterMode counts the matmuls, convolutions and attention kernels a forward dispatches (the
pointwise operations it leaves out cost bandwidth, not FLOPs); the model is built on fake tensors at full depth, so
nothing model-sized is allocated. Counted once per model, inputs and sequence length.
"""
from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from memfit.estimators.traced import build_fake
from memfit.specs.user_code import cache_key
from memfit.specs.workload import Workload
from memfit.steps.train import call_model
from memfit.techniques.resolve import resolve

COUNTED_BATCH = 2   # sequences in the counted forward (a batch of one may take other kernels' paths)


def forward_flops_per_token(workload: Workload) -> float:
    """FLOPs of one forward of `workload`'s model per token of its batch (float32 weights, no techniques); where the
    model cannot be called on its batch directly (a user's step that unpacks the batch itself), 2 FLOPs per
    parameter per token, the dense-model rule."""
    workload = resolve(workload)
    return _counted(cache_key(workload.model), cache_key(workload.inputs), workload.task, workload.effective_seq_len)


@functools.lru_cache(maxsize=32)
def _counted(model: str, inputs: str | None, task: str, seq_len: int) -> float:
    plain = resolve(Workload(model=model, inputs=inputs, task=task, seq_len=seq_len))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    module = build_fake(plain, None, fake_mode)
    counter = FlopCounterMode(display=False)
    with fake_mode:
        batch = plain.source.make_batch(batch_size=COUNTED_BATCH, seq_len=seq_len, task=task, dtype=torch.float32)
        try:
            with torch.no_grad(), counter:
                call_model(module, batch)
        except Exception:   # the step feeds the model itself: the dense-model rule
            return 2.0 * sum(p.numel() for p in module.parameters())
    return counter.get_total_flops() / (COUNTED_BATCH * seq_len)
