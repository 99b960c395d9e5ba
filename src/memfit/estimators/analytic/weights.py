"""Techniques that change the model's weights before the step: pruning, quantization and adapters.

  prune-structured   fewer key/value head groups (BERT: heads) and MLP channels in every block (`pruned_spec`).
  int8-weight-only, int8-dynamic
                     every linear weight as int8 codes, a float32 scale and an int8 zero point per
                     output row (torchao); a head tied to the embeddings gets its own codes.
  bnb-4bit, qlora    every linear but the LM head as two 4-bit codes per byte and bitsandbytes'
                     quantization state: one absmax per block of 64 weights (float32, or with double
                     quantization a uint8 code, plus per 256 blocks a float32 absmax, a 256-entry code
                     and an offset), and the format's 16-value code book.
  qat                every linear weight stays float32 and trains; its linears fake-quantize (ops.py).
  lora, qlora        every parameter frozen; each target weight W (out x in) gets a trainable A
                     (rank x in) and B (out x rank), which its linears run beside it.

How these linears compute is in ops.py (`int8_linear`, `int8_dynamic_linear`, `linear_4bit`, `qat_linear`).
"""
from __future__ import annotations

from dataclasses import replace

from memfit.core.errors import MemfitError
from memfit.estimators.analytic.engine import Engine, Param
from memfit.techniques.pruning import kept_count
from memfit.techniques.quantization import BLOCK

BLOCKS_PER_SCALE = 256   # double quantization: one float32 absmax per 256 blocks


def pruned_spec(spec, workload):
    """prune-structured (techniques/pruning.py): the blocks' shape after pruning; the residual width stays."""
    prune = workload.technique("prune-structured")
    if prune is None:
        return spec
    changes = {}
    if prune.part in ("both", "heads") and hasattr(spec, "kv_heads"):   # decoders: whole key/value groups
        kv = kept_count(spec.kv_heads, prune.ratio)
        changes |= {"kv_heads": kv, "heads": kv * (spec.heads // spec.kv_heads)}
    elif prune.part in ("both", "heads"):                               # BERT: heads
        changes["heads"] = kept_count(spec.heads, prune.ratio)
    if prune.part in ("both", "mlp"):
        changes["intermediate"] = kept_count(spec.intermediate, prune.ratio)
    return replace(spec, **changes)


def transform_weights(e: Engine, family, spec, workload) -> None:
    for int8 in ("int8-weight-only", "int8-dynamic"):
        if workload.technique(int8):
            quantize_linears(e, family, spec, int8)
    if workload.technique("qat"):
        fake_quantize_linears(e, family)
    four_bit = workload.technique("bnb-4bit") or workload.technique("qlora")
    if four_bit is not None:
        quantize_linears(e, family, spec, "4bit", double_quant=four_bit.double_quant)
    lora = workload.technique("lora") or workload.technique("qlora")
    if lora is not None:
        add_adapters(e, family, lora)


def _module_names(family, technique: str) -> dict[str, str]:
    """Hugging Face module names -> the family program's parameter names (decoder families only)."""
    names = getattr(family, "MODULE_NAMES", None)
    if names is None:
        raise MemfitError(f"the analytic model has {technique} for decoder families (Llama, Mistral, Qwen2, "
                          "...); use --method traced.")
    return names


def quantize_linears(e: Engine, family, spec, kind: str, double_quant: bool = False) -> None:
    linears = set(_module_names(family, kind).values()) | {"router"}
    if kind.startswith("int8"):   # torchao quantizes the head too; a tied one gets its own codes
        linears.add("lm_head")
        if getattr(spec, "tied", False) and "lm_head" not in e.params:
            e.param("lm_head", e.params["embed"].shape)
    for name, param in list(e.params.items()):
        if name.rsplit(".", 1)[-1] not in linears or len(param.shape) != 2:
            continue
        numel, rows = param.numel, param.shape[0]
        if kind.startswith("int8"):
            codes = Param(e, name, numel, "int8", trainable=False)
            state = [Param(e, name + ".scale", rows, "float32", False), Param(e, name + ".zero", rows, "int8", False)]
        else:
            codes = Param(e, name, -(-numel // 2), "uint8", trainable=False)
            blocks = -(-numel // BLOCK)
            state = [Param(e, name + ".code", 16, "float32", False)]
            if double_quant:
                state += [Param(e, name + ".absmax", blocks, "uint8", False),
                          Param(e, name + ".absmax2", -(-blocks // BLOCKS_PER_SCALE), "float32", False),
                          Param(e, name + ".code2", 256, "float32", False), Param(e, name + ".offset", 1, "float32", False)]
            else:
                state.append(Param(e, name + ".absmax", blocks, "float32", False))
        codes.shape, codes.frozen = param.shape, True
        codes.quant = (kind, param.dtype, state, double_quant)
        e.params[name] = codes
        del param


def fake_quantize_linears(e: Engine, family) -> None:
    """qat: every linear (the LM head included: torchao prepares every nn.Linear) fake-quantizes its weight
    and input in each forward; the weights stay float32 and train."""
    linears = set(_module_names(family, "qat").values()) | {"router", "lm_head"}
    for name, param in e.params.items():
        if name.rsplit(".", 1)[-1] in linears and len(param.shape) == 2:
            param.quant = ("qat", param.dtype, [], False)


def add_adapters(e: Engine, family, lora) -> None:
    names = _module_names(family, "LoRA")
    targets = {names.get(t, t) for t in lora.target_names}
    for param in list(e.params.values()):
        param.grad, param.frozen = False, True
        if param.name.rsplit(".", 1)[-1] in targets and len(param.shape) == 2:
            out_features, in_features = param.shape
            param.lora = (e.param(param.name + ".lora_A", (lora.rank, in_features)),
                          e.param(param.name + ".lora_B", (out_features, lora.rank)))
