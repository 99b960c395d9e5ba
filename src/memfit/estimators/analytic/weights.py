"""Weights changed before the step, as the techniques' analytic hooks ask (techniques/base.py): quantized or
fake-quantized linears, low-rank adapters.

  quantize_linears(format)
                     every linear weight the format stores (core/weight_formats.py: which linears, the head
                     whether tied or not, a mixture's expert weights per expert and row) as its codes and its
                     quantization state, each a frozen parameter; a tied head gets its own codes.
  fake_quantize_linears()
                     every linear weight stays float32 and trains; its linears fake-quantize (ops.py).
  add_adapters(rank, targets)
                     every parameter frozen; each target weight W (out x in) gets a trainable A (rank x in) and B
                     (out x rank), which its linears run beside it.

How these linears compute is in ops.py (the kernel its format names: `LINEAR_KERNELS`).
"""
from __future__ import annotations

from collections.abc import Collection

from memfit.core.errors import NotModelled
from memfit.core.weight_formats import WeightFormat
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.symbols import Param, Quantized
from memfit.techniques.adapters import ALL_LINEAR


def _module_names(family, what: str) -> dict[str, str]:
    """Hugging Face module names -> the family program's parameter names (decoder families only)."""
    names = getattr(family, "MODULE_NAMES", None)
    if names is None:
        raise NotModelled(f"the analytic model has {what} for decoder families (Llama, Mistral, Qwen2, "
                          "...); use --method traced.")
    return names


EXPERTS = ("experts.gate_up", "experts.down")   # a mixture's fused expert weights (families/moe.py), 3-D


def quantize_linears(e: Engine, family, spec, fmt: WeightFormat) -> None:
    linears = set(_module_names(family, "quantized linears").values())
    if fmt.head:   # a tied head gets its own codes
        linears.add("lm_head")
        if getattr(spec, "tied", False) and "lm_head" not in e.params:
            e.param("lm_head", e.params["embed"].shape)

    def stored(name: str, param: Param) -> bool:
        if name.split(".", 2)[-1] in EXPERTS:   # layers.{i}.experts.gate_up
            return fmt.experts
        return name.rsplit(".", 1)[-1] in linears and len(param.shape) == 2 and fmt.stores(param.shape)

    for name, param in list(e.params.items()):
        if not stored(name, param):
            continue
        codes = Param(e, name, fmt.code_elements(param.numel), fmt.code_dtype, trainable=False)
        state = [Param(e, f"{name}.{suffix}", numel, dtype or param.dtype, False)
                 for suffix, numel, dtype in fmt.state_elements(param.shape)]
        codes.shape, codes.frozen = param.shape, True
        codes.quant = Quantized(fmt.kernel, param.dtype, state, fmt)
        e.params[name] = codes
        del param


def fake_quantize_linears(e: Engine, family) -> None:
    """Every linear (the LM head included: torchao prepares every nn.Linear) fake-quantizes its weight and input
    in each forward; the weights stay float32 and train."""
    linears = set(_module_names(family, "fake-quantized linears").values()) | {"lm_head"}
    for name, param in e.params.items():
        if name.rsplit(".", 1)[-1] in linears and len(param.shape) == 2:
            param.quant = Quantized("fake_quant", param.dtype, [], None)


def add_adapters(e: Engine, family, rank: int, targets: Collection[str]) -> None:
    """`targets`: Hugging Face module names (their last part), or (ALL_LINEAR,): every linear of the blocks."""
    names = _module_names(family, "adapters")
    targets = set(names.values()) if targets == (ALL_LINEAR,) else {names.get(t, t) for t in targets}
    for param in list(e.params.values()):
        param.grad, param.frozen = False, True
        if param.name.rsplit(".", 1)[-1] in targets and len(param.shape) == 2:
            out_features, in_features = param.shape
            param.lora = (e.param(param.name + ".lora_A", (rank, in_features)),
                          e.param(param.name + ".lora_B", (out_features, rank)))
