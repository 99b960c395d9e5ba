"""Training/inference precisions and what each one means for dtypes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.core.errors import MemfitError, closest


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype          # dtype the weights are stored in
    autocast_dtype: torch.dtype | None  # dtype of autocast regions, None without autocast
    loss_scaling: bool                # dynamic loss scaling (fp16 mixed precision)
    master_dtype: torch.dtype | None = None   # the optimizer steps on master copies of the weights in this dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the step's matmuls and attention run in: autocast's, else the weights'."""
        return self.autocast_dtype or self.param_dtype


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32, None, False),
    "fp16-mixed": Precision("fp16-mixed", torch.float32, torch.float16, True),
    "bf16-mixed": Precision("bf16-mixed", torch.float32, torch.bfloat16, False),
    "bf16": Precision("bf16", torch.bfloat16, None, False),
    "fp16": Precision("fp16", torch.float16, None, False),
    "bf16-master": Precision("bf16-master", torch.bfloat16, None, False, torch.float32),
}


def precision_names(*, autocast: bool | None = None, loss_scaling: bool | None = None,
                    master: bool | None = None) -> str:
    """The precisions with (True) or without (False) autocast, loss scaling and master weights, for a message:
    "a or b"."""
    names = [p.name for p in PRECISIONS.values()
             if (autocast is None or (p.autocast_dtype is not None) == autocast)
             and (loss_scaling is None or p.loss_scaling == loss_scaling)
             and (master is None or (p.master_dtype is not None) == master)]
    return " or ".join(names)


def precision_of_dtype(dtype: torch.dtype) -> Precision:
    """The precision that stores weights in `dtype` with no autocast and no master copy (float32 for any dtype
    without one)."""
    return next((p for p in PRECISIONS.values()
                 if p.param_dtype == dtype and p.autocast_dtype is None and p.master_dtype is None),
                PRECISIONS["fp32"])


def autocast_precision(dtype: torch.dtype) -> Precision:
    """The precision that runs autocast to `dtype` over float32 weights (a framework's mixed-precision flag)."""
    return next(p for p in PRECISIONS.values() if p.autocast_dtype == dtype and p.param_dtype == torch.float32)


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise MemfitError(
            f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}.{closest(name, PRECISIONS)}"
        ) from None


def precision_of_model(model: torch.nn.Module) -> Precision:
    """The precision of a model's weights as they are (the dtype of its first floating-point parameter)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return precision_of_dtype(dtype)
