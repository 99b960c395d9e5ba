"""Low-rank adapters: the model's weights freeze, small adapters train (LoRA, with peft).

  lora[:rank=16,alpha=32,targets=q_proj|v_proj]
          peft's LoRA (Hu et al., 2021) on the linear layers named by `targets` (the module names'
          last part; default q_proj and v_proj, peft's own default for Llama-style models; on a model
          that is not a transformers one, every linear except the output head, peft's all-linear rule,
          with the head the linear tied to an embedding, else the last one registered;
          targets=all-linear asks for that rule on a transformers model too). Each target
          W x becomes W x + (alpha / rank) B A x with A (rank x in) and B (out x rank) trainable and W
          frozen, B starting at zero (the first step's outputs equal the base model's). Every other
          parameter freezes. Memory: no gradients or optimizer states for the frozen weights (often
          the bulk of a full fine-tune's memory), two small matrices per target with their gradients and
          states, and per target the adapter's activations: A x (rank per token) saved for backward and
          two output-sized temporaries. Backward still runs through every block for the input
          gradients, so the base model's activations are saved as before.
          adapter_dtype=float32 (peft's default, autocast_adapter_dtype): over a bfloat16 or float16 base
          the adapters, their gradients and states are float32, and each adapted linear casts its input
          to float32 for them; adapter_dtype=model keeps them in the model's dtype, as torchtune's LoRA
          does (and peft with autocast_adapter_dtype=False). The analytic estimator models the adapters in
          the model's dtype only.
  qlora[:rank=16,alpha=32,targets=q_proj|v_proj,format=nf4,double_quant=true]
          QLoRA (Dettmers et al., 2023): the frozen base's linears as bitsandbytes 4-bit codes (bnb-4bit,
          quantization.py), LoRA adapters beside the targets as above. The adapters and every
          activation stay in the compute dtype; each base linear dequantizes its weight in forward and
          again in backward (for the input gradient).
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from memfit.core.dtypes import dtype_name
from memfit.core.errors import MemfitError, require_choice, require_positive_int
from memfit.core.precision import get_precision
from memfit.core.weight_formats import WeightFormat
from memfit.steps.setup import StepSetup
from memfit.steps.stand_ins import stand_in
from memfit.techniques.base import Examples, Export, Technique, register
from memfit.techniques.contracts import AnalyticProgram, CostCompute, PlanQuery
from memfit.techniques.quantization import (
    FOUR_BIT_CONFLICTS,
    bnb_4bit_format,
    check_4bit_model,
    check_format,
    quantize_4bit_,
)

# The adapted linears of Llama-style models when `targets` is not given (peft's default for them)
DEFAULT_TARGETS = ("q_proj", "v_proj")
ALL_LINEAR = "all-linear"   # peft's rule: every linear but the output head
# what the planner tries under --allow lossy (each with its measured perplexity cost, estimators/effects.py)
SEARCHED_ADAPTERS = ("", ":rank=64", f":targets={ALL_LINEAR}")
ADAPTER_DTYPES = ("float32", "model")
QLORA_DEQUANT = 1.2   # QLoRA's compute against LoRA's: every 4-bit weight dequantized in forward and backward (assumed)


@register
@dataclass(frozen=True, kw_only=True)
class Lora(Technique):
    name = "lora"
    examples: ClassVar[Examples] = (("lora", {}), ("lora:rank=8,targets=q_proj|v_proj", {}))
    risk = "lossy"       # only the adapters train: another model than a full fine-tune
    changes = "adapters"   # ... beside the base weights as they are (pruning, a student, quantization change them)
    stage = "adapters"
    summary = "LoRA (peft): every weight frozen, low-rank adapters on the target linears train"
    time_factor = 0.75   # no weight gradients for the frozen matrices (assumed)
    traits = frozenset({"adapters"})
    oom_fixes = ("lora",)
    search_axis = "weights"
    conflicts_with = {
        "adapters": ("one set of low-rank adapters per model (qlora is lora on a 4-bit base)", "keep one of them"),
        "splits-linears": ("peft replaces the target linears with LoRA layers, which {other}'s plans do not split",
                           "drop -t {other}"),
        "splits-blocks": ("peft wraps the model, and {other} splits the blocks of the model itself", "drop -t {other}"),
    }
    rank: int = 16
    alpha: int | None = None        # default 2 x rank
    targets: str | None = None      # module-name suffixes joined by "|"; default q_proj|v_proj (transformers
    #                                 models), every linear but the output head (other models: peft's all-linear)
    adapter_dtype: str = "float32"  # float32 (peft's default) | model (the model's dtype: torchtune's)

    def __post_init__(self) -> None:
        require_positive_int(self.rank, "-t lora: rank")
        if self.alpha is not None:
            require_positive_int(self.alpha, "-t lora: alpha")
        if (self.targets not in (None, ALL_LINEAR)
                and not all(re.fullmatch(r"[\w.]+", t) for t in self.targets.split("|"))):
            raise MemfitError(f"-t lora: targets are module names joined by '|' (or {ALL_LINEAR}), got "
                              f"{self.targets!r}.")
        require_choice(self.adapter_dtype, ADAPTER_DTYPES, f"-t {self.name}: adapter_dtype")

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(self.targets.split("|")) if self.targets else DEFAULT_TARGETS

    @property
    def scaling(self) -> float:
        return (self.alpha or 2 * self.rank) / self.rank

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        """LoRA (and QLoRA) at its defaults, at a higher rank, and on every linear (a custom model's default already
        is)."""
        if request.task != "train":
            return []
        if not workload.source.is_hf:
            return [cls.name]
        return [cls.name + variant for variant in SEARCHED_ADAPTERS]

    def export(self, tool, workload) -> Export:
        """The same for every tool: peft.LoraConfig's keyword arguments for the user's script (the adapters are part
        of the model, which no tool's arguments build)."""
        targets = ALL_LINEAR if self.targets == ALL_LINEAR or not workload.source.is_hf else list(self.target_names)
        how = "wrap the model: peft.get_peft_model(model, peft.LoraConfig(**peft_config)" + (
            ")" if self.adapter_dtype == "float32" else
            ", autocast_adapter_dtype=False) (adapters in the model's dtype)")
        return Export({"peft_config": {"r": self.rank, "lora_alpha": self.alpha or 2 * self.rank, "lora_dropout": 0.0,
                                       "target_modules": targets}}, how)

    def cost_compute(self, compute: CostCompute) -> None:   # frozen weights: backward computes input gradients only
        compute.backward = compute.forward

    def analytic_weights(self, program: AnalyticProgram) -> None:
        program.add_adapters(self.rank, self.target_names)

    def check(self, workload) -> None:
        if workload.task != "train":
            raise MemfitError(f"-t {self.name} changes what trains; for inference there is nothing to adapt.")

    def apply_(self, setup: StepSetup) -> None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise MemfitError(f"-t {self.name} needs peft: pip install 'memfit[peft]'.") from None
        if self.targets in (None, ALL_LINEAR) and not _is_transformers_model(setup.model):
            targets: str | list[str] = all_linear_but_head(setup.model)
        elif self.targets == ALL_LINEAR:
            targets = ALL_LINEAR   # peft's own rule for transformers models
        else:
            names = {name.rsplit(".", 1)[-1] for name, _ in setup.model.named_modules()}
            missing = [t for t in self.target_names if t not in names]
            if missing:
                raise MemfitError(f"-t {self.name}: the model has no module named {', '.join(missing)}; pass "
                                  "targets=NAME|NAME with the last part of linear layers' names.")
            targets = list(self.target_names)
        config = LoraConfig(r=self.rank, lora_alpha=self.alpha or 2 * self.rank, lora_dropout=0.0,
                            target_modules=targets)
        # peft moves each adapter with Module.to, which cannot swap a trace's fake tensors: the trace's stand-in
        building = stand_in("peft-adapters", setup.model.parameters()) or contextlib.nullcontext
        with building():
            setup.model = get_peft_model(setup.model, config,
                                         autocast_adapter_dtype=self.adapter_dtype == "float32")
        if self.adapter_dtype == "model":   # peft builds a 4-bit base's adapters in float32 all the same
            _cast_adapters(setup.model, setup.precision.param_dtype)


@register
@dataclass(frozen=True, kw_only=True)
class Qlora(Lora):
    name = "qlora"
    examples = (("qlora", {}),)
    summary = "QLoRA: the base's linears frozen as bitsandbytes 4-bit codes (NF4), LoRA adapters train"
    changes = "lossy"    # the base the adapters train beside is rounded to 4 bits
    time_factor = 0.9    # LoRA's saving, less a dequantization per linear in forward and backward (assumed)
    traits = frozenset({"adapters", "subclass-weights", "quantized-linears"})
    conflicts_with = {**Lora.conflicts_with, **FOUR_BIT_CONFLICTS}
    oom_fixes = ("qlora",)
    deepspeed_conflict = ("casts every weight to its half type, 4-bit codes included", "use --engine pytorch")
    format: str = "nf4"
    double_quant: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_format(self.name, self.format)

    def export(self, tool, workload) -> Export:
        """LoRA's, and transformers' BitsAndBytesConfig for the 4-bit base (from_pretrained's quantization_config)."""
        lora = super().export(tool, workload)
        assert lora.how is not None   # Lora.export says how for every tool
        compute = dtype_name(get_precision(workload.precision).compute_dtype)
        quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": self.format,
                        "bnb_4bit_use_double_quant": self.double_quant, "bnb_4bit_compute_dtype": compute}
        return Export({**lora.settings, "quantization_config": quantization},
                      "load the model with from_pretrained(..., quantization_config=BitsAndBytesConfig("
                      "**quantization_config)), then " + lora.how)

    def cost_compute(self, compute: CostCompute) -> None:
        super().cost_compute(compute)
        compute.factor *= QLORA_DEQUANT

    def weight_format(self) -> WeightFormat:
        return bnb_4bit_format(self.double_quant)

    def analytic_weights(self, program: AnalyticProgram) -> None:
        # the base's linears as 4-bit codes, then the adapters
        program.quantize_linears(self.weight_format())
        super().analytic_weights(program)

    def check(self, workload) -> None:
        super().check(workload)
        check_4bit_model(self.name, workload)

    def apply_(self, setup: StepSetup) -> None:
        quantize_4bit_(setup, self.name, self.format, self.double_quant)
        super().apply_(setup)


def _cast_adapters(model, dtype: torch.dtype) -> None:
    """Every LoRA matrix in `dtype` (a fresh parameter: Module.to cannot swap a traced run's fake tensors)."""
    for name, module in model.named_modules():
        if ".lora_A." in f".{name}." or ".lora_B." in f".{name}.":
            for key, param in list(module.named_parameters(recurse=False)):
                if param.dtype != dtype:
                    cast = torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                    setattr(module, key, cast)


def _is_transformers_model(model) -> bool:
    return hasattr(getattr(model, "config", None), "model_type")


def all_linear_but_head(model) -> list[str]:
    """peft's `all-linear` rule for a model peft does not know: the full names of every nn.Linear except the output
    head, which is the linear whose weight is tied to an embedding's, else the last linear the model registers."""
    from torch import nn

    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tied = [name for name, module in linears if id(module.weight) in embeddings]
    head = tied[-1] if tied else linears[-1][0] if linears else None
    targets = [name for name, _ in linears if name != head]
    if not targets:
        raise MemfitError("-t lora: the model has no linear layer besides its output head to adapt; pass "
                          "targets=NAME|NAME.")
    return targets
