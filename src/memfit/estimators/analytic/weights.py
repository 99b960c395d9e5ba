"""Weights changed before the step, as the techniques' analytic hooks ask (techniques/base.py): quantized or
fake-quantized linears, low-rank adapters.

  quantize_linears("int8_weight" | "int8_dynamic")
                     every linear weight as int8 codes, a float32 scale and an int8 zero point per output row
                     (torchao); a head tied to the embeddings gets its own codes; a mixture of experts' expert
                     weights too, per expert and row (their linears: families/moe.py's eager loop).
  quantize_linears("int4_weight", group_size)
                     every linear weight whose input size the group divides, the head included (a tied one gets
                     its own codes), as two 4-bit codes per byte and, per group of inputs of each row, a scale
                     and a zero point in the weight's dtype (torchao's tinygemm layout).
  quantize_linears("4bit", double_quant)
                     every linear but the LM head as two 4-bit codes per byte and bitsandbytes' quantization
                     state: one absmax per block of 64 weights (float32, or with double quantization a uint8 code,
                     plus per 256 blocks a float32 absmax, a 256-entry code and an offset), and the format's
                     16-value code book.
  fake_quantize_linears()
                     every linear weight stays float32 and trains; its linears fake-quantize (ops.py).
  add_adapters(rank, targets)
                     every parameter frozen; each target weight W (out x in) gets a trainable A (rank x in) and B
                     (out x rank), which its linears run beside it.

How these linears compute is in ops.py (the kernel named by each weight's `quant`).
"""
from __future__ import annotations

from collections.abc import Collection

from memfit.core.errors import NotModelled
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.symbols import Param
from memfit.techniques.adapters import ALL_LINEAR
from memfit.techniques.quantization import BLOCK

BLOCKS_PER_SCALE = 256   # double quantization: one float32 absmax per 256 blocks


def _module_names(family, what: str) -> dict[str, str]:
    """Hugging Face module names -> the family program's parameter names (decoder families only)."""
    names = getattr(family, "MODULE_NAMES", None)
    if names is None:
        raise NotModelled(f"the analytic model has {what} for decoder families (Llama, Mistral, Qwen2, "
                          "...); use --method traced.")
    return names


KERNELS = ("int8_weight", "int8_dynamic", "int4_weight", "4bit")   # quantized linears ops.linear runs


def quantize_linears(e: Engine, family, spec, kind: str, double_quant: bool = False, group_size: int = 0) -> None:
    assert kind in KERNELS, kind
    linears = set(_module_names(family, "quantized linears").values())
    if kind.startswith("int"):   # torchao quantizes the head too; a tied one gets its own codes
        linears.add("lm_head")
        if getattr(spec, "tied", False) and "lm_head" not in e.params:
            e.param("lm_head", e.params["embed"].shape)
    experts = {"experts.gate_up", "experts.down"} if kind.startswith("int8") else set()   # per expert and row

    def quantizable(name: str, param: Param) -> bool:   # (int4: torchao skips a linear the group cannot split)
        return (name.rsplit(".", 1)[-1] in linears and len(param.shape) == 2
                and not (kind == "int4_weight" and param.shape[1] % group_size))

    for name, param in list(e.params.items()):
        if name.split(".", 2)[-1] in experts:   # layers.{i}.experts.gate_up
            rows = param.numel // param.shape[-1]
        elif not quantizable(name, param):
            continue
        else:
            rows = param.shape[0]
        numel = param.numel
        if kind.startswith("int8"):
            codes = Param(e, name, numel, "int8", trainable=False)
            state = [Param(e, name + ".scale", rows, "float32", False), Param(e, name + ".zero", rows, "int8", False)]
        elif kind == "int4_weight":
            codes = Param(e, name, numel // 2, "uint8", trainable=False)
            state = [Param(e, name + ".scale_and_zero", 2 * numel // group_size, param.dtype, False)]
        else:
            codes = Param(e, name, -(-numel // 2), "uint8", trainable=False)
            blocks = -(-numel // BLOCK)
            state = [Param(e, name + ".code", 16, "float32", False)]
            if double_quant:
                state += [Param(e, name + ".absmax", blocks, "uint8", False),
                          Param(e, name + ".absmax2", -(-blocks // BLOCKS_PER_SCALE), "float32", False),
                          Param(e, name + ".code2", 256, "float32", False),
                          Param(e, name + ".offset", 1, "float32", False)]
            else:
                state.append(Param(e, name + ".absmax", blocks, "float32", False))
        codes.shape, codes.frozen = param.shape, True
        codes.quant = (kind, param.dtype, state, double_quant)
        e.params[name] = codes
        del param


def fake_quantize_linears(e: Engine, family) -> None:
    """Every linear (the LM head included: torchao prepares every nn.Linear) fake-quantizes its weight and input
    in each forward; the weights stay float32 and train."""
    linears = set(_module_names(family, "fake-quantized linears").values()) | {"lm_head"}
    for name, param in e.params.items():
        if name.rsplit(".", 1)[-1] in linears and len(param.shape) == 2:
            param.quant = ("fake_quant", param.dtype, [], False)


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
