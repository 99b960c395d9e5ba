"""Mixed precision (torch.amp): fp16 autocast with dynamic loss scaling, bf16 autocast, pure bf16 and fp16, and
bf16 weights over float32 master weights.

Mechanism: `fp16-mixed` and `bf16-mixed` keep float32 weights, gradients and optimizer states and
run the forward under torch.autocast, which casts each weight to half once per region and caches
the copy until the region ends (the "autocast cast cache"); activations saved by matmuls are half.
`fp16-mixed` adds torch.amp.GradScaler: the loss is scaled, gradients unscaled before the step, and
a step whose gradients overflowed is skipped (the scale backs off). `bf16` stores the weights
themselves in bfloat16 (2 bytes each; gradients and Adam states follow the weights' dtype); `fp16` in
float16, as T4 and V100 users (no bf16) run inference and as transformers loads the modules it does not
quantize in an 8-bit or 4-bit model.
`bf16-master` stores the weights in bfloat16 and computes in it as `bf16` does (no autocast: every activation is
half), while its optimizer steps on float32 master copies with float32 gradients (steps/master_weights.py): how
Megatron-LM and DeepSpeed train in bf16, and what FSDP2's MixedPrecisionPolicy does on a sharded layout. It
changes training as mixed precision does (the updates are float32), not as reduced-precision weights do.
Memory (per parameter, AdamW): mixed 16 bytes + a half copy of each weight while the forward runs;
pure bf16 8 bytes; bf16-master 18 bytes (2 half + 4 master + 4 gradient + 8 states) and one half gradient at a
time. Source: PyTorch AMP docs; Micikevicius et al., "Mixed Precision Training", 2018.
"""
from __future__ import annotations

from dataclasses import dataclass

from memfit.core.dtypes import dtype_name
from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision
from memfit.steps.master_weights import over_masters
from memfit.steps.setup import StepSetup
from memfit.techniques.base import SNAPSHOT_RATIO, Export, OomFix, Technique, register
from memfit.techniques.contracts import AnalyticProgram, CostStep, OomMessage, OomSnapshot, PlanQuery


@dataclass(frozen=True, kw_only=True)
class _Precision(Technique):
    stage = "precision"
    workload_field = "precision"
    search_axis = "precision"

    def apply_(self, setup: StepSetup) -> None:
        setup.precision = get_precision(self.name)
        if setup.precision.param_dtype != next(setup.model.parameters()).dtype:
            setup.model.to(setup.precision.param_dtype)

    def export(self, tool, workload) -> Export | None:
        precision = get_precision(self.name)
        half = dtype_name(precision.compute_dtype)
        key = {"bfloat16": "bf16", "float16": "fp16"}[half]
        mixed = precision.autocast_dtype is not None
        if tool == "lightning":   # "-true" converts the weights: pure half precision, as memfit's
            return Export({"precision": {"bf16": "bf16", "fp16": "16"}[key] + ("-mixed" if mixed else "-true")})
        if tool == "accelerate":
            return Export({"mixed_precision": key}) if mixed else Export(
                {}, "load the model in that dtype (accelerate's mixed_precision is autocast over float32 weights)")
        settings = {key: True} if tool == "hf-trainer" else {key: {"enabled": True}}
        if mixed:
            return Export(settings)
        return Export(settings, "load the model in that dtype (the tool's flag alone is autocast over float32 "
                                "weights, with float32 master weights and optimizer states in DeepSpeed)")


@register
@dataclass(frozen=True, kw_only=True)
class Fp16Mixed(_Precision):
    name = "fp16-mixed"
    examples = (("fp16-mixed", {}),)
    risk = "numerical"
    changes = "mixed-precision"
    summary = "fp16 autocast with dynamic loss scaling (GradScaler skips steps whose gradients overflow)"
    time_factor = 0.5

    @classmethod
    def search_values(cls, request: PlanQuery, workload):   # where bf16 is missing: GPUs before Ampere
        return [cls.name] if not request.on_cpu and not request.gpu.bf16_tflops else []

    conflicts_with = {
        "splits-linears": ("GradScaler unscales plain and DTensor gradients in one kernel, which takes one kind",
                           "use bf16-mixed with {other}"),
        "own-backward": ("{other} runs backward itself, on a loss the GradScaler never scaled",
                         "use bf16-mixed with {other}"),
    }


@register
@dataclass(frozen=True, kw_only=True)
class Bf16Mixed(_Precision):
    name = "bf16-mixed"
    examples = (("bf16-mixed", {}),)
    risk = "numerical"
    changes = "mixed-precision"
    summary = "bf16 autocast over fp32 weights (half activations, cached half copies of the weights)"
    time_factor = 0.5
    oom_fixes = ("bf16-mixed",)

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [cls.name] if request.task == "train" and (request.on_cpu or request.gpu.bf16_tflops) else []


@register
@dataclass(frozen=True, kw_only=True)
class PureBf16(_Precision):
    name = "bf16"
    examples = (("bf16", {}),)
    risk = "numerical"
    changes = "reduced-precision"
    summary = "weights, gradients and optimizer states in bfloat16 (no fp32 master copy)"
    time_factor = 0.5
    oom_fixes = ("bf16",)

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [cls.name] if request.on_cpu or request.gpu.bf16_tflops else []

    def oom_fix(self, message: OomMessage | None, snapshot: OomSnapshot | None) -> OomFix | None:
        weights = snapshot.by_category.get("parameters") if snapshot is not None else None
        if not weights:
            return None
        return OomFix(self.name, weights // 2, SNAPSHOT_RATIO + "; float32 weights", f"-t {self.name}")


@register
@dataclass(frozen=True, kw_only=True)
class PureFp16(_Precision):
    name = "fp16"
    examples = (("fp16", {}),)
    risk = "numerical"
    changes = "reduced-precision"
    summary = "weights (and in training gradients and optimizer states) in float16: inference where bf16 is missing"
    time_factor = 0.5

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        # inference on GPUs before Ampere; training needs a loss scaler
        return [cls.name] if request.task == "inference" and not request.on_cpu and not request.gpu.bf16_tflops else []

    def estimate_notes(self, workload) -> list[str]:
        if workload.task != "train":
            return []
        return ["fp16 training keeps no float32 master weights and no loss scaler: small updates round away and "
                "gradients can overflow (fp16-mixed scales the loss; bf16 has float32's range)"]


@register
@dataclass(frozen=True, kw_only=True)
class Bf16Master(_Precision):
    name = "bf16-master"
    examples = (("bf16-master", {}),)
    risk = "numerical"
    changes = "mixed-precision"
    summary = ("bf16 weights, activations and compute; the optimizer steps on float32 master weights with float32 "
               "gradients (Megatron-LM's and DeepSpeed's bf16)")
    time_factor = 0.5
    traits = frozenset({"float32-masters"})
    conflicts_with = {
        "layout": ("memfit keeps the float32 masters in one process (over several, FSDP2's MixedPrecisionPolicy "
                   "under bf16-mixed and DeepSpeed's bf16 keep their own)", "use bf16-mixed with {other}"),
        "host-optimizer": ("{other} keeps float32 master weights on the host itself",
                           "use --precision bf16 with {other} (it trains the same)"),
        "steps-in-backward": ("{other} steps each parameter in its own hook, on the half weights",
                              "drop {other}, or use --precision bf16 with it"),
    }

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        # one process only (a layout's sharding keeps its own masters)
        return ([cls.name] if request.task == "train" and request.num_gpus == 1
                and (request.on_cpu or request.gpu.bf16_tflops) else [])

    def check(self, workload) -> None:
        if workload.task != "train":
            raise MemfitError("--precision bf16-master keeps float32 master weights for training; use --precision bf16 "
                              "for inference.")

    def apply_(self, setup: StepSetup) -> None:
        super().apply_(setup)
        setup.optimizer_wrapper = over_masters

    def analytic_policy(self, workload) -> dict:
        return {"grads_leave": True}   # each half gradient is added into its master's float32 one, then freed

    def analytic_buffers(self, program: AnalyticProgram) -> None:
        program.hold_master_weights()

    def cost_overhead(self, step: CostStep) -> None:
        """Beside the step on the masters: each micro-step adds its half gradients into the float32 ones (read 2
        bytes, read and write 4), and the step casts the masters back into the weights (read 4, write 2)."""
        float32_gradients = step.state_bytes("gradients")
        step.add("optimizer", float32_gradients * (2.5 * step.accum + 1.5) / step.hbm_bytes_per_s)

    def export(self, tool, workload) -> Export | None:
        if tool == "deepspeed":   # DeepSpeed's bf16: half weights, float32 masters and gradient accumulation
            return Export({"bf16": {"enabled": True}})
        return None
