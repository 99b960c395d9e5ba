"""Weight quantization: the model's linear weights stored in fewer bits.

  int8-weight-only   torchao's Int8WeightOnlyConfig on every nn.Linear (inference): each weight as int8
                     codes with a float32 scale and an int8 zero point per output row (1 byte per weight
                     instead of 4 or 2). A linear converts the whole weight to the activations' dtype,
                     multiplies, then applies the row scales: per call the weight's size in that dtype
                     and one more output-sized tensor are temporaries (measured on the CPU kernel).
                     Embeddings stay as they are; a head tied to them gets its own int8 copy.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from memfit.core.errors import MemfitError
from memfit.techniques.base import Technique, register
from memfit.techniques.setup import StepSetup


@register
@dataclass(frozen=True, kw_only=True)
class Int8WeightOnly(Technique):
    name = "int8-weight-only"
    risk = "lossy"
    stage = "quantize"
    summary = "torchao int8 weight-only: every nn.Linear weight as int8 codes with a float32 scale per row"

    def check(self, workload) -> None:
        if workload.task != "inference":
            raise MemfitError("-t int8-weight-only quantizes a model for inference; training through int8 "
                              "weights is quantization-aware training (not here yet).")
        if workload.precision not in ("fp32", "bf16"):
            raise MemfitError(f"-t int8-weight-only dequantizes to the weights' own dtype; use --precision fp32 "
                              f"or bf16, not {workload.precision}.")
        if workload.source.is_hf and workload.source.model_type == "gpt2":
            raise MemfitError("-t int8-weight-only: GPT-2's blocks use Conv1D, which torchao does not quantize "
                              "(only the LM head would be).")

    def apply_(self, setup: StepSetup) -> None:
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
        import torch
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        linears = [m for m in setup.model.modules() if isinstance(m, torch.nn.Linear)]
        if not linears:
            raise MemfitError("-t int8-weight-only: the model has no nn.Linear to quantize.")
        quantize_(setup.model, Int8WeightOnlyConfig())
