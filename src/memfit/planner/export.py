"""A plan in the terms of the tool that runs it: `memfit plan ... --export hf-trainer|deepspeed|torchrun`.

  hf-trainer  keyword arguments for transformers' TrainingArguments (micro-batch, accumulation, precision,
              activation checkpointing, optimizer, FSDP2), as JSON.
  deepspeed   a DeepSpeed config (JSON): micro-batch, accumulation, train batch, half precision, ZeRO stage (the
              workload's, 3 for FSDP2's sharding), optimizer offload.
  torchrun    the launch line for the plan's GPUs, the script left to the user.

Each technique says what it is in a tool's terms (Technique.export); what a tool cannot say is listed under
`not_expressed` with what to do instead, never dropped. Not yet: accelerate and Lightning exports.
"""
from __future__ import annotations

import json

from memfit.core.errors import MemfitError
from memfit.planner.cost import GPUS_PER_NODE
from memfit.techniques.base import Export
from memfit.techniques.resolve import all_techniques

EXPORTS = ("hf-trainer", "deepspeed", "torchrun")
APPLY = "apply it to the model first: memfit.apply_(model, optimizer, [{spec!r}])"
# torch.optim's optimizers (not techniques) by memfit name and implementation -> TrainingArguments.optim
TRAINER_OPTIM = {("adamw", "fused"): "adamw_torch_fused", ("adamw", None): "adamw_torch",
                 ("adamw", "foreach"): "adamw_torch", ("adam", None): "adamw_torch"}


def export(plan, request, kind: str) -> str:
    """Plan `plan` (the planner's Evaluated) of `request` as the text `kind` asks for."""
    if kind not in EXPORTS:
        raise MemfitError(f"unknown --export {kind!r}; choose {', '.join(EXPORTS)}.")
    workload = plan.workload(request)
    if kind == "torchrun":
        return torchrun_line(workload.world_size)
    build = hf_trainer_arguments if kind == "hf-trainer" else deepspeed_config
    return json.dumps(build(plan, workload), indent=2)


def torchrun_line(world_size: int) -> str:
    nodes = -(-world_size // GPUS_PER_NODE)
    spread = (f" --nnodes {nodes} --node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port 29500"
              if nodes > 1 else "")
    return f"torchrun --nproc-per-node {world_size // nodes}{spread} train.py"


def hf_trainer_arguments(plan, workload) -> dict:
    kwargs, not_expressed = _from_techniques("hf-trainer", workload)
    kwargs.update(per_device_train_batch_size=plan.micro_batch, gradient_accumulation_steps=plan.grad_accum)
    optim = TRAINER_OPTIM.get((workload.optimizer, workload.optimizer_impl))
    if optim:
        kwargs["optim"] = optim
        if workload.optimizer == "adam":
            kwargs["weight_decay"] = 0.0   # AdamW without decay is Adam
    if "fsdp_config" in kwargs and kwargs.pop("activation_checkpointing", False):
        kwargs.pop("activation_checkpointing_kwargs", None)   # FSDP's own (the Trainer's would all-gather again)
        kwargs["fsdp_config"]["activation_checkpointing"] = True
    launch = torchrun_line(workload.world_size) if workload.world_size > 1 else "python train.py"
    return {"training_arguments": kwargs, "not_expressed": not_expressed, "launch": launch}


def deepspeed_config(plan, workload) -> dict:
    config, not_expressed = _from_techniques("deepspeed", workload)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = max(zero.get("stage", 0), workload.zero_stage)
    zero["reduce_bucket_size"] = workload.reduce_bucket
    config.update(train_micro_batch_size_per_gpu=plan.micro_batch, gradient_accumulation_steps=plan.grad_accum,
                  train_batch_size=plan.micro_batch * plan.grad_accum * workload.world_size)
    if workload.optimizer in ("adamw", "adam"):
        config["optimizer"] = {"type": "AdamW" if workload.optimizer == "adamw" else "Adam", "params": {"lr": 1e-4}}
    config["memfit"] = {"not_expressed": not_expressed}   # DeepSpeed ignores a key it does not know
    return config


def _from_techniques(tool: str, workload) -> tuple[dict, list[dict]]:
    """The settings every technique of `workload` (its precision and optimizer included) gives `tool`, merged, and
    what it cannot say."""
    settings: dict = {}
    not_expressed: list[dict] = []
    for technique in all_techniques(workload):
        exported = technique.export(tool, workload)
        if exported is None:
            exported = Export({}, APPLY.format(spec=technique.spec))
        _merge(settings, exported.settings)
        if exported.how:
            not_expressed.append({"setting": technique.spec, "how": exported.how})
    return settings, not_expressed


def _merge(into: dict, more: dict) -> None:
    """Nested dictionaries merged; of two ZeRO stages, the higher."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif key == "stage" and key in into:
            into[key] = max(into[key], value)
        else:
            into[key] = value
