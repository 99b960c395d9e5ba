"""A plan in the terms of the tool that runs it: `memfit plan ... --export TOOL`.

  hf-trainer  keyword arguments for transformers' TrainingArguments (micro-batch, accumulation, precision,
              activation checkpointing, optimizer, FSDP2), as JSON.
  deepspeed   a DeepSpeed config (JSON): micro-batch, accumulation, train batch, half precision, ZeRO stage (the
              workload's, 3 for FSDP2's sharding), optimizer offload.
  accelerate  an accelerate config file (YAML, as `accelerate config` writes it): processes and machines, mixed
              precision, FSDP2 or DeepSpeed settings; the micro-batch and accumulation, which accelerate takes in
              the script, in its header.
  lightning   keyword arguments for Lightning's Trainer (devices, nodes, precision, accumulation, strategy) and the
              DataLoader's batch size, as JSON.
  torchrun    the launch line for the plan's GPUs, the script left to the user.

Each technique says what it is in a tool's terms (Technique.export); what a tool cannot say is listed under
`not_expressed` (a comment in YAML) with what to do instead, never dropped.
"""
from __future__ import annotations

import json

from memfit.core.errors import MemfitError
from memfit.planner.cost import GPUS_PER_NODE
from memfit.techniques.base import Export

EXPORTS = ("hf-trainer", "deepspeed", "accelerate", "lightning", "torchrun")
# What a technique exports for the user's script beside any tool's arguments: peft.LoraConfig's keyword arguments,
# transformers' BitsAndBytesConfig's (from_pretrained(..., quantization_config=...))
EXTRAS = ("peft_config", "quantization_config")
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
    if kind == "accelerate":
        return accelerate_config(plan, workload)
    build = {"hf-trainer": hf_trainer_arguments, "deepspeed": deepspeed_config, "lightning": lightning_arguments}
    return json.dumps(build[kind](plan, workload), indent=2)


def num_nodes(world_size: int) -> int:
    return -(-world_size // GPUS_PER_NODE)


def torchrun_line(world_size: int) -> str:
    nodes = num_nodes(world_size)
    spread = (f" --nnodes {nodes} --node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port 29500"
              if nodes > 1 else "")
    return f"torchrun --nproc-per-node {world_size // nodes}{spread} train.py"


def data_parallel(workload) -> int:
    """Copies of the model the batch is split over: the ranks over those one copy is split over (tensor or pipeline
    parallel)."""
    return workload.world_size // max([t.model_ranks(workload.world_size) for t in workload.technique_configs] + [1])


def hf_trainer_arguments(plan, workload) -> dict:
    """TrainingArguments keyword arguments; a DeepSpeed plan's config goes in as `deepspeed` (its batch sizes "auto":
    the Trainer fills them from the arguments), and LoRA as a `peft_config` for peft.LoraConfig."""
    on_deepspeed = workload.engine == "deepspeed"
    kwargs, not_expressed = _from_techniques("hf-trainer", workload, also="deepspeed" if on_deepspeed else None)
    extras = _pop_extras(kwargs)
    kwargs.update(per_device_train_batch_size=plan.micro_batch, gradient_accumulation_steps=plan.grad_accum)
    optim = TRAINER_OPTIM.get((workload.optimizer, workload.optimizer_impl))
    if optim and not on_deepspeed:
        kwargs["optim"] = optim
        if workload.optimizer == "adam":
            kwargs["weight_decay"] = 0.0   # AdamW without decay is Adam
    if "fsdp_config" in kwargs and kwargs.pop("activation_checkpointing", False):
        kwargs.pop("activation_checkpointing_kwargs", None)   # FSDP's own (the Trainer's would all-gather again)
        kwargs["fsdp_config"]["activation_checkpointing"] = True
    if on_deepspeed:
        config = deepspeed_config(plan, workload)
        named = {entry["setting"] for entry in not_expressed}
        not_expressed += [entry for entry in config.pop("memfit")["not_expressed"] if entry["setting"] not in named]
        config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
                      train_batch_size="auto")
        kwargs["deepspeed"] = config
    launch = torchrun_line(workload.world_size) if workload.world_size > 1 else "python train.py"
    return {"training_arguments": kwargs, **extras, "not_expressed": not_expressed, "launch": launch}


def deepspeed_config(plan, workload) -> dict:
    """A DeepSpeed config; a plan whose layout DeepSpeed's engine cannot run (PyTorch's pipeline or tensor
    parallel) is refused with the reason."""
    for technique in workload.technique_configs:
        if technique.deepspeed_conflict and technique.export("deepspeed", workload) is None:
            reason, _ = technique.deepspeed_conflict
            raise MemfitError(f"--export deepspeed: DeepSpeed's engine cannot run {technique.spec} ({reason}); "
                              f"export it for torchrun, or plan with --exclude {technique.name}.")
    config, not_expressed = _from_techniques("deepspeed", workload)
    extras = _pop_extras(config)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = max(zero.get("stage", 0), workload.zero_stage)
    zero["reduce_bucket_size"] = workload.reduce_bucket
    config.update(train_micro_batch_size_per_gpu=plan.micro_batch, gradient_accumulation_steps=plan.grad_accum,
                  train_batch_size=plan.micro_batch * plan.grad_accum * data_parallel(workload))
    if workload.optimizer in ("adamw", "adam"):
        config["optimizer"] = {"type": "AdamW" if workload.optimizer == "adamw" else "Adam", "params": {"lr": 1e-4}}
    config["memfit"] = {**extras, "not_expressed": not_expressed}   # DeepSpeed ignores a key it does not know
    return config


def accelerate_config(plan, workload) -> str:
    import yaml  # a requirement of transformers

    settings, not_expressed = _from_techniques("accelerate", workload)
    extras = _pop_extras(settings)
    _with_engine("accelerate", workload, settings, not_expressed)
    world = workload.world_size
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU" if world > 1 else "NO",
              "mixed_precision": "no", "num_machines": num_nodes(world), "num_processes": world, "machine_rank": 0,
              "main_training_function": "main", "use_cpu": False, "gpu_ids": "all", "rdzv_backend": "static",
              "same_network": True, **settings}
    if "deepspeed_config" in config:
        config["deepspeed_config"]["gradient_accumulation_steps"] = plan.grad_accum
    header = [f"# memfit plan: {plan.micro_batch} sequences per GPU per micro-step (your DataLoader's batch_size), "
              f"gradient accumulation {plan.grad_accum} (Accelerator(gradient_accumulation_steps={plan.grad_accum}))",
              "# run: accelerate launch --config_file THIS_FILE train.py"]
    header += [f"# {key} (in your script): {json.dumps(value)}" for key, value in extras.items()]
    header += [f"# not expressed: {entry['setting']}: {entry['how']}" for entry in not_expressed]
    return "\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False)


def lightning_arguments(plan, workload) -> dict:
    settings, not_expressed = _from_techniques("lightning", workload)
    extras = _pop_extras(settings)
    _with_engine("lightning", workload, settings, not_expressed)
    nodes = num_nodes(workload.world_size)
    kwargs = {"accelerator": "gpu", "devices": workload.world_size // nodes, "num_nodes": nodes,
              "accumulate_grad_batches": plan.grad_accum, **settings}
    return {"trainer_arguments": kwargs, "batch_size": plan.micro_batch, **extras, "not_expressed": not_expressed}


def _with_engine(tool: str, workload, settings: dict, not_expressed: list[dict]) -> None:
    """The workload's own settings that are not techniques: DeepSpeed's engine and its ZeRO stage (with its
    precision, which a DeepSpeed workload's techniques do not carry), and ZeRO-1 over DDP."""
    if workload.engine == "deepspeed":
        _merge(settings, {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": workload.zero_stage}}
               if tool == "accelerate" else {"strategy": f"deepspeed_stage_{workload.zero_stage}"})
    elif workload.zero_stage == 1:
        not_expressed.append({"setting": "--zero 1", "how": "wrap the optimizer in torch.distributed.optim."
                                                            "ZeroRedundancyOptimizer in your training script"})


def _from_techniques(tool: str, workload, also: str | None = None) -> tuple[dict, list[dict]]:
    """The settings every technique of `workload` (its precision and optimizer included) gives `tool`, merged, and
    what it cannot say (unless the `also` tool's part of the export says it: a Trainer's DeepSpeed config)."""
    settings: dict = {}
    not_expressed: list[dict] = []
    for technique in workload.hooked_techniques:
        exported = technique.export(tool, workload)
        if exported is None and also is not None and technique.export(also, workload) is not None:
            continue
        if exported is None:
            exported = Export({}, APPLY.format(spec=technique.spec))
        _merge(settings, exported.settings)
        if exported.how:
            not_expressed.append({"setting": technique.spec, "how": exported.how})
    return settings, not_expressed


def _pop_extras(settings: dict) -> dict:
    """The entries a technique gives for the user's script rather than the tool's arguments (EXTRAS), taken out."""
    return {key: settings.pop(key) for key in EXTRAS if key in settings}


def _merge(into: dict, more: dict) -> None:
    """Nested dictionaries merged; of two ZeRO stages, the higher; of two Lightning strategies where one extends the
    other ("fsdp", "fsdp_cpu_offload"), the longer."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif key in ("stage", "zero_stage") and key in into:
            into[key] = max(into[key], value)
        elif key == "strategy" and key in into:
            into[key] = max(into[key], value, key=len)
        else:
            into[key] = value
