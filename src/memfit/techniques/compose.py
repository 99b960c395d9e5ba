"""How techniques combine: one canonical order, the rules the techniques declare between them, and the two
entry points that apply them (to a workload's step, or to a user's own model and optimizer).

Everything here runs before the model is touched: a bad combination or an unknown technique is a
MemfitError and nothing has been changed.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision
from memfit.techniques.base import REGISTRY, Technique, parse_technique
from memfit.steps.setup import StepSetup, precision_of_model

if TYPE_CHECKING:
    from memfit.techniques.resolve import ResolvedWorkload

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
    ("offload", "what lives in host RAM is settled before sharding: FSDP2 takes its CPU offload policy when it "
                "shards the blocks"),
    ("shard", "blocks are sharded (or the model replicated) after checkpointing wraps them, so each block's "
              "all-gather surrounds its recompute too"),
    ("optimizer", "the optimizer is built last, over the parameters as the steps above left them"),
)
_STAGE_INDEX = {stage: i for i, (stage, _) in enumerate(ORDER)}


def ordered(techniques: Iterable[Technique]) -> list[Technique]:
    return sorted(techniques, key=lambda t: (_STAGE_INDEX[t.stage], t.name))


def parse_all(specs: Iterable[str | Technique]) -> list[Technique]:
    """Parsed technique configs in the canonical order; a technique given twice, or two that set the same
    workload field, are refused."""
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


def check_rules(techniques: list[Technique], workload: ResolvedWorkload | None) -> None:
    """Refuse the first combination that a technique's declared rules forbid (`conflicts`: with another technique
    by name or by trait; `deepspeed_conflict`: under DeepSpeed's engine), with its reason and fix."""
    if workload is not None:
        techniques = workload.field_techniques + [t for t in techniques if t.workload_field is None]
    for technique in techniques:
        for key, (reason, fix) in technique.conflicts().items():
            for other in techniques:
                if other is not technique and (other.name == key or key in other.traits):
                    names = " + ".join(sorted((technique.name, other.name)))
                    raise MemfitError(f"{names}: {reason.format(other=other.name)}; {fix.format(other=other.name)}.")
        if workload is not None and workload.engine == "deepspeed" and technique.deepspeed_conflict:
            reason, fix = technique.deepspeed_conflict
            raise MemfitError(f"{technique.name}: --engine deepspeed {reason}; {fix.format(other=technique.name)}.")


def declared_rules() -> list[dict]:
    """Every rule the registered techniques declare (`memfit techniques --json`)."""
    rules = []
    for cls in sorted(REGISTRY.values(), key=lambda c: (_STAGE_INDEX[c.stage], c.name)):
        for key, (reason, fix) in cls.conflicts_with.items():
            rules.append({"technique": cls.name, "with": key, "reason": reason, "fix": fix})
        if cls.deepspeed_conflict:
            rules.append({"technique": cls.name, "with": "--engine deepspeed", "reason": cls.deepspeed_conflict[0],
                          "fix": cls.deepspeed_conflict[1]})
    return rules


def prepare_step(model: nn.Module, workload: ResolvedWorkload, *, device_type: str, foreach: bool | None = None,
                 autocast: Callable | None = None) -> StepSetup:
    """The workload's step for `model` (built in the workload's precision), techniques applied in order (its
    precision and optimizer too, where they are techniques)."""
    setup = StepSetup(model=model, precision=get_precision(workload.precision), device_type=device_type,
                      optimizer_name=workload.optimizer, foreach=foreach, autocast_fn=autocast,
                      shard_optimizer=workload.zero_stage == 1)
    for technique in ordered(workload.field_techniques + list(workload.technique_configs)):
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
    configs = parse_all(techniques)
    check_rules(configs, None)
    new_optimizer = any(t.workload_field == "optimizer" for t in configs)
    if optimizer is None and not new_optimizer and any("host-optimizer" in t.traits for t in configs):
        names = ", ".join(t.name for t in configs if "host-optimizer" in t.traits)
        raise MemfitError(f"-t {names} moves the optimizer to the host: pass your optimizer to apply_.")
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
    if setup.host_optimizer is not None:   # the user's optimizer, rebuilt over host master weights
        setup.optimizer = setup.host_optimizer(setup.model.parameters(), _same_kind(setup.optimizer))
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
