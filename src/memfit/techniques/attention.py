"""Attention techniques for Hugging Face models: memory-efficient SDPA instead of eager attention, and
local (sliding-window) attention.

  sdpa                    torch.nn.functional.scaled_dot_product_attention instead of eager attention:
                          the fused kernels (flash / memory-efficient on CUDA, flash on CPU) never
                          materialise the `batch x heads x seq x seq` scores and probabilities that eager
                          attention saves for backward (Korthikanti et al.'s 5as/h term; Dao et al., 2022).
                          Same results up to rounding (numerical).
  sliding-window:window=W each token attends to the previous W only (Mistral-style local attention): the
                          KV cache of decoding stops growing at W tokens. With SDPA a window shorter than
                          the sequence needs an explicit mask (b x s x s), so a training step can use
                          *more* memory than causal SDPA unless a kernel with native windows is used.
                          Changes results for sequences longer than W (lossy).
Both change the model's config, so memfit's estimates and its real runs build the same model; on a
user's already-built model `apply_` switches the live model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from memfit.core.errors import MemfitError, require_positive_int
from memfit.specs.model_source import FUSED_OUTSIDE_SDPA
from memfit.steps.setup import StepSetup
from memfit.techniques.base import SNAPSHOT_RATIO, OomFix, Technique, register
from memfit.techniques.contracts import CostCompute, OomMessage, OomSnapshot, PlanQuery

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SLIDING_WINDOW_TYPES = ("mistral", "mixtral", "qwen2", "phi3")


@register
@dataclass(frozen=True, kw_only=True)
class Sdpa(Technique):
    name = "sdpa"
    examples = (("sdpa", {"model": "tiny-llama-eager"}),)
    risk = "numerical"
    stage = "sequence"
    summary = "fused scaled-dot-product attention instead of eager attention (no seq x seq scores saved)"
    time_factor = 0.9
    oom_fixes = ("sdpa",)
    search_axis = "attention"

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [cls.name] if workload.source.eager_attention else []

    def cost_compute(self, compute: CostCompute) -> None:
        # fused attention: the same FLOPs, which is what the roofline counts
        pass

    def config_overrides(self, source) -> dict:
        return {"attn_implementation": "sdpa"} if source.is_hf else {}

    def check(self, workload) -> None:
        source = workload.source
        if not source.is_hf:
            raise MemfitError("-t sdpa switches a Hugging Face model's attention; a custom module computes its own "
                              "(call torch.nn.functional.scaled_dot_product_attention in it).")
        if source.model_type == "gemma2":
            raise MemfitError("-t sdpa: Gemma-2's attention logit soft-capping needs eager attention.")
        if source.hf_config.get("attn_implementation", "sdpa") in ("sdpa", *FUSED_OUTSIDE_SDPA):
            raise MemfitError(f"{source.name} already uses fused attention; drop -t sdpa (set "
                              "\"attn_implementation\": \"eager\" in its config.json to compare).")

    def apply_(self, setup: StepSetup) -> None:
        model = cast("PreTrainedModel", setup.model)   # check(): a Hugging Face model
        if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
            model.set_attn_implementation("sdpa")


@register
@dataclass(frozen=True, kw_only=True)
class SlidingWindow(Technique):
    name = "sliding-window"
    examples = (("sliding-window:window=32", {"model": "tiny-qwen2", "task": "inference", "new_tokens": 64}),)
    risk = "lossy"
    stage = "sequence"
    summary = "local attention over the last `window` tokens (KV cache capped at the window)"
    window: int = 4096

    def oom_fix(self, message: OomMessage | None, snapshot: OomSnapshot | None) -> OomFix | None:
        cache = snapshot.by_category.get("kv_cache") if snapshot is not None else None
        if not cache:
            return None
        return OomFix("half the context", cache // 2, SNAPSHOT_RATIO,
                      f"shorter prompts or -t {self.name}:window=W")

    def __post_init__(self) -> None:
        require_positive_int(self.window, "-t sliding-window: window")

    def config_overrides(self, source) -> dict:
        if not source.is_hf or source.model_type not in SLIDING_WINDOW_TYPES:
            return {}
        overrides = {"sliding_window": self.window}
        if source.model_type == "qwen2":
            overrides.update(use_sliding_window=True, max_window_layers=0)
        return overrides

    def check(self, workload) -> None:
        source = workload.source
        if not source.is_hf or source.model_type not in SLIDING_WINDOW_TYPES:
            raise MemfitError(f"-t sliding-window needs a model whose attention supports a window "
                              f"({', '.join(SLIDING_WINDOW_TYPES)}); {source.name!r} is {source.model_type!r}.")

    def apply_(self, setup: StepSetup) -> None:
        config = cast("PreTrainedModel", setup.model).config   # check(): a Hugging Face model
        if getattr(config, "sliding_window", None) != self.window:
            config.sliding_window = self.window
            if getattr(config, "layer_types", None):
                config.layer_types = ["sliding_attention"] * len(config.layer_types)
