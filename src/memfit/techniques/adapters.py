"""Low-rank adapters: the model's weights freeze, small adapters train (LoRA, with peft).

  lora[:rank=16,alpha=32,targets=q_proj|v_proj]
          peft's LoRA (Hu et al., 2021) on the linear layers named by `targets` (the module names'
          last part; default q_proj and v_proj, peft's own default for Llama-style models). Each target
          W x becomes W x + (alpha / rank) B A x with A (rank x in) and B (out x rank) trainable and W
          frozen, B starting at zero (the first step's outputs equal the base model's). Every other
          parameter freezes. Memory: no gradients or optimizer states for the frozen weights (often
          the bulk of a full fine-tune's memory), two small matrices per target with their gradients and
          states, and per target the adapter's activations: A x (rank per token) saved for backward and
          two output-sized temporaries. Backward still runs through every block for the input
          gradients, so the base model's activations are saved as before.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

from memfit.core.errors import MemfitError, require_positive_int
from memfit.techniques.base import Technique, register
from memfit.techniques.setup import StepSetup

# The adapted linears of Llama-style models when `targets` is not given (peft's default for them)
DEFAULT_TARGETS = ("q_proj", "v_proj")


@register
@dataclass(frozen=True, kw_only=True)
class Lora(Technique):
    name = "lora"
    risk = "lossy"       # only the adapters train: another model than a full fine-tune
    stage = "adapters"
    summary = "LoRA (peft): every weight frozen, low-rank adapters on the target linears train"
    time_factor = 0.75   # no weight gradients for the frozen matrices (assumed)
    rank: int = 16
    alpha: int | None = None        # default 2 x rank
    targets: str | None = None      # module-name suffixes joined by "|"; default q_proj|v_proj

    def __post_init__(self) -> None:
        require_positive_int(self.rank, "-t lora: rank")
        if self.alpha is not None:
            require_positive_int(self.alpha, "-t lora: alpha")
        if self.targets is not None and not all(re.fullmatch(r"[\w.]+", t) for t in self.targets.split("|")):
            raise MemfitError(f"-t lora: targets are module names joined by '|', got {self.targets!r}.")

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(self.targets.split("|")) if self.targets else DEFAULT_TARGETS

    @property
    def scaling(self) -> float:
        return (self.alpha or 2 * self.rank) / self.rank

    def check(self, workload) -> None:
        if workload.task != "train":
            raise MemfitError("-t lora changes what trains; for inference there is nothing to adapt.")

    def apply_(self, setup: StepSetup) -> None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise MemfitError("-t lora needs peft: pip install 'memfit[peft]'.") from None
        names = {name.rsplit(".", 1)[-1] for name, _ in setup.model.named_modules()}
        missing = [t for t in self.target_names if t not in names]
        if missing:
            raise MemfitError(f"-t lora: the model has no module named {', '.join(missing)}; pass targets=NAME|NAME "
                              "with the last part of linear layers' names.")
        config = LoraConfig(r=self.rank, lora_alpha=self.alpha or 2 * self.rank, lora_dropout=0.0,
                            target_modules=list(self.target_names))
        with _traceable(setup.model):
            setup.model = get_peft_model(setup.model, config)


@contextlib.contextmanager
def _traceable(model):
    """peft builds each adapter in float32 on the CPU and moves it to its base layer's device and dtype
    with Module.to, which cannot swap fake tensors (a traced run's). There the adapters are built in the
    base weights' dtype from the start, and a Module.to that would change nothing returns at once."""
    from torch._subclasses.fake_tensor import is_fake

    weights = next((p for p in model.parameters() if p.is_floating_point()), None)
    if weights is None or not is_fake(weights):
        yield
        return
    to, default = torch.nn.Module.to, torch.get_default_dtype()

    def to_unless_there(module, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if all((device is None or t.device.type == torch.device(device).type)
               and (dtype is None or not t.is_floating_point() or t.dtype == dtype) for t in tensors):
            return module
        return to(module, *args, **kwargs)

    torch.nn.Module.to = to_unless_there
    torch.set_default_dtype(weights.dtype)
    try:
        yield
    finally:
        torch.nn.Module.to = to
        torch.set_default_dtype(default)
