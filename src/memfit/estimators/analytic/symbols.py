"""Symbolic tensors: (numel, dtype) that count themselves into their engine's bytes while alive. CPython's
reference counting frees them when the program lets go, as PyTorch's does."""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memfit.core.dtypes import BYTES
from memfit.core.weight_formats import WeightFormat

if TYPE_CHECKING:
    from memfit.estimators.analytic.engine import Engine


_serial = itertools.count()


def new_uid() -> int:
    """A uid no symbol has (a derived program's backward nodes: analytic/families/derived.py)."""
    return next(_serial)


def _allocated(eng: Engine, size: int) -> int:
    """`size` bytes as the engine's allocator rounds them."""
    step = eng.policy.round_to
    return -(-size // step) * step if step > 1 else size


class Sym:
    __slots__ = ("eng", "numel", "dtype", "grad", "category", "counted", "uid", "nbytes", "__weakref__")

    def __init__(self, eng: Engine, numel: int, dtype: str, grad: bool, category: str, counted: bool = True,
                 stored_dtype: str | None = None):
        """`stored_dtype`: what its bytes are stored in, when not `dtype` (a parameter's state_dtype)."""
        self.eng, self.numel, self.dtype, self.grad = eng, int(numel), dtype, grad
        self.category, self.counted = category, counted
        self.uid = next(_serial)
        self.nbytes = _allocated(eng, self.numel * BYTES[stored_dtype or dtype])   # as the allocator rounds them
        if counted:
            eng._account(self, +1)

    def __del__(self):
        if self.counted:
            try:   # noqa: SIM105 (contextlib.suppress would cost a call per tensor)
                self.eng._account(self, -1)
            except Exception:   # at interpreter shutdown
                pass


class Param(Sym):
    """A parameter: lives for the whole run, its gradient is accumulated into `.grad`."""

    __slots__ = ("name", "grad_sym", "shape", "lora", "frozen", "quant", "state_dtype")

    shape: tuple[int, ...]   # set by Engine.param (and weights.py for quantized codes), not here

    def __init__(self, eng: Engine, name: str, numel: int, dtype: str, trainable: bool = True,
                 state_dtype: str | None = None):
        # `dtype`: what the program computes with; `state_dtype`: what is stored (the parameter, its gradient and
        # optimizer states), which differs under FSDP2's MixedPrecisionPolicy (float32 shards gathered in bf16)
        self.state_dtype = state_dtype or dtype
        super().__init__(eng, numel, dtype, trainable, "parameters", stored_dtype=self.state_dtype)
        self.name = name
        self.grad_sym: Sym | None = None
        self.lora: tuple[Param, Param] | None = None   # LoRA's (A, B) on this weight (techniques/adapters.py)
        self.frozen = False   # requires_grad=False (LoRA's base weights): autocast does not cache its casts
        self.quant: Quantized | None = None   # stored quantized, or fake-quantized (analytic/weights.py)


@dataclass
class Quantized:
    """How a quantized (or fake-quantized) weight's linears run."""

    kernel: str                  # ops.LINEAR_KERNELS' key
    original: str                # the weight's dtype before
    state: list[Param]           # its quantization state's parameters
    format: WeightFormat | None  # None: fake quantization (the weight stays as it was)


class View(Sym):
    """A view of another tensor: allocates nothing, keeps its base alive; its gradient flows back into a
    gradient the size of the base (as slice/expand backward allocate)."""

    __slots__ = ("base",)

    def __init__(self, base: Sym, numel: int) -> None:
        super().__init__(base.eng, numel, base.dtype, base.grad, base.category, counted=False)
        self.base = base
        base.eng.record(self, [base], [])


class Alias(Sym):
    """A gradient that is another gradient (add's and clone's backward pass it on unchanged; cat's
    hands out slices): no allocation, keeps the original alive."""

    __slots__ = ("base",)

    def __init__(self, base: Sym, numel: int, dtype: str) -> None:
        super().__init__(base.eng, numel, dtype, False, base.category, counted=False)
        self.base = base


class Offloaded:
    """A saved tensor copied to host RAM (activation offload): counted in the engine's host bytes while
    a node still holds it; backward brings a device copy back for the node that uses it."""

    __slots__ = ("eng", "numel", "dtype", "nbytes")

    def __init__(self, sym: Sym) -> None:
        self.eng, self.numel, self.dtype = sym.eng, sym.numel, sym.dtype
        self.nbytes = sym.numel * BYTES[sym.dtype]
        self.eng._host(+self.nbytes)

    def __del__(self):
        with contextlib.suppress(Exception):   # at interpreter shutdown
            self.eng._host(-self.nbytes)


def is_parameter(sym: Sym) -> bool:
    while isinstance(sym, View):
        sym = sym.base
    return isinstance(sym, Param)
