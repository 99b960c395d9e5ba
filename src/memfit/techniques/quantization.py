"""Weight quantization: the model's linear weights stored in fewer bits.

  int8-weight-only   torchao's Int8WeightOnlyConfig on every nn.Linear (inference): each weight as int8
                     codes with a float32 scale and an int8 zero point per output row (1 byte per weight
                     instead of 4 or 2). A linear converts the whole weight to the activations' dtype,
                     multiplies, then applies the row scales: per call the weight's size in that dtype
                     and one more output-sized tensor are temporaries (measured on the CPU kernel).
                     Embeddings stay as they are; a head tied to them gets its own int8 copy. A mixture of
                     experts' expert weights (transformers' 3-D gate_up_proj and down_proj, which are no
                     nn.Linear) are quantized too, per expert and row (torchao's FqnToConfig), as gpt-fast
                     quantizes its experts: left in bf16 they would be almost all of a Mixtral's weights.
                     torchao's int8 tensor has no grouped matmul, so the experts run transformers' "eager"
                     loop (each routed expert's weight selected, converted and multiplied in turn).
  int8-dynamic       torchao's Int8DynamicActivationInt8WeightConfig (inference): the same int8 weights, and
                     per call each token's activations quantized to int8 (a scale per token) for an integer
                     matmul. Per call: float temporaries of the input's size
                     (x / scale, round, + zero point, clamp, two alive at a time), the int8 input, on the
                     CPU a uint8 copy for its u8 x s8 kernel (made through int32), the int32 product, and
                     two float tensors of the output's size while it is scaled back.
  qat                training with torchao's fake quantization (QATConfig, step "prepare") on every nn.Linear:
                     each forward rounds the weight (int8 per output row, symmetric) and each token's input
                     (int8, asymmetric: torchao has no symmetric per-token fake quantizer) to the grid and
                     back, so the model learns int8 rounding; gradients pass straight through inside the
                     range. `convert_qat_(model)`
                     then turns the trained model into the real int8-dynamic one. Memory per linear: for
                     backward, the rounded weight and input and their pre-clamp values (a range mask) are
                     saved (two weight-sized and two input-sized float tensors), plus the same again as
                     forward temporaries.
  int4-weight-only[:group_size=32|64|128|256]
                     torchao's int4 weight-only quantization with the tinygemm layout (Int4WeightOnlyConfig,
                     tile_packed_to_4d, on CUDA; its CPU twin PrototypeInt4WeightOnlyConfig, Int4OpaqueTensor)
                     on every nn.Linear whose input size the group divides (torchao skips the others), the LM
                     head included: two 4-bit codes per byte, and per group of `group_size` inputs of each
                     output row a scale and a zero point in the weight's dtype. A call runs one kernel on the
                     packed weight: its output is the only tensor (no dequantized weight). Quantizing a loaded
                     weight (on the device it is on) takes its float copies (x - min, / scale, round: each
                     weight-sized, in its dtype), an int32 copy and the packed codes; the float weight is freed
                     after: what a model loaded in half precision and quantized on the GPU leaves to the caching
                     allocator is in the traced estimate's allocation sequence. CUDA's tinygemm computes in bf16
                     only (default group: torchao's, 128).
  bnb-4bit[:format=nf4|fp4,double_quant=true]
                     bitsandbytes' Linear4bit (Dettmers et al., QLoRA) on every nn.Linear but the LM head
                     (transformers' rule): two 4-bit codes per byte, one scale per block of 64 weights
                     (float32, or with double_quant an 8-bit code per block plus a float32 scale per 256
                     blocks). Each call dequantizes the whole weight to the activations' dtype and
                     multiplies (bitsandbytes' portable path, the one CUDA takes for more than one token):
                     the weight's size in that dtype is a temporary per linear, again in backward. On a
                     CPU with AVX512-BF16 bitsandbytes would repack the weights at the first inference
                     call for a bf16 kernel; memfit turns that off so the CPU computes as a GPU does.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, cast

import torch

from memfit.core.errors import MemfitError, require_choice
from memfit.core.precision import get_precision, precision_names, precision_of_dtype
from memfit.core.weight_formats import (
    BNB_4BIT,
    BNB_4BIT_DOUBLE,
    TORCHAO_INT4,
    TORCHAO_INT8,
    TORCHAO_INT8_DYNAMIC,
    WeightFormat,
)
from memfit.steps.setup import StepSetup
from memfit.steps.stand_ins import stand_in
from memfit.techniques.base import Technique, register
from memfit.techniques.contracts import AnalyticProgram, PlanQuery

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def refuse_conv1d(name: str, workload) -> None:
    """Techniques that change nn.Linear layers: GPT-2's blocks are Conv1D, which the libraries skip silently."""
    if workload.source.is_hf and workload.source.model_type == "gpt2":
        raise MemfitError(f"-t {name}: GPT-2's blocks use Conv1D, not nn.Linear, so it would change (almost) "
                          "nothing.")


ONE_QUANTIZATION = {"quantized-linears": ("a linear weight is quantized one way", "keep one quantization")}
FOUR_BIT_CONFLICTS = {**ONE_QUANTIZATION, "shards-weights": (
    "bitsandbytes' 4-bit weights are not split by {other} (no DTensor or pipeline stage support here)",
    "drop -t {other}")}


@register
@dataclass(frozen=True, kw_only=True)
class Int8WeightOnly(Technique):
    name = "int8-weight-only"
    examples = (("int8-weight-only", {"task": "inference"}),)
    risk = "lossy"
    stage = "quantize"
    summary = ("torchao int8 weight-only: every nn.Linear weight (and a mixture's expert weights) as int8 codes with "
               "a float32 scale per row")
    traits = frozenset({"subclass-weights", "quantized-linears"})
    conflicts_with = ONE_QUANTIZATION
    oom_fixes: ClassVar[tuple[str, ...]] = ("int8-weight-only",)
    search_axis = "weights"

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [cls.name] if request.task == "inference" else []

    def check(self, workload) -> None:
        if workload.task != "inference":
            raise MemfitError(f"-t {self.name} quantizes a model for inference; to train for int8, use -t qat "
                              "(quantization-aware training), then convert_qat_.")
        if get_precision(workload.precision).autocast_dtype is not None:
            raise MemfitError(f"-t {self.name} computes in the weights' own dtype; use --precision "
                              f"{precision_names(autocast=False, master=False)}, not {workload.precision}.")
        refuse_conv1d(self.name, workload)

    def weight_format(self) -> WeightFormat:
        return TORCHAO_INT8

    def torchao_config(self):
        from torchao.quantization import Int8WeightOnlyConfig

        return Int8WeightOnlyConfig()

    def apply_(self, setup: StepSetup) -> None:
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
        from torchao.quantization import quantize_

        if not any(isinstance(m, torch.nn.Linear) for m in setup.model.modules()):
            raise MemfitError(f"-t {self.name}: the model has no nn.Linear to quantize.")
        quantize_(setup.model, self.torchao_config())
        if any(".experts." in name and name.endswith(EXPERT_WEIGHTS) for name, _ in setup.model.named_parameters()):
            from torchao.quantization import FqnToConfig

            pattern = r"re:.*\.experts\.(" + "|".join(EXPERT_WEIGHTS) + ")$"
            quantize_(setup.model, FqnToConfig({pattern: self.torchao_config()}), filter_fn=None)
            # int8 tensors have no grouped matmul
            cast("PreTrainedModel", setup.model).set_experts_implementation("eager")


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")   # transformers' fused experts (Mixtral): 3-D, per expert


@register
@dataclass(frozen=True, kw_only=True)
class Int8Dynamic(Int8WeightOnly):
    name = "int8-dynamic"
    examples = (("int8-dynamic", {"task": "inference"}),)
    summary = "torchao int8 dynamic: int8 weights (scale per row) and each token's activations quantized per call"
    oom_fixes = ()
    time_factor = 1.2    # quantizing activations per call; the int8 matmul pays off on GPUs (assumed)

    def weight_format(self) -> WeightFormat:
        return TORCHAO_INT8_DYNAMIC

    def torchao_config(self):
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig

        return Int8DynamicActivationInt8WeightConfig()


@register
@dataclass(frozen=True, kw_only=True)
class Qat(Technique):
    name = "qat"
    examples = (("qat", {}),)
    risk = "lossy"
    stage = "quantize"
    summary = "quantization-aware training (torchao): int8 fake quantization of weights and inputs in every linear"
    time_factor = 1.5    # the fake quantization of every weight and input, forward and backward (assumed)
    traits = frozenset({"quantized-linears"})
    conflicts_with = {
        **ONE_QUANTIZATION,
        "adapters": ("qat trains every weight through fake quantization, and adapters freeze them",
                     "keep one of them"),
        "splits-linears": ("torchao's fake-quantized linears are not the nn.Linear that {other}'s plans split",
                           "drop -t {other}"),
    }

    def check(self, workload) -> None:
        if workload.task != "train":
            raise MemfitError("-t qat trains with fake quantization; for inference use -t int8-dynamic (what "
                              "convert_qat_ turns the trained model into).")
        if workload.precision != "fp32":
            raise MemfitError("-t qat: fake quantization computes its scales in the weights' dtype; use "
                              "--precision fp32.")
        refuse_conv1d(self.name, workload)

    def analytic_weights(self, program: AnalyticProgram) -> None:
        program.fake_quantize_linears()

    def apply_(self, setup: StepSetup) -> None:
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

        if not any(isinstance(m, torch.nn.Linear) for m in setup.model.modules()):
            raise MemfitError("-t qat: the model has no nn.Linear to train for int8.")
        inputs = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)   # (symmetric: not in torchao)
        weights = IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True)
        quantize_(setup.model, QATConfig(activation_config=inputs, weight_config=weights, step="prepare"))


def convert_qat_(model: torch.nn.Module) -> torch.nn.Module:
    """After training with -t qat: drop the fake quantizers and quantize for real (int8-dynamic)."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    from torchao.quantization.qat import QATConfig

    quantize_(model, QATConfig(step="convert"))
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    return model


GROUP_SIZES = (32, 64, 128, 256)


@register
@dataclass(frozen=True, kw_only=True)
class Int4WeightOnly(Technique):
    name = "int4-weight-only"
    examples = (("int4-weight-only", {"task": "inference"}),)
    risk = "lossy"
    stage = "quantize"
    summary = ("torchao int4 weight-only (tinygemm layout): every nn.Linear weight as 4-bit codes with a scale and a "
               "zero point per group of inputs, the LM head included")
    traits = frozenset({"subclass-weights", "quantized-linears"})
    conflicts_with = FOUR_BIT_CONFLICTS
    oom_fixes = ("int4-weight-only",)
    group_size: int = 128

    def __post_init__(self) -> None:
        require_choice(self.group_size, GROUP_SIZES, f"-t {self.name}: group_size")

    def check(self, workload) -> None:
        if workload.task != "inference":
            raise MemfitError(f"-t {self.name} packs the weights for an inference kernel; to train on a 4-bit "
                              "base, use -t qlora.")
        if get_precision(workload.precision).autocast_dtype is not None:
            raise MemfitError(f"-t {self.name} computes in the weights' own dtype (bfloat16 for CUDA's tinygemm "
                              f"kernel); use --precision {precision_names(autocast=False, master=False)}, not "
                              f"{workload.precision}.")
        refuse_conv1d(self.name, workload)

    def estimate_notes(self, workload) -> list[str]:
        if get_precision(workload.precision).param_dtype == torch.bfloat16:
            return []
        return [f"-t {self.name}: on a CUDA GPU torchao's int4 kernel takes bfloat16 weights only (--precision "
                f"{workload.precision} runs on a CPU): use --precision {precision_of_dtype(torch.bfloat16).name} "
                "there"]

    def weight_format(self) -> WeightFormat:
        return TORCHAO_INT4.with_group_size(self.group_size)

    def apply_(self, setup: StepSetup) -> None:
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
        from torchao.quantization import quantize_

        linears = [m for m in setup.model.modules() if isinstance(m, torch.nn.Linear)]
        if not any(m.in_features % self.group_size == 0 for m in linears):
            raise MemfitError(f"-t {self.name}: the model has no nn.Linear whose input size {self.group_size} "
                              "divides (torchao skips those).")
        weight = linears[0].weight
        if weight.device.type == "cuda":
            if weight.dtype != torch.bfloat16:
                raise MemfitError(f"-t {self.name}: CUDA's tinygemm int4 kernel takes bfloat16 weights, not "
                                  f"{weight.dtype}.")
            from torchao.quantization import Int4WeightOnlyConfig

            config = Int4WeightOnlyConfig(group_size=self.group_size, int4_packing_format="tile_packed_to_4d",
                                          set_inductor_config=False)
        else:
            if self.group_size not in (32, 64, 128):
                raise MemfitError(f"-t {self.name}: torchao's CPU int4 kernel takes groups of 32, 64 or 128, not "
                                  f"{self.group_size}.")
            from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

            config = PrototypeInt4WeightOnlyConfig(group_size=self.group_size, set_inductor_config=False)
        quantize_(setup.model, config)   # (Inductor's settings stay the user's: torchao would change them)


FORMATS = ("nf4", "fp4")


def bnb_4bit_format(double_quant: bool) -> WeightFormat:
    """bitsandbytes' 4-bit layout (NF4 and FP4 store alike), with or without double quantization."""
    return BNB_4BIT_DOUBLE if double_quant else BNB_4BIT


@register
@dataclass(frozen=True, kw_only=True)
class Bnb4bit(Technique):
    name = "bnb-4bit"
    examples = (("bnb-4bit", {"task": "inference"}),)
    risk = "lossy"
    stage = "quantize"
    summary = "bitsandbytes 4-bit weights (NF4 or FP4, blocks of 64) on every nn.Linear but the LM head"
    time_factor = 1.3    # a dequantization per linear per call (assumed)
    traits = frozenset({"subclass-weights", "quantized-linears"})
    conflicts_with = FOUR_BIT_CONFLICTS
    oom_fixes = ("bnb-4bit",)
    search_axis = "weights"

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [cls.name] if request.task == "inference" else []
    format: str = "nf4"
    double_quant: bool = True

    def __post_init__(self) -> None:
        check_format(self.name, self.format)

    def check(self, workload) -> None:
        if workload.task != "inference":
            raise MemfitError(f"-t {self.name} freezes the weights as 4-bit codes; to train, add adapters with "
                              f"-t qlora (4-bit base + LoRA).")
        check_4bit_model(self.name, workload)

    def weight_format(self) -> WeightFormat:
        return bnb_4bit_format(self.double_quant)

    def apply_(self, setup: StepSetup) -> None:
        quantize_4bit_(setup, self.name, self.format, self.double_quant)


def check_format(name: str, format: str) -> None:
    require_choice(format, FORMATS, f"-t {name}: format")


def check_4bit_model(name: str, workload) -> None:
    if get_precision(workload.precision).loss_scaling:
        raise MemfitError(f"-t {name}: use --precision {precision_names(loss_scaling=False)} (4-bit weights have no "
                          f"master copy for {workload.precision}'s loss scaler to guard).")
    refuse_conv1d(name, workload)


def quantize_4bit_(setup: StepSetup, name: str, format: str, double_quant: bool,
                   keep: tuple[str, ...] = ("lm_head",)) -> None:
    """Replace every nn.Linear but those named in `keep` by a bitsandbytes Linear4bit holding its weight as
    4-bit codes, computing in the autocast dtype under mixed precision, else in the weight's own dtype."""
    try:
        from bitsandbytes.nn import Linear4bit, Params4bit
    except ImportError:
        raise MemfitError(f"-t {name} needs bitsandbytes: pip install 'memfit[quantization]'.") from None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    compute = setup.precision.autocast_dtype
    replaced = 0
    for parent in list(setup.model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child_name in keep:
                continue
            weight = child.weight
            with unset_fake_temporarily():   # an empty shell on the meta device; its weight is set below
                linear = Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                    compute_dtype=compute or weight.dtype, compress_statistics=double_quant,
                                    quant_type=format, device="meta")
            linear.support_avx512bf16_for_cpu = False    # compute as on a GPU (the module docstring)
            traced = stand_in("bnb-4bit-weight", [weight])   # Params4bit cannot wrap a fake tensor
            if traced is not None:
                traced(linear, weight, quant_type=format, double_quant=double_quant)
            else:
                linear.weight = Params4bit(weight.data, requires_grad=False, quant_type=format,
                                           compress_statistics=double_quant, module=linear)._quantize(weight.device)
            if child.bias is not None:
                linear.bias = child.bias
            setattr(parent, child_name, linear)
            replaced += 1
    if not replaced:
        raise MemfitError(f"-t {name}: the model has no nn.Linear to quantize (besides {', '.join(keep)}).")
    # as transformers marks it: peft then wraps the 4-bit linears for LoRA
    setup.model.is_loaded_in_4bit = True  # type: ignore[assignment]  # nn.Module.__setattr__ takes any value
