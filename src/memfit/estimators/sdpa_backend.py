"""Which kernel F.scaled_dot_product_attention runs on a GPU, and what that kernel keeps and takes beyond its output.

PyTorch tries its CUDA backends in the order flash, memory-efficient, math and runs the first whose checks pass
(aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: `priority_order`, `select_sdp_backend`). cuDNN comes after
math in that order; only a build with cuDNN newer than 9.15 moves it first on sm90/sm100 (`check_prefer_cudnn_
attention`), which memfit does not model. The checks modelled here:

  flash      fp16 or bf16, head_dim <= 256, compute capability 8.0 or newer, no attn_mask, causal only with equal
             query and key lengths; on sm86/sm89 a head_dim above 192 is refused when a gradient is needed
             (`can_use_flash_attention`).
  efficient  fp16 or fp32 (bf16 from 8.0), head_dim a multiple of 8 (half) or 4 (fp32); masks, dropout and causal
             are all accepted (`can_use_mem_efficient_attention`); fewer key/value heads than query heads
             (`enable_gqa`) are not: up to PyTorch 2.13 only flash takes grouped-query attention (pytorch issue
             139586; an H200 ran float32 tiny-llama's SDPA with eager attention's memory), so float32 GQA
             without a mask runs math, which repeats the keys and values. PyTorch's main branch adds GQA to
             efficient (pull request 191085) after 2.13, whose sdp_utils_cpp.h lacks that change: not modelled.
  math       anything else: the composite over the whole score matrix.

What they keep (tools/autograd/derivatives.yaml): flash and efficient save q, k, v, the output and a float32
logsumexp of [batch, heads, query length] (efficient pads the length to a multiple of 32, `kAlignLSE`);
efficient keeps the mask too. Backward scratch: flash-attention's float32 dq accumulator [batch, round128(L),
heads, head_dim rounded to 32 (<= 128) or 64] and softmax_d [batch, heads, round128(L)] (flash_api.cpp `mha_bwd`);
efficient's float32 delta [batch, heads, L], computed as a full-size float32 grad_out * out product for float32
inputs (attention_backward.cu `_efficient_attention_backward`).
"""
from __future__ import annotations

import torch

from memfit.core.dtypes import dtype_name
from memfit.core.errors import MemfitError
from memfit.core.precision import PRECISIONS

FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
HALF = ("float16", "bfloat16")
ALL_BACKENDS = frozenset({FLASH, EFFICIENT, MATH})


@torch._dynamo.assume_constant_result
def enabled_backends() -> frozenset[str]:
    """The backends torch.nn.attention.sdpa_kernel (or torch.backends.cuda.enable_*_sdp) leaves enabled now; read
    once when torch.compile traces the call (a constant of the graph), as PyTorch picks the kernel then."""
    flags = {FLASH: torch.backends.cuda.flash_sdp_enabled(), EFFICIENT: torch.backends.cuda.mem_efficient_sdp_enabled(),
             MATH: torch.backends.cuda.math_sdp_enabled()}
    return frozenset(name for name, on in flags.items() if on)


def cuda_backend(capability: tuple[int, int], dtype: str, head_dim: int, *, mask: bool, causal_unequal: bool,
                 needs_grad: bool, grouped: bool = False, forced: str | None = None,
                 enabled: frozenset[str] = ALL_BACKENDS, value_head_dim: int | None = None) -> str:
    """The backend SDPA runs on a GPU of `capability` for inputs of `dtype` (torch's name without the prefix).
    `grouped`: fewer key/value heads than query heads (SDPA's enable_gqa). `value_head_dim`: the values' head size
    where it differs from the queries' and keys' (DeepSeek's latent attention): flash takes only equal sizes.
    `forced`: "flash" for FlashAttention-2 or flex attention (ModelSource.attention_kernel), which run that kernel or
    fail. `enabled`: the backends the step allows (a `torch.nn.attention.sdpa_kernel` context narrows them)."""
    if forced == FLASH:
        if dtype not in HALF or capability < (8, 0) or head_dim > 256:
            fix = "use a half precision" if dtype not in HALF and capability >= (8, 0) else "use SDPA attention"
            raise MemfitError(f"FlashAttention-2 and flex attention run float16 or bfloat16 with head_dim <= 256 on "
                              f"compute capability 8.0 or newer; this step has {dtype}, head_dim {head_dim} on "
                              f"{capability[0]}.{capability[1]} ({fix}).")
        return FLASH
    flash_head = head_dim <= (192 if capability in ((8, 6), (8, 9)) and needs_grad else 256)
    same_heads = value_head_dim in (None, head_dim)
    if (FLASH in enabled and dtype in HALF and flash_head and capability >= (8, 0) and not mask and not causal_unequal
            and same_heads):
        return FLASH
    efficient_dtypes = ("float16", "float32") + (("bfloat16",) if capability >= (8, 0) else ())
    aligned = all(size % (8 if dtype in HALF else 4) == 0 for size in (head_dim, value_head_dim or head_dim))
    if EFFICIENT in enabled and dtype in efficient_dtypes and aligned and capability >= (5, 0) and not grouped:
        return EFFICIENT
    if MATH not in enabled:
        raise MemfitError(f"scaled_dot_product_attention: no enabled backend ({', '.join(sorted(enabled)) or 'none'}) "
                          f"takes {dtype} inputs with head_dim {head_dim}{' and a mask' if mask else ''} on compute "
                          f"capability {capability[0]}.{capability[1]}; PyTorch fails the same way.")
    return MATH


def grouped_math_note(workload, capability: tuple[int, int]) -> str | None:
    """What to tell a user whose GPU step runs SDPA's math kernel only because its attention is grouped (fewer
    key/value heads than query heads): a memory cliff nothing else in the estimate explains. None otherwise."""
    source = workload.source
    if not source.is_hf or source.eager_attention or source.attention_kernel:
        return None   # eager, or a kernel that always runs (FlashAttention-2, flex): SDPA does not choose
    heads, kv_heads, head_dim = source.shape.heads, source.shape.kv_heads, source.shape.head_dim
    if kv_heads == heads:
        return None
    precision = PRECISIONS[workload.precision]
    dtype = dtype_name(precision.compute_dtype)
    checks = dict(mask=False, causal_unequal=False, needs_grad=workload.task == "train")
    if cuda_backend(capability, dtype, head_dim, grouped=True, **checks) != MATH or \
            cuda_backend(capability, dtype, head_dim, **checks) == MATH:
        return None
    fix = ("in bfloat16 or float16 flash attention takes it" if capability >= (8, 0) else
           "before compute capability 8.0 no fused kernel takes grouped heads")
    return (f"SDPA runs PyTorch's math kernel here: {dtype} attention with {heads} query heads over {kv_heads} "
            f"key/value heads has no fused kernel up to PyTorch 2.13, so every layer keeps its full score matrix "
            f"(as eager attention does); {fix}")


def logsumexp_length(backend: str, q_len: int) -> int:
    return -(-q_len // 32) * 32 if backend == EFFICIENT else q_len


def backward_scratch(backend: str, *, batch: int, heads: int, q_len: int, head_dim: int,
                     dtype: str) -> list[tuple[int, str]]:
    """(numel, dtype) of each buffer the kernel's backward allocates and frees besides the input gradients."""
    if backend == FLASH:
        rows = batch * heads * -(-q_len // 128) * 128
        rounded = -(-head_dim // (32 if head_dim <= 128 else 64)) * (32 if head_dim <= 128 else 64)
        return [(rows * rounded, "float32"), (rows, "float32")]
    if backend == EFFICIENT:
        delta = [(batch * heads * q_len, "float32")]
        return delta + ([(batch * heads * q_len * head_dim, "float32")] if dtype == "float32" else [])
    return []
