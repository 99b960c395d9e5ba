"""Weight storage formats: how a quantized linear's weight is stored, declared once and read by everyone who needs
it — the technique that quantizes (techniques/quantization.py), the analytic estimator (the parameters it declares:
estimators/analytic/weights.py; the kernel a linear runs: estimators/analytic/ops.py `LINEAR_KERNELS`) and the
cost model (the bytes a step reads: planner/cost.py). The traced estimator runs the library's own code and
measures its tensors instead.

A format is its codes (bits per weight, the dtype they are packed in) and its quantization state: tensors stored
beside the codes, each `entries` values per unit of `per` weights ("row": per output row of each matrix or
expert; "column": per input column of each matrix or expert; "group": per `group_size` inputs of a row; "block": per
`group_size` x `group_size` tile of each matrix, partial tiles counted; "tensor": per weight tensor; a number: per
that many weights, counted over the whole tensor). A new format is one `register_weight_format(WeightFormat(...))`
and, where no registered kernel computes like its library, one kernel in ops.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.core.dtypes import dtype_bytes
from memfit.core.registry import Registry


@dataclass(frozen=True)
class State:
    """A tensor of quantization state beside the codes."""

    suffix: str              # its parameter's name: the weight's + "." + suffix
    dtype: str | None        # None: the weight's own dtype before quantization
    per: int | str           # weights per unit: a number, "row", "group" or "tensor"
    entries: int = 1         # values per unit


UNITS = ("row", "column", "group", "block", "tensor")


@dataclass(frozen=True)
class WeightFormat:
    name: str
    library: str                  # whose layout this is
    code_bits: int                # bits per weight of the codes
    code_dtype: str               # what they are packed in
    state: tuple[State, ...]
    kernel: str                   # the analytic op a linear stored so runs (estimators/analytic/ops.py); "" for a
    #                               serving engine's checkpoint layout (estimators/serving/), which no analytic op runs
    head: bool = False            # the LM head quantized too (a head tied to the embeddings gets its own codes)
    experts: bool = False         # a mixture's expert weights too (per expert and row)
    group_size: int = 0           # inputs per group ("group" state); a linear the group does not divide is skipped
    nested_scales: bool = False   # the scales are themselves quantized (a kernel dequantizes them first)

    def __post_init__(self) -> None:
        dtype_bytes(self.code_dtype)
        if self.code_bits not in (1, 2, 3, 4, 5, 6, 8):
            raise ValueError(f"weight format {self.name}: code_bits {self.code_bits} is not 1-6 or 8")
        for state in self.state:
            if state.dtype is not None:
                dtype_bytes(state.dtype)
            if state.per not in UNITS and not (isinstance(state.per, int) and state.per > 0):
                raise ValueError(f"weight format {self.name}: {state.suffix}'s per must be a positive number or one "
                                 f"of {', '.join(UNITS)}, not {state.per!r}")
            if state.per in ("group", "block") and self.group_size <= 0:
                raise ValueError(f"weight format {self.name}: group state needs a group_size")

    def with_group_size(self, group_size: int) -> WeightFormat:
        return dataclasses.replace(self, group_size=group_size)

    def stores(self, shape: tuple[int, ...]) -> bool:
        """A weight of `shape` (out x in, or experts x out x in) is stored in this format (block-scaled formats take
        any shape: their last tiles are partial)."""
        grouped = self.group_size and any(s.per == "group" for s in self.state)
        return len(shape) >= 2 and not (grouped and shape[-1] % self.group_size)

    def code_elements(self, numel: int) -> int:
        """Elements of `code_dtype` the codes of `numel` weights take."""
        return -(-numel * self.code_bits // (8 * dtype_bytes(self.code_dtype)))

    def state_elements(self, shape: tuple[int, ...]) -> list[tuple[str, int, str | None]]:
        """(suffix, elements, dtype) of each state tensor of a weight of `shape`, in declaration order."""
        numel, inputs, outputs = _numel(shape), shape[-1], shape[-2]
        g = self.group_size
        units = {"row": numel // inputs, "column": numel // outputs, "tensor": 1,
                 "group": numel // g if g else 0,
                 "block": numel // (inputs * outputs) * -(-inputs // g) * -(-outputs // g) if g else 0}
        return [(s.suffix, s.entries * (units[s.per] if isinstance(s.per, str) else -(-numel // s.per)), s.dtype)
                for s in self.state]

    def stored_bytes(self, shape: tuple[int, ...], weight_dtype: str) -> int:
        """Bytes of the codes and state of a weight of `shape` whose dtype was `weight_dtype`."""
        state = sum(n * dtype_bytes(dtype or weight_dtype) for _, n, dtype in self.state_elements(shape))
        return self.code_elements(_numel(shape)) * dtype_bytes(self.code_dtype) + state


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


WEIGHT_FORMATS: Registry[WeightFormat] = Registry("weight format")
register_weight_format = WEIGHT_FORMATS.add
weight_format = WEIGHT_FORMATS.named


BNB_BLOCK = 64            # bitsandbytes' 4-bit block: one scale per 64 weights
BNB_BLOCKS_PER_SCALE = 256   # double quantization: one float32 scale per 256 blocks

# torchao Int8WeightOnlyConfig / Int8DynamicActivationInt8WeightConfig: int8 codes, per output row a float32 scale
# and an int8 zero point; every nn.Linear, the head included, and a mixture's expert weights (FqnToConfig)
TORCHAO_INT8 = register_weight_format(WeightFormat(
    "torchao-int8", "torchao", 8, "int8", (State("scale", "float32", "row"), State("zero", "int8", "row")),
    kernel="int8_weight", head=True, experts=True))
TORCHAO_INT8_DYNAMIC = register_weight_format(dataclasses.replace(
    TORCHAO_INT8, name="torchao-int8-dynamic", kernel="int8_dynamic"))
# torchao Int4WeightOnlyConfig, tinygemm layout: two 4-bit codes per byte, per group of inputs of each row a scale
# and a zero point in the weight's dtype; every nn.Linear the group divides, the head included
TORCHAO_INT4 = register_weight_format(WeightFormat(
    "torchao-int4", "torchao", 4, "uint8", (State("scale_and_zero", None, "group", 2),),
    kernel="int4_weight", head=True, group_size=128))
# bitsandbytes Linear4bit (NF4 or FP4: the same layout): two 4-bit codes per byte, the format's 16-value code book,
# one float32 absmax per block of 64 weights; every nn.Linear but the LM head
BNB_4BIT = register_weight_format(WeightFormat(
    "bnb-4bit", "bitsandbytes", 4, "uint8",
    (State("code", "float32", "tensor", 16), State("absmax", "float32", BNB_BLOCK)), kernel="bnb_4bit"))
# ... with double quantization: each block's absmax as a uint8 code, per 256 blocks a float32 absmax, a 256-entry
# code book and an offset
BNB_4BIT_DOUBLE = register_weight_format(WeightFormat(
    "bnb-4bit-double-quant", "bitsandbytes", 4, "uint8",
    (State("code", "float32", "tensor", 16), State("absmax", "uint8", BNB_BLOCK),
     State("absmax2", "float32", BNB_BLOCK * BNB_BLOCKS_PER_SCALE), State("code2", "float32", "tensor", 256),
     State("offset", "float32", "tensor")), kernel="bnb_4bit", nested_scales=True))

# Serving engines' checkpoint layouts, as vLLM loads them (estimators/serving/checkpoints.py picks one from the
# checkpoint's quantization_config); every linear of the decoder's layers and a mixture's experts, the embeddings and
# the LM head left in the model's dtype. `kernel` "": no analytic op runs them.
# AutoAWQ (GEMM): eight 4-bit codes per int32, per group of 128 inputs a scale (the model's dtype, float16) and a
# 4-bit zero point, eight per int32; the Marlin kernels' repacking keeps every size
AWQ = register_weight_format(WeightFormat(
    "awq", "AutoAWQ (vLLM awq / awq_marlin)", 4, "int32",
    (State("scales", None, "group"), State("qzeros", "int32", 8 * 128)), kernel="", experts=True, group_size=128))
# GPTQ through the Marlin kernels (compute capability >= 8.0, symmetric, no act-order): the codes and the group
# scales (the repacking empties the zero points and g_idx)
GPTQ_MARLIN = register_weight_format(WeightFormat(
    "gptq-marlin", "AutoGPTQ / GPTQModel (vLLM gptq_marlin)", 4, "int32", (State("scales", None, "group"),),
    kernel="", experts=True, group_size=128))
# GPTQ through the ExLlama kernels (older GPUs, or an asymmetric / act-order checkpoint): codes, scales, packed zero
# points and each input's group index
GPTQ = register_weight_format(WeightFormat(
    "gptq", "AutoGPTQ / GPTQModel (vLLM gptq)", 4, "int32",
    (State("qzeros", "int32", 8 * 128), State("scales", None, "group"), State("g_idx", "int32", "column")),
    kernel="", experts=True, group_size=128))
# FP8 per tensor (llm-compressor / AutoFP8 "fp8", vLLM's --quantization fp8 of a bf16 checkpoint): one float32 scale
FP8 = register_weight_format(WeightFormat(
    "fp8", "vLLM fp8 (per tensor)", 8, "float8_e4m3fn", (State("weight_scale", "float32", "tensor"),), kernel="",
    experts=True))
# FP8 with 128 x 128 block scales (DeepSeek-V3, Qwen3 -FP8): a float32 scale_inv per tile
FP8_BLOCK = register_weight_format(WeightFormat(
    "fp8-block", "vLLM fp8 (weight_block_size)", 8, "float8_e4m3fn",
    (State("weight_scale_inv", "float32", "block"),), kernel="", experts=True, group_size=128))
# compressed-tensors W8A8 int8 (channel-wise weight scales, dynamic per-token activations)
W8A8_INT8 = register_weight_format(WeightFormat(
    "w8a8-int8", "compressed-tensors (int-quantized)", 8, "int8", (State("weight_scale", "float32", "row"),),
    kernel="", experts=True))
# compressed-tensors W4A16 (pack-quantized, group 128): eight codes per int32, group scales, the shape (2 x int64)
W4A16 = register_weight_format(WeightFormat(
    "w4a16", "compressed-tensors (pack-quantized)", 4, "int32",
    (State("weight_scale", None, "group"), State("weight_shape", "int64", "tensor", 2)), kernel="", experts=True,
    group_size=128))
# OpenAI's MXFP4 (gpt-oss's experts): two 4-bit codes per byte, one uint8 power-of-two scale per 32 weights
MXFP4 = register_weight_format(WeightFormat(
    "mxfp4", "gpt-oss MXFP4", 4, "uint8", (State("scales", "uint8", 32),), kernel="", experts=True))
