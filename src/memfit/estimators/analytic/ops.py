"""Symbolic PyTorch ops: what each allocates, what autograd saves, and what autocast casts.

Save rules follow PyTorch's derivatives (tools/autograd/derivatives.yaml); autocast lists follow
aten/src/ATen/autocast_mode.cpp for CPU and CUDA; attention and dropout follow the kernels each
backend runs (see also estimators/cuda_emulation.py, which makes the traced estimator do the same).
"""
from __future__ import annotations

from collections.abc import Callable

from memfit.core.weight_formats import BNB_BLOCK
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.symbols import Alias, Param, Sym, View
from memfit.estimators.sdpa_backend import FLASH, MATH, backward_scratch, cuda_backend, logsumexp_length

HALF = ("bfloat16", "float16")
_LOWER = {"linear", "matmul", "sdpa", "conv"}
_FP32_INPUT = {"cpu": {"cross_entropy", "nll_loss", "mse_loss"},
               "cuda": {"layer_norm", "pow", "exp", "log", "rsqrt", "softplus", "nll_loss", "mse_loss"}}
_FP32_OUTPUT = {"cpu": set(), "cuda": {"softmax", "log_softmax", "sum"}}


def promote(a: str, b: str) -> str:
    if a == b:
        return a
    if "float32" in (a, b):
        return "float32"
    return a if a in HALF else b


def cast(e: Engine, x: Sym, dtype: str) -> Sym:
    """`x.to(dtype)`: a new tensor when the dtype changes; its backward casts the gradient back."""
    if x.dtype == dtype:
        return x
    return e.record(e.new(x.numel, dtype), [x], [], grad_dtypes=[x.dtype])


def autocast_input(e: Engine, x: Sym, op: str) -> Sym:
    if not e.autocast_on or x.dtype not in ("float32",) + HALF:
        return x
    if op in _LOWER:
        assert e.policy.autocast_dtype is not None   # autocast_on: the policy has an autocast dtype
        return weight(e, x) if isinstance(x, Param) else cast(e, x, e.policy.autocast_dtype)
    if op in _FP32_INPUT[e.policy.backend] and x.dtype in HALF:
        return cast(e, x, "float32")
    return x


def weight(e: Engine, p: Param) -> Sym:
    """A parameter as an autocast region sees it: cast once per region and cached (autocast's cache),
    except a frozen one's (autocast caches only leaves that require grad): cast anew at every use."""
    target = e.policy.autocast_dtype
    if not e.autocast_on or p.dtype == target:
        return p
    assert target is not None   # autocast_on: the policy has an autocast dtype
    if p.frozen:
        return cast(e, p, target)
    cached = e.cast_cache.get(p.name)
    if cached is None:
        cached = e.cast_cache[p.name] = cast(e, p, target)
    return cached


def _saves(a: Sym, b: Sym) -> list[Sym]:
    """Binary ops like mul/matmul: each operand is saved when the *other* one needs a gradient."""
    return ([b] if a.grad else []) + ([a] if b.grad else [])


LinearKernel = Callable[[Engine, Sym, Param, int, "Param | None"], Sym]
# how a linear on a quantized weight runs, by the name its weight format gives (core/weight_formats.py `kernel`)
LINEAR_KERNELS: dict[str, LinearKernel] = {}


def linear_kernel(name: str) -> Callable[[LinearKernel], LinearKernel]:
    """Register the function below as the linear kernel `name` (a weight format names it)."""
    def register(kernel: LinearKernel) -> LinearKernel:
        if LINEAR_KERNELS.get(name, kernel) is not kernel:
            raise ValueError(f"linear kernel {name} is already registered")
        LINEAR_KERNELS[name] = kernel
        return kernel
    return register


def linear(e: Engine, x: Sym, w: Param, out_features: int, bias: Param | None = None) -> Sym:
    if w.quant is not None:   # peft's LoRA layer on a quantized base clones the base output first
        out = LINEAR_KERNELS[w.quant.kernel](e, x, w, out_features, bias)
        return out if w.lora is None else _add_lora(e, x, w, copy(e, out), out_features)
    x_in = autocast_input(e, x, "linear")
    w_in = weight(e, w)
    tokens = x.numel // (w.numel // out_features)
    out = e.op_output(tokens * out_features, x_in.dtype, "mm" if bias is None else "addmm")
    inputs = [x_in, w_in] + ([weight(e, bias)] if bias is not None else [])
    out = e.record(out, inputs, _saves(x_in, w_in))
    del x_in, w_in
    return out if w.lora is None else _add_lora(e, x, w, out, out_features)


def _add_lora(e: Engine, x: Sym, w: Param, out: Sym, out_features: int) -> Sym:
    """peft's LoRA linear: base(x) + B(A(x)) * scaling, each step a new tensor."""
    assert w.lora is not None   # linear calls this only for a weight with adapters
    a, b = w.lora
    low = linear(e, x, a, a.shape[0])
    return add(e, out, scalar_op(e, linear(e, low, b, out_features)))


@linear_kernel("int8_weight")
def int8_linear(e: Engine, x: Sym, w: Param, out_features: int, bias: Param | None) -> Sym:
    """torchao's int8 weight-only linear (inference): the codes converted to x's dtype, x @ that, then the
    row scales (and the bias) applied out of place."""
    tokens = x.numel // (w.numel // out_features)
    converted = e.new(w.numel, x.dtype)
    product = e.new(tokens * out_features, x.dtype)
    del converted
    out = e.new(tokens * out_features, x.dtype)
    del product
    if bias is not None:
        out = e.new(tokens * out_features, x.dtype)
    return out


@linear_kernel("int4_weight")
def int4_linear(e: Engine, x: Sym, w: Param, out_features: int, bias: Param | None) -> Sym:
    """torchao's int4 weight-only linear (inference): one kernel on the packed codes, its output the only tensor
    (the bias added in place). CUDA's path also pads a bf16 copy of the input to a multiple of 1024 inputs (none
    for Llama's sizes): not modelled."""
    return e.new(x.numel // w.shape[1] * out_features, x.dtype)


@linear_kernel("fake_quant")
def qat_linear(e: Engine, x: Sym, w: Param, out_features: int, bias: Param | None) -> Sym:
    """torchao's FakeQuantizedLinear (qat): the input and the weight each fake-quantized, then x @ w."""
    x_q, w_q = fake_quantize(e, x), fake_quantize(e, w)
    tokens = x.numel // w.shape[1]
    out = e.record(e.op_output(tokens * out_features, x.dtype, "quantized"), [x_q, w_q], _saves(x_q, w_q))
    return out if bias is None else add(e, out, bias)


def fake_quantize(e: Engine, t: Sym) -> Sym:
    """torchao's int8 fake quantization of `t` (its per-row scales are small and left out): t / scale,
    round, + zero point (saved: backward's in-range mask), clamp, a float copy, - zero point, * scale.
    Backward: the gradient scaled, two boolean range masks, torch.where, then the input's gradient."""
    scaled = e.new(t.numel, t.dtype)
    rounded = e.new(t.numel, t.dtype)
    del scaled
    shifted = e.new(t.numel, t.dtype)
    del rounded
    clamped = e.new(t.numel, t.dtype)
    copied = e.new(t.numel, t.dtype)
    centred = e.new(t.numel, t.dtype)
    del copied
    out = e.new(t.numel, t.dtype)
    del centred, clamped
    return e.record(out, [t], [shifted], scratch=[(t.numel, t.dtype), (t.numel, "bool"), (t.numel, "bool")])


@linear_kernel("int8_dynamic")
def int8_dynamic_linear(e: Engine, x: Sym, w: Param, out_features: int, bias: Param | None) -> Sym:
    """torchao's int8 dynamic-activation int8-weight linear (inference), as its CPU path runs: each token's
    activations quantized (x / scale, round, + zero point, clamp: x-sized, two alive at a time, then int8),
    shifted to uint8 for the u8 x s8 kernel through two int32 copies, the int32 product, then converted to
    float and scaled twice (the per-token scales are small and left out)."""
    tokens = x.numel // w.shape[1]
    n_in, n_out = x.numel, tokens * out_features
    step = e.new(n_in, x.dtype)
    for _ in range(3):              # round, + zero point, clamp: each frees the one before
        step = e.new(n_in, x.dtype)
    codes = e.new(n_in, "int8")
    del step
    shifted = e.new(n_in, "int32")
    shifted = e.new(n_in, "int32")
    unsigned = e.new(n_in, "uint8")
    del shifted
    product = e.new(n_out, "int32")
    as_float = e.new(n_out, x.dtype)
    scaled = e.new(n_out, x.dtype)
    del as_float, unsigned, product
    out = e.new(n_out, x.dtype)
    del scaled, codes
    if bias is not None:
        out = e.new(n_out, x.dtype)
    return out


@linear_kernel("bnb_4bit")
def linear_4bit(e: Engine, x: Sym, w: Param, out_features: int, bias: Param | None) -> Sym:
    """bitsandbytes' Linear4bit: x cast to the compute dtype (the autocast dtype, else the weight's), the
    block scales dequantized (double quantization: float32, once plus once with the offset added), the
    whole weight dequantized to the compute dtype, x @ that; the output cast back to x's dtype. Nothing
    is saved for backward, which dequantizes the weight again in its original dtype and casts it to the
    gradient's."""
    assert w.quant is not None and w.quant.format is not None   # linear calls this only for a stored format
    original, double_quant = w.quant.original, w.quant.format.nested_scales
    compute = e.policy.autocast_dtype or original
    x_in = cast(e, x, compute)
    numel = w.shape[0] * w.shape[1]
    tokens, blocks = x.numel // w.shape[1], -(-numel // BNB_BLOCK)
    scales = e.new(blocks, "float32") if double_quant else None
    if scales is not None:
        scales = e.new(blocks, "float32")    # + offset, out of place; the dequantized codes are freed
    weight_now = e.new(numel, compute)
    out = e.op_output(tokens * out_features, compute, "quantized")
    del scales, weight_now
    backward = [(numel, original)] + ([(numel, compute)] if compute != original else [])
    out = e.record(out, [x_in] + ([bias] if bias is not None else []), [], scratch=backward)
    return cast(e, out, x.dtype)


def patch_conv(e: Engine, x: Sym, w: Param, bias: Param, *, batch: int, channels: int, image: int,
               patch: int, out_channels: int) -> Sym:
    """Conv2d(channels, out_channels, kernel=stride=patch) over `batch` square images. On a CPU, oneDNN reorders
    the operands into blocked layouts inside the kernel, by an amount that depends on the CPU's instruction set
    (more with AMX bfloat16): that scratch is probed on the real kernel, as the trace does (kernel_probe.py)."""
    x_in, w_in = autocast_input(e, x, "conv"), weight(e, w)
    patches = (image // patch) ** 2
    forward_scratch, backward_scratch_bytes = (_cpu_conv_scratch(e, x_in, w_in, batch, channels, image, patch,
                                                                 out_channels)
                                               if e.policy.backend == "cpu" else (0, 0))
    scratch = e.new(forward_scratch, "uint8") if forward_scratch else None
    out = e.record(e.new(batch * patches * out_channels, x_in.dtype), [x_in, w_in, weight(e, bias)], [x_in, w_in],
                   scratch=[(backward_scratch_bytes, "uint8")] if backward_scratch_bytes else None)
    del scratch
    return out


def _cpu_conv_scratch(e: Engine, x_in: Sym, w_in: Sym, batch: int, channels: int, image: int, patch: int,
                      out_channels: int) -> tuple[int, int]:
    """(forward, backward) scratch bytes of the CPU convolution kernels for these shapes (0 when not probed)."""
    import torch

    from memfit.estimators.kernel_probe import probe_scratch

    dtype = getattr(torch, x_in.dtype)
    x = torch.empty((batch, channels, image, image), dtype=dtype, device="meta")
    w = torch.empty((out_channels, channels, patch, patch), dtype=dtype, device="meta")
    b = torch.empty((out_channels,), dtype=dtype, device="meta")
    geometry = ([patch, patch], [0, 0], [1, 1], False, [0, 0], 1)
    forward = probe_scratch(torch.ops.aten.convolution.default, (x, w, b, *geometry), {}, e.policy.train)
    backward = None
    if e.policy.train and w_in.grad:
        grad_out = torch.empty((batch, out_channels, image // patch, image // patch), dtype=dtype, device="meta")
        backward = probe_scratch(torch.ops.aten.convolution_backward.default,
                                 (grad_out, x, w, [out_channels], *geometry, [x_in.grad, True, True]), {}, False)
    return (forward[0] if forward else 0), (backward[0] if backward else 0)


def matmul(e: Engine, a: Sym, b: Sym, out_numel: int) -> Sym:
    a, b = autocast_input(e, a, "matmul"), autocast_input(e, b, "matmul")
    return e.record(e.op_output(out_numel, promote(a.dtype, b.dtype), "bmm"), [a, b], _saves(a, b))


def add(e: Engine, a: Sym, b: Sym) -> Sym:
    """Backward hands the same gradient to both inputs (a reduction only for a broadcast input)."""
    return e.record(e.new(max(a.numel, b.numel), promote(a.dtype, b.dtype)), [a, b], [], passthrough=True)


def add_(e: Engine, x: Sym, other: Sym) -> Sym:
    """x.add_(other): no new memory; the result is x's next version."""
    return e.record(Alias(x, x.numel, x.dtype), [x, other], [], passthrough=True)


def shift(e: Engine, x: Sym) -> Sym:
    """x + c, x - c: a new tensor; backward passes the gradient on."""
    return e.record(e.new(x.numel, x.dtype), [x], [], passthrough=True)


def mul(e: Engine, a: Sym, b: Sym) -> Sym:
    return e.record(e.new(max(a.numel, b.numel), promote(a.dtype, b.dtype)), [a, b], _saves(a, b))


def scalar_op(e: Engine, x: Sym) -> Sym:
    """x * c, x / c, -x: a new tensor, nothing saved; backward scales the gradient (a new tensor)."""
    return e.record(e.new(x.numel, x.dtype), [x], [])


def copy(e: Engine, x: Sym) -> Sym:
    """`.contiguous()` / `.clone()` on a tensor whose layout forces a copy; backward passes the gradient on."""
    return e.record(e.new(x.numel, x.dtype), [x], [], passthrough=True)


def pow_scalar(e: Engine, x: Sym) -> Sym:
    """x ** c: backward computes grad * c * x ** (c - 1), two input-sized temporaries on the way."""
    x = autocast_input(e, x, "pow")
    return e.record(e.new(x.numel, x.dtype), [x], [x], scratch=[(x.numel, x.dtype), (x.numel, x.dtype)])


def reduce_last(e: Engine, x: Sym, dim_size: int) -> Sym:
    """mean/sum over the last dimension (keepdim)."""
    return e.record(e.new(x.numel // dim_size, x.dtype), [x], [])


def unary_saving_output(e: Engine, x: Sym, op: str = "") -> Sym:
    """rsqrt, tanh, sigmoid, relu, exp: backward needs the result."""
    x = autocast_input(e, x, op)
    out = e.new(x.numel, x.dtype)
    return e.record(out, [x], [out])


def unary_saving_input(e: Engine, x: Sym) -> Sym:
    """silu, gelu: backward needs the input."""
    return e.record(e.new(x.numel, x.dtype), [x], [x])


def softmax(e: Engine, x: Sym, op: str = "softmax", dtype: str | None = None) -> Sym:
    """softmax / log_softmax; `dtype` as the op's dtype argument (CUDA autocast adds float32 for half
    inputs). A dtype change converts the input first, except CUDA reading float16 directly to float32
    (half_to_float, for float16 only; its backward writes the gradient in float16)."""
    if dtype is None and e.autocast_on and x.dtype in HALF and op in _FP32_OUTPUT[e.policy.backend]:
        dtype = "float32"
    if dtype and dtype != x.dtype:
        if e.policy.backend == "cuda" and x.dtype == "float16" and dtype == "float32":
            out = e.new(x.numel, dtype)
            return e.record(out, [x], [out])
        x = cast(e, x, dtype)
    out = e.new(x.numel, x.dtype)
    return e.record(out, [x], [out])


def embedding(e: Engine, ids: Sym, table: Param, dim: int) -> Sym:
    return e.record(e.new(ids.numel * dim, table.dtype), [table], [])


def cat(e: Engine, parts: list[Sym]) -> Sym:
    dtype = parts[0].dtype
    for p in parts[1:]:
        dtype = promote(dtype, p.dtype)
    return e.record(e.new(sum(p.numel for p in parts), dtype), list(parts), [], passthrough=True)


def layer_norm(e: Engine, x: Sym, w: Param, b: Param | None, dim: int) -> Sym:
    x = autocast_input(e, x, "layer_norm")
    tokens = x.numel // dim
    out = e.new(x.numel, x.dtype)
    mean, rstd = e.new(tokens, "float32"), e.new(tokens, "float32")
    return e.record(out, [x, w] + ([b] if b is not None else []), [x, mean, rstd])


def dropout(e: Engine, x: Sym, p: float) -> Sym:
    if not e.policy.train or p == 0:
        return x
    if e.policy.backend == "cuda":   # fused native_dropout: a 1-byte mask
        mask = e.new(x.numel, "bool")
        return e.record(e.new(x.numel, x.dtype), [x], [mask])
    mask = e.new(x.numel, x.dtype)   # CPU: empty_like(x).bernoulli_(), then x * mask
    return e.record(e.new(x.numel, x.dtype), [x], [mask])


def sdpa(e: Engine, q: Sym, k: Sym, v: Sym, *, batch: int, heads: int, q_len: int, kv_len: int,
         head_dim: int, dropout_p: float = 0.0, mask: Sym | None = None, causal: bool = False,
         kv_heads: int | None = None, value_head_dim: int | None = None) -> Sym:
    """F.scaled_dot_product_attention as the backend runs it; returns the output in (b, s, heads*d) layout.
    A boolean mask is first turned into a float one in q's dtype, by every backend. `kv_heads` below `heads`:
    grouped-query attention (enable_gqa), k and v holding kv_heads heads. `value_head_dim`: the values' (and the
    output's) head size where it differs from the queries' (DeepSeek's latent attention)."""
    out_dim = value_head_dim or head_dim
    groups = heads // (kv_heads or heads)
    q, k, v = (autocast_input(e, t, "sdpa") for t in (q, k, v))
    if mask is not None and mask.dtype == "bool":
        mask = e.new(mask.numel, q.dtype)
    extra = []
    if e.policy.backend == "cpu" and isinstance(v, View) and v.numel <= v.base.numel:
        extra.append(copy(e, v))   # the CPU kernel also keeps a contiguous copy of a strided value (a slice; an
        #                            expanded one, as repeat_kv leaves a single key/value head, stays as it is)
    rows = batch * heads * q_len
    if e.policy.backend == "cuda":
        kernel = cuda_backend(e.policy.capability, q.dtype, head_dim, mask=mask is not None,
                              causal_unequal=causal and q_len != kv_len, needs_grad=e.policy.train,
                              grouped=groups > 1, forced=e.policy.attention_kernel, value_head_dim=out_dim)
    else:   # the CPU's flash kernel, unless dropout is on in training or the values' heads differ in size
        kernel = FLASH if (dropout_p == 0 or not e.policy.train) and head_dim <= 256 and out_dim == head_dim else MATH
    if kernel == MATH:
        return _sdpa_math(e, q, k, v, rows=rows, batch=batch, q_len=q_len, kv_len=kv_len, head_dim=out_dim,
                          dropout_p=dropout_p, mask=mask, causal=causal, groups=groups)
    out = e.op_output(rows * out_dim, q.dtype, "attention")
    lse = e.op_output(batch * heads * logsumexp_length(kernel, q_len), "float32", "attention")
    scratch = backward_scratch(kernel, batch=batch, heads=heads, q_len=q_len, head_dim=head_dim,
                               dtype=q.dtype) if e.policy.backend == "cuda" else []
    saved = [q, k, v, out, lse] + ([mask] if mask is not None else []) + extra
    inputs = [q, k, v] + ([mask] if mask is not None and mask.grad else [])   # a learned bias gets a gradient
    return e.record(out, inputs, saved, scratch=scratch)


def _sdpa_math(e: Engine, q: Sym, k: Sym, v: Sym, *, rows: int, batch: int, q_len: int, kv_len: int, head_dim: int,
               dropout_p: float, mask: Sym | None, causal: bool, groups: int) -> Sym:
    """PyTorch's composite attention: scaled q and k, the full score matrix, softmax, dropout, then the
    output made contiguous in (b, s, heads*d) layout. Half inputs are computed in float32 (CUDA too, unless
    allow_fp16_bf16_reduction_math_sdp is set); grouped keys and values are repeated to every query head."""
    acc = "float32" if q.dtype in HALF else q.dtype
    autocast, e.autocast_on = e.autocast_on, False   # the kernel runs below autocast
    try:
        return _sdpa_math_body(e, q, k, v, acc=acc, rows=rows, batch=batch, q_len=q_len, kv_len=kv_len,
                               head_dim=head_dim, dropout_p=dropout_p, mask=mask, causal=causal, groups=groups)
    finally:
        e.autocast_on = autocast


def _sdpa_math_body(e: Engine, q: Sym, k: Sym, v: Sym, *, acc: str, rows: int, batch: int, q_len: int,
                    kv_len: int, head_dim: int, dropout_p: float, mask: Sym | None, causal: bool,
                    groups: int) -> Sym:
    """q, k, v arrive as (b, heads, s, d) views of a (b, s, heads*d) projection: folding (b, heads) for
    the batched matmul copies them unless the batch is 1. Grouped k and v are repeated first (repeat_interleave:
    a contiguous copy, which then folds without another)."""
    fold = copy if batch > 1 else (lambda _e, x: x)
    if not e.policy.train:   # half inputs: q, k and v converted first, each kept until the kernel returns
        q, k, v = (cast(e, x, acc) for x in (q, k, v))
    causal_mask = [e.new(q_len * kv_len, "bool"), e.new(q_len * kv_len, acc)] if causal and mask is None else []
    q_s = fold(e, scalar_op(e, cast(e, q, acc)))       # q * sqrt(scale)
    if groups > 1:
        k, v = (copy(e, View(x, x.numel * groups)) for x in (cast(e, k, acc), cast(e, v, acc)))
    fold_kv = fold if groups == 1 else (lambda _e, x: x)   # the repeated copies are contiguous
    k_s = fold_kv(e, scalar_op(e, cast(e, k, acc)))       # k^T * sqrt(scale)
    scores = matmul(e, q_s, k_s, rows * kv_len)
    del q_s, k_s
    if mask is not None:
        scores = add_(e, scores, mask)
    probs = softmax(e, scores, "softmax")
    del scores, causal_mask
    probs = dropout(e, probs, dropout_p)
    v_c = fold_kv(e, cast(e, v, acc))
    out = matmul(e, probs, v_c, rows * head_dim)
    del probs, v_c
    return copy(e, cast(e, out, q.dtype))


def cross_entropy(e: Engine, logits: Sym, *, batch: int, seq: int, shift: bool, upcast: bool = True) -> Sym:
    """F.cross_entropy as Hugging Face calls it: after logits.float() (`upcast`, its causal-LM loss),
    with labels padded and shifted (`shift`, causal LM) or as given (masked LM, classification).
    cross_entropy_loss is log_softmax(x, dtype=x's own) then nll_loss: CPU autocast runs the whole loss in
    float32; CUDA autocast only nll_loss, on a float32 copy of the half log-probabilities that it keeps."""
    logits32 = cast(e, logits, "float32") if upcast else logits
    target = None
    if shift:
        padded = e.new(batch * (seq + 1), "int64")   # F.pad(labels, (0, 1), value=-100)
        target = e.new(batch * seq, "int64")          # labels[..., 1:].contiguous()
        del padded
    x = autocast_input(e, logits32, "cross_entropy")
    log_probs = softmax(e, x, "log_softmax", dtype=x.dtype)
    del logits32, x
    log_probs = autocast_input(e, log_probs, "nll_loss")
    loss, total_weight = e.new(1, "float32"), e.new(1, "float32")
    return e.record(loss, [log_probs], [log_probs, total_weight] + ([target] if target is not None else []))
