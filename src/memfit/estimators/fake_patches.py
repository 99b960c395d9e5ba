"""Decisions that libraries take by reading tensor data, taken under fake tensors as the real run takes them.

Fake tensors have no values, so code that inspects values either fails or (transformers'
`is_tracing`) assumes the worst. Each patch below answers what the real run answers for the batches
memfit builds (no padding, one sequence per row), and is checked by the traced-vs-measured tests.
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


@contextlib.contextmanager
def real_data_decisions():
    patches = []
    try:
        import transformers.masking_utils as masking
    except ImportError:  # no transformers: nothing to patch
        masking = None
    if masking is not None and hasattr(masking, "find_packed_sequence_indices"):
        # Training without a cache: HF checks position ids for packed sequences; memfit's are one
        # arange per row, so the real run finds none and keeps SDPA's is_causal fast path.
        patches.append((masking, "find_packed_sequence_indices", lambda position_ids: None))
    if torch.distributed.is_available():
        patches += _device_mesh_patches()
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    hooks = [register_module_forward_pre_hook(_entering_experts),
             register_module_forward_hook(_leaving_experts, always_call=True)]
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        for hook in hooks:
            hook.remove()


_in_experts = [0]   # how deep the run is inside a mixture's experts module (transformers' fused experts)


def _is_experts(module: torch.nn.Module) -> bool:
    weight = getattr(module, "gate_up_proj", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 3


def _entering_experts(module, args):
    if _is_experts(module):
        _in_experts[0] += 1


def _leaving_experts(module, args, output):
    if _is_experts(module):
        _in_experts[0] -= 1


def _device_mesh_patches() -> list:
    """A 2-D mesh's axes (DeviceMesh.__getitem__) and FSDP2 over a tensor-parallel block (it joins the two meshes,
    DeviceMesh._concatenate) build each mesh's rank tensor and find this rank in it: real values, built and read as
    the real run does (under the trace's modes the rank is not found and every shard comes out empty)."""
    from torch.distributed.device_mesh import DeviceMesh

    return [(DeviceMesh, "_concatenate", staticmethod(_with_real_tensors(DeviceMesh._concatenate))),
            (DeviceMesh, "__getitem__", _with_real_tensors(DeviceMesh.__getitem__))]


def _with_real_tensors(fn):
    def run(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return run


class TraceMode(TorchDispatchMode):
    """A dispatch mode of memfit's traces. torch.compile compiles with it off and runs the compiled graphs' ops
    under it (-t compile), as under the eager step's."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class FakeKernelFixes(TraceMode):
    """A dispatch mode for fake runs only: shape rules that PyTorch's meta kernels get wrong on CPU.

    `aten._grouped_mm` (MoE experts): the meta kernel insists on bf16, as CUDA does, but the CPU
    kernel also takes fp32; the output shape does not depend on the dtype.
    `.item()` of a computed value (Adafactor's update norm): fake tensors have no value; memory does
    not depend on it, so the trace reads 1 (and False for booleans) and goes on.
    `aten.nonzero` of a computed mask inside a mixture's experts module (transformers' eager experts loop:
    which experts the tokens were routed to, then one expert's (slot, token) mask; anywhere else it stays
    an error, which names the user's line): fake tensors have no values, so the trace takes
    the most a router can give — every expert hit, and every token routed to each (once: a token
    picks an expert in one of its slots, so a 2-D mask holds one nonzero per column at most). An
    upper bound on the loop's temporaries; a balanced router gives each expert top_k / experts of that.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and getattr(args[0], "item_memo", None) is None \
                and getattr(args[0], "constant", None) is None:
            return False if args[0].dtype == torch.bool else 1
        if func is torch.ops.aten.nonzero.default and _in_experts[0] and isinstance(args[0], FakeTensor) \
                and getattr(args[0], "constant", None) is None:
            rows = args[0].shape[-1] if args[0].dim() == 2 else args[0].numel()
            return torch.empty((rows, args[0].dim()), dtype=torch.int64, device=args[0].device)
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            with _disable_current_modes():
                metas = [torch.empty(a.shape, device="meta", dtype=torch.bfloat16 if a.is_floating_point() else a.dtype)
                         if isinstance(a, torch.Tensor) else a for a in args]
                shape = func(*metas, **{k: v for k, v in kwargs.items() if k != "out_dtype"}).shape
            return torch.empty(shape, dtype=kwargs.get("out_dtype") or args[0].dtype, device=args[0].device)
        return func(*args, **kwargs)
