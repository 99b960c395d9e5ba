"""A plan in the terms of the tool that runs it: `memfit plan ... --export hf-trainer|torchrun`.

  hf-trainer  keyword arguments for transformers' TrainingArguments (micro-batch, accumulation, precision, gradient
              checkpointing, optimizer, FSDP), as JSON. What TrainingArguments cannot say is listed under
              `not_expressed` with what to do instead (most: memfit.apply_ on the model before the Trainer).
  deepspeed   a DeepSpeed config (JSON): micro-batch, accumulation, train batch, half precision, ZeRO stage (the
              workload's, or 3 for FSDP2's sharding), optimizer offload; what it cannot say is listed under
              `memfit.not_expressed` (DeepSpeed ignores the key).
  torchrun    the launch line for the plan's GPUs, the script left to the user.

Not yet: accelerate and Lightning exports.
"""
from __future__ import annotations

import json

from memfit.core.errors import MemfitError
from memfit.techniques.base import parse_technique

EXPORTS = ("hf-trainer", "deepspeed", "torchrun")
GPUS_PER_NODE = 8

# memfit optimizer (and its implementation) -> TrainingArguments.optim
_OPTIM = {("adamw", "fused"): "adamw_torch_fused", "adamw": "adamw_torch", "adam": "adamw_torch",
          "adamw8bit": "adamw_bnb_8bit", "paged-adamw8bit": "paged_adamw_8bit", "paged-adamw": "paged_adamw_32bit",
          "adafactor": "adafactor", "adamw4bit": "adamw_torch_4bit"}
APPLY = "apply it to the model before building the Trainer: memfit.apply_(model, optimizer, [{spec!r}])"


def export(plan, request, kind: str) -> str:
    """Plan `plan` (planner Evaluated) of `request` as the text `kind` asks for."""
    if kind not in EXPORTS:
        raise MemfitError(f"unknown --export {kind!r}; choose {' or '.join(EXPORTS)}.")
    workload = plan.workload(request)
    if kind == "torchrun":
        return torchrun_line(workload.world_size)
    if kind == "deepspeed":
        return json.dumps(deepspeed_config(plan, workload), indent=2)
    return json.dumps(hf_trainer_arguments(plan, workload), indent=2)


def torchrun_line(world_size: int) -> str:
    nodes = -(-world_size // GPUS_PER_NODE)
    per_node = world_size // nodes
    spread = f" --nnodes {nodes} --node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port 29500" \
        if nodes > 1 else ""
    return f"torchrun --nproc-per-node {per_node}{spread} train.py"


def hf_trainer_arguments(plan, workload) -> dict:
    kwargs: dict = {"per_device_train_batch_size": plan.micro_batch, "gradient_accumulation_steps": plan.grad_accum}
    not_expressed: list[dict] = []
    precision = workload.precision
    if precision in ("bf16-mixed", "bf16"):
        kwargs["bf16"] = True
    elif precision in ("fp16-mixed", "fp16"):
        kwargs["fp16"] = True
    if precision in ("bf16", "fp16"):
        not_expressed.append({"setting": f"--precision {precision}", "how": "load the model in that dtype "
                              "(from_pretrained(..., dtype=torch.bfloat16 or torch.float16)): the Trainer's flag "
                              "alone is autocast over float32 weights"})
    optim = _OPTIM.get((workload.optimizer, workload.optimizer_impl)) or _OPTIM.get(workload.optimizer)
    if optim is None:
        not_expressed.append({"setting": f"--optimizer {workload.optimizer}", "how": "pass the optimizer to the "
                              "Trainer (optimizers=(optimizer, scheduler))"})
    else:
        kwargs["optim"] = optim
        if workload.optimizer == "adam":
            kwargs["weight_decay"] = 0.0   # AdamW without decay is Adam
    names = {parse_technique(spec).name for spec in workload.techniques}
    for spec in workload.techniques:
        technique = parse_technique(spec)
        if technique.name == "checkpointing" and technique == type(technique)():   # every block, whole
            if "fsdp2" in names:   # FSDP's own checkpointing (the Trainer's would all-gather once more)
                continue
            kwargs["activation_checkpointing"] = True
            kwargs["activation_checkpointing_kwargs"] = {"use_reentrant": False}
        elif technique.name == "fsdp2":
            kwargs["fsdp"] = True
            kwargs["fsdp_config"] = {"version": 2, "reshard_after_forward": True,
                                     "activation_checkpointing": "checkpointing" in names}
        elif technique.name == "ddp":
            continue   # the Trainer runs DDP itself under torchrun
        else:
            not_expressed.append({"setting": f"-t {spec}", "how": APPLY.format(spec=spec)})
    return {"training_arguments": kwargs, "not_expressed": not_expressed,
            "launch": torchrun_line(workload.world_size) if workload.world_size > 1 else "python train.py"}


def deepspeed_config(plan, workload) -> dict:
    names = {parse_technique(spec).name for spec in workload.techniques}
    stage = workload.zero_stage or (3 if "fsdp2" in names else 0)
    config: dict = {"train_micro_batch_size_per_gpu": plan.micro_batch,
                    "gradient_accumulation_steps": plan.grad_accum,
                    "train_batch_size": plan.micro_batch * plan.grad_accum * workload.world_size,
                    "zero_optimization": {"stage": stage, "reduce_bucket_size": workload.reduce_bucket}}
    not_expressed: list[dict] = []
    precision = workload.precision
    if precision in ("bf16-mixed", "bf16"):
        config["bf16"] = {"enabled": True}
    elif precision in ("fp16-mixed", "fp16"):
        config["fp16"] = {"enabled": True}
    if precision in ("bf16", "fp16"):
        not_expressed.append({"setting": f"--precision {precision}", "how": "DeepSpeed keeps float32 master weights "
                              "and optimizer states beside the half ones: more memory than the plan's pure half"})
    if workload.optimizer in ("adamw", "adam"):
        config["optimizer"] = {"type": "AdamW" if workload.optimizer == "adamw" else "Adam", "params": {"lr": 1e-4}}
    else:
        not_expressed.append({"setting": f"--optimizer {workload.optimizer}", "how": "build it yourself and pass "
                              "it to deepspeed.initialize(optimizer=...)"})
    for spec in workload.techniques:
        name = parse_technique(spec).name
        if name in ("fsdp2", "ddp"):
            continue   # the ZeRO stage above; plain data parallel is DeepSpeed's own
        if name == "cpu-offload" and stage:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        elif name == "checkpointing":
            not_expressed.append({"setting": f"-t {spec}", "how": "enable it in the model "
                                  "(model.gradient_checkpointing_enable() for a transformers model)"})
        else:
            not_expressed.append({"setting": f"-t {spec}", "how": APPLY.format(spec=spec).replace(
                "building the Trainer", "deepspeed.initialize")})
    config["memfit"] = {"not_expressed": not_expressed}
    return config
