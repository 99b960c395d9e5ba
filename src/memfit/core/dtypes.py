"""Dtype names and sizes, in one place: the analytic estimator, the weight formats and KV-cache kinds, and the cost
model name a dtype as PyTorch prints it without its module ("float32", "bfloat16", "int8")."""
from __future__ import annotations

from typing import TYPE_CHECKING

from memfit.core.errors import require_choice

if TYPE_CHECKING:
    import torch

BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
         "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
         "complex64": 8, "complex128": 16}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def dtype_bytes(name: str) -> int:
    """Bytes per element of the dtype named `name`."""
    require_choice(name, BYTES, "dtype")
    return BYTES[name]
