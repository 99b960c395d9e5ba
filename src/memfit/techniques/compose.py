"""How techniques combine: one canonical order, one table of combinations that do not work, and the
two entry points that apply them (to a workload's step, or to a user's own model and optimizer).

Everything here runs before the model is touched: a bad combination or an unknown technique is a
MemfitError and nothing has been changed.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision
from memfit.techniques.base import Technique, parse_technique
from memfit.techniques.setup import StepSetup, precision_of_model

if TYPE_CHECKING:
    from memfit.specs.workload import Workload

# The canonical order (torchtitan's: quantize -> LoRA -> checkpoint -> compile -> shard), one step
# per stage, each with the reason it comes where it does.
ORDER: tuple[tuple[str, str], ...] = (
    ("memory", "allocator settings come before the first device allocation they should govern"),
    ("precision", "weights take their final dtype first: every later step wraps or copies the real weights"),
    ("sequence", "the batch's shape is fixed before anything is sized from it"),
    ("loss", "the loss head is replaced before blocks are wrapped, so checkpointing wraps the model's own blocks"),
    ("student", "the model to train is settled first: distill swaps in a student, which every step below changes"),
    ("prune", "heads and channels are removed before the rest is quantized (pruning scores full-precision weights)"),
    ("quantize", "weights are quantized before adapters sit beside them (QLoRA trains adapters on a quantized "
                 "base)"),
    ("adapters", "adapters go into the final layers before blocks are wrapped, so checkpointing recomputes "
                 "them with their block (torchtitan's order: quantize, LoRA, checkpoint, shard)"),
    ("checkpointing", "blocks are wrapped once the model is final and before it is sharded (torchtitan's order)"),
    ("shard", "blocks are sharded (or the model replicated) after checkpointing wraps them, so each block's "
              "all-gather surrounds its recompute too"),
    ("optimizer", "the optimizer is built last, over the parameters as the steps above left them"),
)
_STAGE_INDEX = {stage: i for i, (stage, _) in enumerate(ORDER)}


@dataclass(frozen=True)
class Rule:
    """Techniques `names` (all present), when `when(workload)` holds, do not work together."""

    names: frozenset[str]
    reason: str
    fix: str
    when: Callable[[Workload], bool] | None = None


RULES: tuple[Rule, ...] = (
    Rule(frozenset({"adamw8bit"}), "bitsandbytes keeps 8-bit states per whole tensor in blocks of 256, but "
         "ZeRO-1/2 partitions one flat optimizer state across ranks",
         "drop --zero, or keep the fp32 optimizer under ZeRO", lambda w: w.zero_stage >= 1),
    Rule(frozenset({"adamw4bit"}), "torchao's 4-bit states are per whole tensor (or per DTensor shard), not "
         "partitions of one flat ZeRO-1/2 state", "drop --zero", lambda w: w.zero_stage >= 1),
    Rule(frozenset({"cpu-offload", "fp16-mixed"}), "the loss scaler unscales and checks the gradients on the "
         "device, but cpu-offload moves each one to the host as it arrives", "use bf16-mixed with cpu-offload",
         lambda w: w.engine == "pytorch"),
    Rule(frozenset({"ddp", "fsdp2"}), "DDP replicates the model that FSDP2 shards; one data-parallel wrapper "
         "per model", "keep one of -t ddp and -t fsdp2"),
    Rule(frozenset({"ddp", "chunked-ce"}), "chunked-ce calls the base model directly, around DDP's forward, "
         "so DDP would never prepare its gradient reduction", "drop chunked-ce"),
    Rule(frozenset({"ddp", "cpu-offload"}), "cpu-offload takes each gradient off the device as it arrives, "
         "before DDP's bucket reduction reads it", "use -t fsdp2 -t cpu-offload"),
    Rule(frozenset({"tensor-parallel", "ddp"}), "memfit runs tensor parallel over every rank (no 2-D mesh yet)",
         "drop -t ddp"),
    Rule(frozenset({"tensor-parallel", "fsdp2"}), "memfit runs tensor parallel over every rank (no 2-D mesh yet)",
         "drop -t fsdp2"),
    Rule(frozenset({"tensor-parallel", "cpu-offload"}), "the host optimizer copies plain tensors, and tensor "
         "parallel's weights are DTensor shards", "drop cpu-offload"),
    *(Rule(frozenset({"pipeline-parallel", other}), reason, fix) for other, reason, fix in (
        ("ddp", "memfit runs the pipeline over every rank (no 2-D mesh yet)", "drop -t ddp"),
        ("fsdp2", "memfit runs the pipeline over every rank (no 2-D mesh yet)", "drop -t fsdp2"),
        ("tensor-parallel", "memfit runs the pipeline over every rank (no 2-D mesh yet)", "drop one of them"),
        ("cpu-offload", "the pipeline schedule runs its own backward; cpu-offload's host optimizer is not wired "
         "into it", "drop cpu-offload"),
        ("chunked-ce", "the last stage computes the loss from the logits it sends", "drop chunked-ce"),
        ("sequence-chunks", "the schedule splits the batch into micro-batches itself", "drop sequence-chunks"),
        ("fp16-mixed", "the schedule runs backward itself, on a loss the GradScaler never scaled",
         "use bf16-mixed with pipeline-parallel"))),
    Rule(frozenset({"qlora", "lora"}), "qlora is lora on a 4-bit base", "keep one of them"),
    Rule(frozenset({"lora", "tensor-parallel"}), "peft replaces the target linears with LoRA layers, which tensor "
         "parallel's plans do not split", "drop -t tensor-parallel (use fsdp2 with lora)"),
    Rule(frozenset({"qat", "tensor-parallel"}), "torchao's fake-quantized linears are not the nn.Linear that tensor "
         "parallel's plans split", "drop -t tensor-parallel"),
    Rule(frozenset({"fp16-mixed", "tensor-parallel"}), "GradScaler unscales plain and DTensor gradients in one "
         "kernel, which takes one kind", "use bf16-mixed with tensor-parallel"),
    Rule(frozenset({"checkpointing", "tensor-parallel"}), "checkpointing:mode=offload copies saved tensors to the host "
         "as plain tensors, and tensor parallel saves DTensors", "use checkpointing:mode=full or selective",
         lambda w: w.technique("checkpointing").mode == "offload"),
    *(Rule(frozenset({"stream-layers", quantized}), "stream-layers copies plain weights between host and device; "
           f"{quantized}'s weights are tensor subclasses", f"drop -t {quantized} or -t stream-layers")
      for quantized in ("int8-weight-only", "int8-dynamic", "bnb-4bit")),
    Rule(frozenset({"lora", "pipeline-parallel"}), "peft wraps the model, and the pipeline splits the blocks of the "
         "model itself", "drop -t pipeline-parallel (use fsdp2 with lora)"),
    *(Rule(frozenset(pair), "a linear weight is quantized one way", "keep one quantization")
      for pair in ({"bnb-4bit", "int8-weight-only"}, {"qlora", "int8-weight-only"}, {"qlora", "bnb-4bit"},
                   {"qat", "qlora"}, {"qat", "lora"})),
    *(Rule(frozenset({four_bit, sharding}), f"bitsandbytes' 4-bit weights are not split by {sharding} (no "
           "DTensor or pipeline stage support here)", f"drop -t {sharding}")
      for four_bit in ("bnb-4bit", "qlora") for sharding in ("fsdp2", "tensor-parallel", "pipeline-parallel")),
    *(Rule(frozenset({"distill", other}), reason, f"drop -t {other}") for other, reason in (
        *((wrapper, "the teacher would stay outside the data-parallel, sharded or pipelined student")
          for wrapper in ("ddp", "fsdp2", "tensor-parallel", "pipeline-parallel")),
        ("chunked-ce", "distillation needs the student's whole logits for the soft targets"),
        *((adapter, "the student trains whole; adapters on a distilled student are not built here")
          for adapter in ("lora", "qlora")))),
    Rule(frozenset({"distill"}), "--engine deepspeed wraps one model; the teacher would stay outside it",
         "use --engine pytorch", lambda w: w.engine == "deepspeed"),
    Rule(frozenset({"fsdp2", "chunked-ce"}), "chunked-ce calls the base model directly, so the root FSDP "
         "module never all-gathers the LM head", "drop chunked-ce"),
) + tuple(
    Rule(frozenset({name}), f"--engine deepspeed {reason}", fix, lambda w: w.engine == "deepspeed")
    for name, reason, fix in (
        *((optimizer, "runs DeepSpeed's own AdamW (float32 master weights and moments)", "use --engine pytorch")
          for optimizer in ("adamw8bit", "adamw4bit", "adafactor")),
        *((wrapper, "wraps the model itself (ZeRO data parallel)", f"drop -t {wrapper}")
          for wrapper in ("ddp", "fsdp2", "tensor-parallel", "pipeline-parallel")),
        ("chunked-ce", "runs its forward around the model; chunked-ce would call the model past it",
         "drop chunked-ce"),
        ("sequence-chunks", "runs one micro-batch per step here", "drop sequence-chunks"),
        ("qlora", "casts every weight to its half type, 4-bit codes included", "use --engine pytorch"))
) + tuple(
    Rule(frozenset({"cpu-offload", optimizer}), "the host optimizer keeps float32 states (DeepSpeed's CPU Adam "
         "does too); 8- and 4-bit states are kernels for the device", "use AdamW or Adafactor with cpu-offload")
    for optimizer in ("adamw8bit", "adamw4bit")
) + tuple(   # fsdp2's and tensor parallel's parameters are DTensor shards
    Rule(frozenset({sharding, optimizer}), reason, f"use AdamW with {sharding}")
    for sharding in ("fsdp2", "tensor-parallel")
    for optimizer, reason in (("adamw8bit", "bitsandbytes' 8-bit states are not DTensor-aware"),
                              ("adamw4bit", "memfit does not trace torchao's 4-bit states on DTensor shards yet"),
                              ("adafactor", "torch.optim.Adafactor's in-place norm updates do not run on DTensor "
                                            "shards")))


def ordered(techniques: Iterable[Technique]) -> list[Technique]:
    return sorted(techniques, key=lambda t: (_STAGE_INDEX[t.stage], t.name))


def _parse_all(specs: Iterable[str | Technique]) -> list[Technique]:
    parsed = [s if isinstance(s, Technique) else parse_technique(s) for s in specs]
    seen: dict[str, Technique] = {}
    for technique in parsed:
        if technique.name in seen:
            raise MemfitError(f"-t {technique.name} is given twice ({seen[technique.name].spec}, {technique.spec}); "
                              "keep one.")
        seen[technique.name] = technique
    fields: dict[str, Technique] = {}
    for technique in parsed:
        field = technique.workload_field
        if field and field in fields:
            raise MemfitError(f"-t {fields[field].name} and -t {technique.name} both set the {field}; keep one.")
        if field:
            fields[field] = technique
    return ordered(parsed)


def check_rules(techniques: list[Technique], workload: Workload | None) -> None:
    names = {t.name for t in techniques}
    if workload is not None:
        names |= {workload.precision, workload.optimizer}
    for rule in RULES:
        if rule.names <= names and (rule.when is None or (workload is not None and rule.when(workload))):
            raise MemfitError(f"{' + '.join(sorted(rule.names))}: {rule.reason}; {rule.fix}.")


def fold_into(workload: Workload, specs: Iterable[str | Technique]) -> tuple[dict[str, str], tuple[str, ...]]:
    """Parse the workload's techniques: the field-setting ones become field values (precision, optimizer),
    the rest canonical specs in the canonical order. Checked against the workload and the rules."""
    techniques = _parse_all(specs)
    fields: dict[str, str] = {}
    for technique in techniques:
        field = technique.workload_field
        if field is None:
            continue
        current, default = getattr(workload, field), type(workload).__dataclass_fields__[field].default
        if current not in (default, technique.name):
            raise MemfitError(f"--{field} {current} and -t {technique.name} disagree; keep one.")
        fields[field] = technique.name
    return fields, tuple(t.spec for t in techniques if t.workload_field is None)


def check_workload(workload: Workload) -> None:
    techniques = workload.technique_configs
    for technique in techniques:
        technique.check(workload)
    check_rules(techniques, workload)


def prepare_step(model: nn.Module, workload: Workload, *, device_type: str, foreach: bool | None = None,
                 autocast: Callable | None = None) -> StepSetup:
    """The workload's step for `model` (built in the workload's precision), techniques applied in order."""
    setup = StepSetup(model=model, precision=get_precision(workload.precision), device_type=device_type,
                      optimizer_name=workload.optimizer, foreach=foreach, autocast_fn=autocast,
                      shard_optimizer=workload.zero_stage == 1)
    for technique in workload.technique_configs:
        technique.apply_(setup)
    return setup


def apply_(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
           techniques: Iterable[str | Technique] = (), *, device_type: str | None = None) -> StepSetup:
    """Apply techniques to a user's own model (in place) and return what their loop needs: `setup.optimizer`
    (rebuilt when an optimizer technique is given, with the given optimizer's learning rate; with
    cpu-offload, the given optimizer's kind and settings over host master weights — drop the old one),
    `setup.autocast()`, `setup.loss(model, batch)`, `setup.prepare_batch(batch)` — or `setup.step(batch)`.
    With lora, `setup.model` is peft's wrapper and the optimizer is rebuilt (same kind and settings) over
    the adapters."""
    configs = _parse_all(techniques)
    check_rules(configs, None)
    new_optimizer = any(t.workload_field == "optimizer" for t in configs)
    if optimizer is None and not new_optimizer and any(t.name == "cpu-offload" for t in configs):
        raise MemfitError("-t cpu-offload moves the optimizer to the host: pass your optimizer to apply_.")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    setup = StepSetup(model=model, precision=precision_of_model(model), device_type=device_type or device.type,
                      optimizer=optimizer)
    for technique in configs:
        technique.apply_(setup)
    if new_optimizer:
        setup.lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None
        setup.optimizer = None
        setup.build_optimizer()
        return setup
    trainable = [p for p in setup.model.parameters() if p.requires_grad]
    if setup.offload == "optimizer":   # the user's optimizer, rebuilt over host master weights
        setup.optimizer = setup.offloaded(_same_kind(setup.optimizer))
    elif optimizer is not None and {id(p) for p in trainable} != {
            id(p) for group in optimizer.param_groups for p in group["params"]}:   # lora froze the weights
        setup.optimizer = _same_kind(optimizer)(trainable)
    return setup


def _same_kind(optimizer: torch.optim.Optimizer) -> Callable[[list], torch.optim.Optimizer]:
    """A builder of `optimizer`'s kind with its settings (capturable dropped: CUDA graphs only)."""
    kind = type(optimizer)
    accepted = inspect.signature(kind.__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "capturable"}
    return lambda params: kind(params, **settings)
