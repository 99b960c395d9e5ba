"""CPU kernels that allocate scratch no tensor accounts for, probed on real tensors of the same shape.

oneDNN's convolution and LSTM kernels reorder their operands into blocked layouts inside the kernel (a few times
the size of the activations). A fake tensor never runs a kernel (and the fake LSTM returns an empty workspace where
the real one keeps megabytes for backward), so for a CPU target the trace asks the real kernel: the op is run once
on random tensors shaped like its arguments, under the profiler, and the scratch (its allocator peak minus what it
returns) is added to the trace as a transient allocation after the op. Probes are cached per shape, so repeated
layers cost one probe; an op whose operands would exceed PROBE_LIMIT_BYTES is not probed (and the note says so).
Not probed: oneDNN's reorders inside a bfloat16 matrix product (0.1 to 1.5 MB for the shapes of the test zoo), as
probing every matmul would run the model's largest products for real.

One CPU scratch is modelled instead of probed, as it is exactly a copy: a mean of a bfloat16 or float16 tensor, and a
sum asked for another dtype, first convert the whole input (ATen's CPU mean sums in float32 over `self.to(float)`).
Probed once: a mean of bf16 [64, 1000] allocates 256,012 bytes beyond its result, the copy plus 12.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from memfit.estimators.fake_patches import TraceMode
from memfit.steps.profiler import allocator_events, start_profiler, stop_profiler

PROBE_LIMIT_BYTES = 1 << 30
PROBED_OPS = {
    torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
    torch.ops.aten.mkldnn_rnn_layer.default, torch.ops.aten.mkldnn_rnn_layer_backward.default,
}
HALF = (torch.bfloat16, torch.float16)
MEANS = (torch.ops.aten.mean.default, torch.ops.aten.mean.dim)
SUMS = (torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList)
_cache: dict[tuple, tuple[int, list[int]] | None] = {}


def _describe(value):
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    return value


def _real(value):
    if isinstance(value, torch.Tensor):   # random values with the same shape and strides (broadcasts too)
        span = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride())) if value.numel() else 0
        base = torch.randn(span) if value.is_floating_point() else torch.zeros(span)
        return base.to(value.dtype).as_strided(value.shape, value.stride())
    if isinstance(value, (list, tuple)):
        return type(value)(_real(v) for v in value)
    return value


def probe_scratch(func, args, kwargs, grad_enabled: bool = False) -> tuple[int, list[int]] | None:
    """(bytes the kernel allocates beyond what it returns, at its peak; bytes of each tensor it returns),
    or None when not probed. The probe runs in the caller's grad mode: kernels keep training buffers
    only when a backward will follow."""
    key = (str(func), grad_enabled, _describe(args), _describe(tuple(sorted(kwargs.items()))))
    if key in _cache:
        return _cache[key]
    operand_bytes = sum(t.untyped_storage().nbytes() for t in tree_leaves(args) if isinstance(t, torch.Tensor))
    if operand_bytes > PROBE_LIMIT_BYTES:
        _cache[key] = None
        return None

    with _disable_current_modes(), torch.set_grad_enabled(grad_enabled):
        real_args, real_kwargs = _real(args), {k: _real(v) for k, v in kwargs.items()}
        if func is torch.ops.aten.mkldnn_rnn_layer_backward.default:
            real_args = _rnn_backward_args(real_args)
        func(*real_args, **real_kwargs)                      # warm-up: first calls set up primitives
        prof = start_profiler()
        try:
            out = func(*real_args, **real_kwargs)
        finally:
            stop_profiler(prof)
        returned_bytes = [t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else 0 for t in tree_leaves(out)]
        del out
    events, _ = allocator_events(prof)
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    returned = max(running, 0)
    _cache[key] = (max(peak - returned, 0), returned_bytes)
    return _cache[key]


def _rnn_backward_args(args: list) -> list:
    """The LSTM backward reads the forward's outputs and workspace, which random data must not stand in
    for: run the real forward first and pass what it returns."""
    (inp, w1, w2, w3, w4, hx, cx, _out, _hy, _cy, grad_out, grad_hy, grad_cy, reverse, mode, hidden, layers,
     biases, train, bidirectional, batch_sizes, batch_first, _workspace) = args
    with torch.enable_grad():   # the kernel keeps its workspace only when a backward will follow
        weights = [w.detach().requires_grad_() for w in (w1, w2, w3, w4)]
        output, hy, cy, workspace = torch.ops.aten.mkldnn_rnn_layer.default(
            inp, *weights, hx, cx, reverse, batch_sizes, mode, hidden, layers, biases, bidirectional, batch_first, True)
    output, hy, cy, workspace = (t.detach() for t in (output, hy, cy, workspace))
    return [inp, w1, w2, w3, w4, hx, cx, output, hy, cy, grad_out, grad_hy, grad_cy, reverse, mode, hidden, layers,
            biases, train, bidirectional, batch_sizes, batch_first, workspace]


@functools.cache
def python_cpu_kernels() -> dict:
    """Custom ops whose CPU kernel is PyTorch code: the trace runs that code (instead of the op's fake,
    which allocates nothing), so its temporaries are seen. bitsandbytes' optimizer steps on CPU (8-bit:
    both states dequantized to float32; 32-bit) compute in float32, one parameter at a time."""
    from bitsandbytes.backends.cpu import ops as bnb_cpu

    return {torch.ops.bitsandbytes.optimizer_update_8bit_blockwise.default:
            bnb_cpu._optimizer_update_8bit_blockwise_cpu,
            torch.ops.bitsandbytes.optimizer_update_32bit.default: bnb_cpu._optimizer_update_32bit_cpu}


def reduction_copy_bytes(func, args, kwargs) -> int:
    """Bytes of the converted copy a CPU mean or sum makes of its input before reducing it (0 when none)."""
    if func in MEANS and args[0].dtype in HALF:
        return args[0].numel() * 4
    dtype = kwargs.get("dtype")
    if func in SUMS and dtype is not None and dtype != args[0].dtype:
        return args[0].numel() * dtype.itemsize
    return 0


class KernelScratchProbe(TraceMode):
    """Inside a fake CPU trace: after each probed op, allocate and free its measured scratch."""

    def __init__(self) -> None:
        super().__init__()
        self.probed: set[str] = set()
        self.skipped: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "bitsandbytes" and func in python_cpu_kernels():
            return python_cpu_kernels()[func](*args, **kwargs)
        grad_enabled = torch.is_grad_enabled()
        out = func(*args, **kwargs)
        converted = reduction_copy_bytes(func, args, kwargs)
        if converted:
            copy = torch.empty(converted, dtype=torch.uint8, device="cpu")
            del copy
        if func not in PROBED_OPS:
            return out
        probed = probe_scratch(func, args, kwargs, grad_enabled)
        if probed is None:
            self.skipped.add(func.__name__)
            return out
        scratch, returned = probed
        self.probed.add(func.__name__)
        if func is torch.ops.aten.mkldnn_rnn_layer.default and out[3].numel() != returned[3]:
            # the fake kernel returns an empty workspace; the real one keeps it for backward
            out = (*out[:3], torch.empty(returned[3], dtype=torch.uint8, device="cpu"))
        if scratch:
            workspace = torch.empty(scratch, dtype=torch.uint8, device="cpu")
            del workspace
        return out
