"""What CUDA would run, emulated on fake CPU tensors for a GPU target.

A CPU trace runs CPU kernels and CPU autocast; a GPU runs different ones, with different memory:

- Dropout: CUDA's fused `native_dropout` keeps a 1-byte mask; the CPU path keeps a full-size
  float mask. Emulated with `native_dropout`.
- Attention: CUDA's SDPA picks the flash, memory-efficient or math kernel by PyTorch's own rules
  (sdpa_backend.py); the fused ones save q, k, v, the output and a float32 log-sum-exp, where CPU
  falls back to the math path (the full attention matrix) whenever dropout is on. Emulated with an
  autograd function around the real CUDA op (run on fake tensors, so checkpoint policies see it) whose
  backward allocates the kernel's scratch, such as flash-attention's float32 dq accumulator.
- Autocast: CUDA's op lists differ from CPU's (layer_norm, softmax, pow, exp, log_softmax run in
  float32 on CUDA). Emulated at the torch-function level, above autograd like real autocast, with
  its weight-cast cache. Regions nested inside the model (e.g. `autocast(enabled=False)` around
  rotary embeddings) turn the emulation off, as they would turn CUDA autocast off.
- Softmax to float32: `softmax(x, dim, dtype=float32)` on a float16 x (autocast's, or a model's own, as eager
  attention's) reads x directly on CUDA (`_softmax(x, dim, half_to_float=True)`), and its backward writes the
  gradient in float16; the CPU, and CUDA for bfloat16, convert x first (SoftMax.cpp `softmax`, `log_softmax`).
- Cross-entropy: `cross_entropy_loss` calls log_softmax with the input's own dtype, which autocast leaves alone,
  then nll_loss, which CUDA autocast runs on a float32 copy that it keeps for backward (LossNLL.cpp).

These are models of CUDA behaviour written from PyTorch's autocast lists and kernel sources;
`benchmarks/gpu_validate` checks them against a real GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memfit.core.dtypes import dtype_name
from memfit.estimators.sdpa_backend import FLASH, MATH, backward_scratch, cuda_backend, enabled_backends

_LOWER = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
          torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm,
          torch.baddbmm, torch.Tensor.baddbmm, torch.addbmm, torch.mv, torch.addmv, torch.einsum,
          F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.prelu}
_FP32 = {F.layer_norm, F.group_norm, torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.Tensor.__rpow__,
         torch.exp, torch.Tensor.exp, torch.expm1, torch.log, torch.Tensor.log, torch.log10, torch.log2,
         torch.log1p, torch.reciprocal, torch.Tensor.reciprocal, torch.rsqrt, torch.Tensor.rsqrt, torch.acos,
         torch.asin, torch.cosh, torch.erfinv, torch.sinh, torch.tan, F.softplus, F.cosine_similarity,
         F.nll_loss, F.kl_div, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.mse_loss, F.margin_ranking_loss,
         F.binary_cross_entropy_with_logits, torch.dist, torch.cdist, torch.logsumexp, torch.Tensor.logsumexp,
         F.poisson_nll_loss, F.cosine_embedding_loss, F.hinge_embedding_loss, F.soft_margin_loss,
         F.triplet_margin_loss, F.multi_margin_loss, F.multilabel_margin_loss, F.interpolate}
_FP32_OUTPUT = {F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax,
                torch.Tensor.log_softmax, torch.sum, torch.Tensor.sum, torch.prod, torch.Tensor.prod,
                torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod}
_HALF = (torch.float16, torch.bfloat16)


def _nesting() -> int:
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return level - 1


class CudaAutocast:
    """`torch.autocast("cuda", dtype)` for fake CPU tensors (see module docstring)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.cache: dict[int, torch.Tensor] = {}
        self.level = -1

    def __enter__(self):
        self._region = torch.autocast("cpu", enabled=False)   # a region other autocasts nest inside
        self._region.__enter__()
        self.level = _nesting()
        self._mode = _AutocastMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._region.__exit__(*exc)
        self.cache.clear()
        return False

    @property
    def active(self) -> bool:
        return _nesting() == self.level

    def cast(self, value, dtype: torch.dtype):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()) or value.dtype in (dtype, torch.float64):
            return value
        if value.is_leaf and value.requires_grad and not torch.compiler.is_compiling():
            # weights: cast once per region, as autocast caches (a compiled graph casts them inside the graph,
            # where the partitioner may recompute the cast in backward rather than keep it)
            cached = self.cache.get(id(value))
            if cached is None or cached.dtype != dtype:
                cached = self.cache[id(value)] = value.to(dtype)
            return cached
        return value.to(dtype)


def _map(values, fn):
    if isinstance(values, (list, tuple)):
        return type(values)(_map(v, fn) for v in values)
    return fn(values)


class _AutocastMode(TorchFunctionMode):
    autocast_region = True     # a checkpoint re-run enters a region of its own instead of this one
    def __init__(self, owner: CudaAutocast) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if not owner.active:
            return func(*args, **kwargs)
        if func in _LOWER or func is F.scaled_dot_product_attention:
            cast = lambda v: owner.cast(v, owner.dtype)  # noqa: E731
            return func(*_map(args, cast), **{k: _map(v, cast) for k, v in kwargs.items()})
        if func in _FP32:
            cast = lambda v: owner.cast(v, torch.float32) if isinstance(v, torch.Tensor) and v.dtype in _HALF else v  # noqa: E731
            return func(*_map(args, cast), **{k: _map(v, cast) for k, v in kwargs.items()})
        if func in _FP32_OUTPUT and kwargs.get("dtype") is None and args and \
                isinstance(args[0], torch.Tensor) and args[0].dtype in _HALF:
            kwargs = {**kwargs, "dtype": torch.float32}   # F.softmax passes dtype=None on
            found = _half_to_float_softmax(func, args, kwargs)
            return func(*args, **kwargs) if found is None else found
        if func is F.cross_entropy and args[0].dtype in _HALF and not kwargs.get("label_smoothing"):
            return _cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)


_SOFTMAX = {F.softmax: torch._softmax, torch.softmax: torch._softmax, torch.Tensor.softmax: torch._softmax,
            F.log_softmax: torch._log_softmax, torch.log_softmax: torch._log_softmax,
            torch.Tensor.log_softmax: torch._log_softmax}


def _half_to_float_softmax(func, args, kwargs) -> torch.Tensor | None:
    """CUDA's softmax / log_softmax of a float16 tensor to float32 (see the module docstring), or None for another
    call. The aten op's own autograd formula gives the gradient in float16."""
    kernel = _SOFTMAX.get(func)
    x = args[0] if args else kwargs.get("input")
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if kernel is None or kwargs.get("dtype") != torch.float32 or not isinstance(x, torch.Tensor) or \
            x.dtype != torch.float16 or not isinstance(dim, int):
        return None
    return kernel(x, dim, True)


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    # what CUDA autocast makes of cross_entropy_loss: log_softmax in the input's dtype, nll_loss on a float32 copy
    log_probs = F.log_softmax(input, 1 if input.dim() > 1 else 0, dtype=input.dtype)
    return F.nll_loss(log_probs.float(), target, weight, None, ignore_index, None, reduction)


class CudaKernels(TorchFunctionMode):
    """Dropout and attention as CUDA's fused kernels on a GPU of `capability` allocate them (active for the whole
    GPU trace)."""

    def __init__(self, capability: tuple[int, int], kernel: str | None = None) -> None:
        super().__init__()
        self.capability, self.kernel = capability, kernel   # kernel: one the model's attention always runs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return _dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return _sdpa(self.capability, self.kernel, *args, **kwargs)
        if func in _SOFTMAX:
            found = _half_to_float_softmax(func, args, kwargs)
            if found is not None:
                return found
        return func(*args, **kwargs)


def _dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0:
        return input
    return torch.native_dropout(input, p, True)[0]


class _FusedAttention(torch.autograd.Function):
    """A fused attention kernel's memory: the real op (flash or memory-efficient: what a checkpoint policy sees)
    makes the output and the float32 logsumexp on fake tensors; backward allocates the kernel's scratch."""

    @staticmethod
    def forward(ctx, q, k, v, mask, kernel, dropout_p, is_causal, scale):
        if kernel == FLASH:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                          scale=scale)[:2]
        else:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, dropout_p,
                                                                              is_causal, scale=scale)[:2]
        ctx.kernel = kernel
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors      # unpacked once: a checkpoint re-run allows only one unpack
        q, k, v = saved[:3]
        b, heads, length, head_dim = q.shape
        scratch = [torch.empty(numel, dtype=getattr(torch, dtype), device=q.device) for numel, dtype in
                   backward_scratch(ctx.kernel, batch=b, heads=heads, q_len=length, head_dim=head_dim,
                                    dtype=dtype_name(q.dtype))]
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del scratch
        mask = saved[5] if len(saved) > 5 else None
        mask_grad = torch.empty_like(mask) if mask is not None and ctx.needs_input_grad[3] else None
        return (*grads, mask_grad, None, None, None, None)


def _sdpa(capability, forced, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    kernel = cuda_backend(capability, dtype_name(query.dtype), query.shape[-1],
                          mask=attn_mask is not None, causal_unequal=is_causal and query.shape[-2] != key.shape[-2],
                          needs_grad=needs_grad, grouped=query.shape[-3] != key.shape[-3], forced=forced,
                          enabled=enabled_backends(), value_head_dim=value.shape[-1])
    if attn_mask is not None and attn_mask.dtype == torch.bool:   # SDPA converts boolean masks for every backend
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"),
                                torch.zeros((), dtype=query.dtype, device=query.device))   # convert_boolean_attn_mask
    if kernel == MATH:   # the composite, as CUDA runs it when no fused kernel takes the inputs
        return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                                 scale=scale, enable_gqa=enable_gqa)[0]
    return _FusedAttention.apply(query, key, value, attn_mask, kernel, dropout_p, is_causal, scale)
