"""The weights a serving engine holds on each GPU: every tensor of the model's inventory (served_model.py) split as
tensor (and expert) parallel splits it, its linears stored in the checkpoint's quantized layout
(core/weight_formats.py), the rest in the served dtype. The layout is read from the checkpoint's
quantization_config as the engines read it, or named with --quantization (a bf16 checkpoint quantized as it loads:
fp8, bitsandbytes)."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from memfit.core.caching_allocator import CachingAllocator
from memfit.core.dtypes import dtype_bytes
from memfit.core.errors import MemfitError, closest
from memfit.core.weight_formats import (
    AWQ,
    BNB_4BIT,
    FP8,
    FP8_BLOCK,
    GPTQ,
    GPTQ_MARLIN,
    MXFP4,
    W4A16,
    W8A8_INT8,
    WeightFormat,
)
from memfit.serving.served_model import VOCAB_PADDING, ServedModel, Weight

# --quantization's values (vLLM's names) -> the layout; "marlin" variants need compute capability 8.0
QUANTIZATIONS = ("awq", "awq_marlin", "gptq", "gptq_marlin", "fp8", "compressed-tensors", "bitsandbytes", "mxfp4")
MARLIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Checkpoint:
    """How the served weights are stored: a quantized layout for the linears (None: the served dtype), and its
    name as the engine logs it."""

    method: str | None
    fmt: WeightFormat | None
    experts_only: bool = False     # MXFP4: only a mixture's experts are quantized

    def quantizes(self, weight: Weight) -> bool:
        if self.fmt is None or not weight.linear:
            return False
        if self.experts_only and len(weight.shape) != 3:
            return False
        return self.fmt.stores(weight.shape)


def checkpoint_of(model: ServedModel, quantization: str | None, capability: tuple[int, int]) -> Checkpoint:
    """The layout the engine loads: --quantization if given (it must agree with a quantized checkpoint's own
    method), else the checkpoint's quantization_config, else none."""
    config = model.quantization or {}
    method = str(config.get("quant_method", "")).lower() or None
    if quantization is not None:
        if quantization not in QUANTIZATIONS:
            raise MemfitError(f"unknown --quantization {quantization!r}; choose {', '.join(QUANTIZATIONS)}."
                              f"{closest(quantization, QUANTIZATIONS)}")
        base = quantization.removesuffix("_marlin")
        if method and method != base:
            raise MemfitError(f"the checkpoint's quantization_config says {method!r}, but --quantization is "
                              f"{quantization!r}; drop the flag (the engine reads the checkpoint's) or give a "
                              "checkpoint of that method.")
        if base in ("awq", "gptq", "compressed-tensors") and not method:
            config = {"quant_method": base, "bits": 4, "group_size": 128}   # a checkpoint of that method, defaults
        method = base
    if method is None:
        return Checkpoint(None, None)
    marlin = tuple(capability) >= MARLIN_CAPABILITY
    group = int(config.get("group_size") or 128)
    if method == "awq":
        return Checkpoint("awq_marlin" if marlin else "awq", _grouped(AWQ, config, group))
    if method == "gptq":
        act_order, sym = bool(config.get("desc_act")), config.get("sym", True)
        fast = marlin and sym and not act_order
        return Checkpoint("gptq_marlin" if fast else "gptq", _grouped(GPTQ_MARLIN if fast else GPTQ, config, group))
    if method == "fp8":
        block = config.get("weight_block_size")
        return Checkpoint("fp8", FP8_BLOCK.with_group_size(int(block[0])) if block else FP8)
    if method == "compressed-tensors":
        return Checkpoint("compressed-tensors", _compressed_tensors(config))
    if method == "bitsandbytes":
        if config.get("load_in_8bit"):
            raise MemfitError("bitsandbytes 8-bit checkpoints are not modelled; memfit models 4-bit (load_in_4bit).")
        return Checkpoint("bitsandbytes", BNB_4BIT)
    if method == "mxfp4":
        return Checkpoint("mxfp4", MXFP4, experts_only=True)
    raise MemfitError(f"the checkpoint's quantization method {method!r} is not modelled; memfit models "
                      f"{', '.join(QUANTIZATIONS)}.")


def _grouped(fmt: WeightFormat, config: dict, group: int) -> WeightFormat:
    bits = int(config.get("bits") or config.get("w_bit") or 4)
    if bits not in (4, 8):
        raise MemfitError(f"a {bits}-bit {fmt.name} checkpoint is not modelled; memfit models 4 and 8 bits.")
    fmt = fmt.with_group_size(group if group > 0 else 128)
    return dataclasses.replace(fmt, code_bits=bits)


def _compressed_tensors(config: dict) -> WeightFormat:
    """compressed-tensors: W8A8 int8 (channel scales) or W4A16 (pack-quantized groups), from its first group."""
    groups: dict = config.get("config_groups") or {}
    weights: dict = next(iter(groups.values())).get("weights", {}) if groups else {}
    bits = int(weights.get("num_bits") or (8 if "int-quantized" in str(config.get("format")) else 4))
    if str(weights.get("type", "int")) == "float":
        return FP8
    if bits == 8:
        return W8A8_INT8
    return W4A16.with_group_size(int(weights.get("group_size") or 128))


def rank_shape(weight: Weight, model: ServedModel, tp: int, ep: int) -> tuple[int, ...]:
    """The shape of `weight`'s part on one rank of `tp` tensor-parallel (and `ep` expert-parallel) ranks."""
    shape = list(weight.shape)
    if ".experts." in weight.name and ep > 1:   # expert parallel: whole experts per rank, their widths not split
        shape[0] = -(-shape[0] // ep)
        return tuple(shape)
    dim = weight.split_dim
    if weight.split == "vocab":
        padded = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING
        shape[0] = -(-padded // tp)
    elif weight.split == "column":
        shape[dim] = -(-shape[dim] // tp)
    elif weight.split == "kv":   # one head per rank at least: heads replicated when there are fewer than ranks
        per_head = shape[dim] // model.kv_heads
        shape[dim] = per_head * max(1, model.kv_heads // tp)
    elif weight.split == "row":
        shape[-1] = -(-shape[-1] // tp)
    return tuple(shape)


def weights_bytes(model: ServedModel, checkpoint: Checkpoint, dtype: str, tp: int, ep: int = 1,
                  pp_layers: tuple[int, int] | None = None) -> int:
    """Bytes of the weights on the most loaded rank: tensor parallel `tp`, expert parallel `ep`, and with pipeline
    parallel the layers [start, stop) of one stage (the first stage holds the embedding, the last the head)."""
    return sum(engine_tensors(model, checkpoint, dtype, tp, ep, pp_layers).values())


def reserved_weights_bytes(model: ServedModel, checkpoint: Checkpoint, dtype: str, tp: int) -> int:
    """What the CUDA caching allocator reserves for the weights on one rank (what the device's free memory loses,
    which SGLang and TGI read): each tensor the engine allocates, in load order, through the allocator's rules
    (core/caching_allocator.py): one of 10 MiB or more takes its own segment rounded up to 2 MiB, smaller ones share
    20 MiB and 2 MiB segments. A quantized linear counts as one tensor of its stored bytes."""
    allocator = CachingAllocator()
    for size in engine_tensors(model, checkpoint, dtype, tp).values():
        allocator.malloc(size)
    return allocator.reserved


# the column-parallel projections the engines load as one tensor (QKVParallelLinear, MergedColumnParallelLinear)
_FUSED = ((re.compile(r"\.attn\.[qkv](\.bias)?$"), r".attn.qkv\1"),
          (re.compile(r"\.(gate|up)(\.bias)?$"), r".gate_up\2"))


def engine_tensors(model: ServedModel, checkpoint: Checkpoint, dtype: str, tp: int, ep: int = 1,
                   pp_layers: tuple[int, int] | None = None) -> dict[str, int]:
    """The tensors the engine allocates for the weights on one rank, in load order: name -> bytes (q, k and v
    fused, gate and up fused; a vision tower, kept whole on each rank, as one)."""
    tensors: dict[str, int] = {}
    for weight in model.weights:
        if pp_layers is not None and not _in_stage(weight.name, pp_layers, model.layers):
            continue
        shape = rank_shape(weight, model, tp, ep)
        if checkpoint.fmt is not None and checkpoint.quantizes(weight):
            size = checkpoint.fmt.stored_bytes(shape, dtype)
        else:
            size = math.prod(shape) * dtype_bytes(dtype)
        name = weight.name
        for pattern, fused in _FUSED:
            name = pattern.sub(fused, name)
        tensors[name] = tensors.get(name, 0) + size
    extra = sum((model.extra_parameters or {}).values())
    if extra:
        tensors["vision tower"] = extra * dtype_bytes(dtype)
    return tensors


def _in_stage(name: str, layers: tuple[int, int], depth: int) -> bool:
    if name.startswith("layers."):
        return layers[0] <= int(name.split(".")[1]) < layers[1]
    if name.startswith("embed"):
        return layers[0] == 0
    return layers[1] == depth
