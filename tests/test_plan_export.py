"""memfit plan --export: each framework's own code accepts what a plan exports (and names what it cannot say)."""
import json
from types import SimpleNamespace

import pytest

from memfit.cli.main import main
from memfit.planner.export import accelerate_config, deepspeed_config, hf_trainer_arguments, lightning_arguments
from memfit.techniques.resolve import ResolvedWorkload


def test_a_plan_exported_for_the_trainer_and_torchrun_is_accepted_by_them(tmp_path, capsys):
    """TrainingArguments takes the keyword arguments (use_cpu=True added: this machine has no GPU), and torchrun's
    own parser takes the launch line."""
    from torch.distributed.run import get_args_parser
    from transformers import TrainingArguments

    assert main(["plan", "tiny-llama", "--gpu", "rtx-4090", "--seq-len", "256", "--global-batch", "64",
                 "--export", "hf-trainer", "--out", str(tmp_path / "args.json")]) == 0
    exported = json.loads((tmp_path / "args.json").read_text())
    arguments = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **exported["training_arguments"])
    assert arguments.per_device_train_batch_size * arguments.gradient_accumulation_steps == 64
    assert all(entry["setting"] and entry["how"] for entry in exported["not_expressed"])
    sharded = ResolvedWorkload(model="tiny-llama", batch_size=4, seq_len=128, precision="bf16-mixed", world_size=16,
                               techniques=("fsdp2", "checkpointing", "lora"))
    out = hf_trainer_arguments(SimpleNamespace(micro_batch=4, grad_accum=2), sharded)
    assert out["training_arguments"]["fsdp_config"]["activation_checkpointing"] is True
    assert [n["setting"] for n in out["not_expressed"]] == ["lora"]   # named, not dropped
    TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **out["training_arguments"])
    launch = get_args_parser().parse_args(out["launch"].replace("$NODE_RANK", "1").replace("$MASTER_ADDR", "h0")
                                          .split()[1:])
    assert (launch.nnodes, launch.nproc_per_node, launch.node_rank) == ("2", "8", 1)


def test_a_plan_exported_for_deepspeed_passes_its_config_validation(monkeypatch):
    """DeepSpeed's own config class, told the plan's data-parallel world size through a model-parallel unit (this
    test is one process, so deepspeed.comm's rank is stubbed to 0)."""
    import deepspeed.runtime.config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)

    sharded = ResolvedWorkload(model="tiny-llama", batch_size=4, seq_len=128, precision="bf16-mixed", world_size=4,
                               techniques=("fsdp2", "cpu-offload", "checkpointing"))
    config = deepspeed_config(SimpleNamespace(micro_batch=4, grad_accum=2), sharded)
    checked = ds_config.DeepSpeedConfig(config, mpu=SimpleNamespace(get_data_parallel_world_size=lambda: 4))
    assert (checked.zero_optimization_stage, checked.train_batch_size) == (3, 32)
    assert checked.zero_config.offload_optimizer.device == "cpu"
    assert [n["setting"] for n in config["memfit"]["not_expressed"]] == ["checkpointing"]


def test_a_plan_exported_for_accelerate_is_read_by_its_config_loader(tmp_path):
    """accelerate's own loader reads the YAML: FSDP2 over two nodes (offload and checkpointing in its fsdp_config),
    and ZeRO-Offload through DeepSpeed on one GPU; what it cannot say is a comment, not dropped."""
    from accelerate.commands.config.config_args import load_config_from_file

    plan = SimpleNamespace(micro_batch=4, grad_accum=2)
    sharded = ResolvedWorkload(model="tiny-llama", batch_size=4, seq_len=128, precision="bf16-mixed", world_size=16,
                               techniques=("fsdp2", "cpu-offload", "checkpointing", "lora"))
    offloaded = ResolvedWorkload(model="tiny-llama", batch_size=4, seq_len=128, precision="bf16-mixed",
                                 techniques=("cpu-offload",))
    loaded = []
    for name, workload in (("sharded", sharded), ("offloaded", offloaded)):
        text = accelerate_config(plan, workload)
        (tmp_path / f"{name}.yaml").write_text(text)
        loaded.append((text, load_config_from_file(str(tmp_path / f"{name}.yaml"))))
    (text, fsdp), (_, deepspeed) = loaded
    assert (fsdp.distributed_type, fsdp.num_processes, fsdp.num_machines, fsdp.mixed_precision) == ("FSDP", 16, 2,
                                                                                                     "bf16")
    assert fsdp.fsdp_config == {"fsdp_version": 2, "fsdp_reshard_after_forward": True,
                                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_offload_params": True,
                                "fsdp_activation_checkpointing": True}
    assert "# not expressed: lora: wrap the model: peft.get_peft_model" in text and "gradient accumulation 2" in text
    assert '# peft_config (in your script): {"r": 16, "lora_alpha": 32' in text
    assert deepspeed.distributed_type == "DEEPSPEED" and deepspeed.num_processes == 1
    assert deepspeed.deepspeed_config == {"zero_stage": 1, "offload_optimizer_device": "cpu",
                                          "gradient_accumulation_steps": 2}


def test_a_plan_exported_for_lightning_builds_its_trainer():
    """Lightning's Trainer takes the arguments; the plan's accelerator ("gpu") is overridden to "cpu" here, as this
    machine has no GPU (the devices, strategy, precision and accumulation are the plan's)."""
    L = pytest.importorskip("lightning.pytorch")

    plan = SimpleNamespace(micro_batch=4, grad_accum=8)
    workload = ResolvedWorkload(model="tiny-llama", batch_size=4, seq_len=128, precision="bf16", world_size=2,
                                techniques=("ddp", "checkpointing", "adamw8bit"))
    out = lightning_arguments(plan, workload)
    assert out["trainer_arguments"]["accelerator"] == "gpu" and out["batch_size"] == 4
    trainer = L.Trainer(**{**out["trainer_arguments"], "accelerator": "cpu"}, logger=False)
    assert (trainer.num_devices, trainer.accumulate_grad_batches, trainer.precision) == (2, 8, "bf16-true")
    assert type(trainer.strategy).__name__ == "DDPStrategy"
    assert [n["setting"] for n in out["not_expressed"]] == ["adamw8bit", "checkpointing"]


def test_the_demo_plan_exports_its_precision_and_deepspeed_config(tmp_path, capsys, monkeypatch):
    """The demo's plan (bf16-mixed + DeepSpeed ZeRO-3 + NVMe offload): the Trainer's arguments carry bf16 and the
    DeepSpeed config, which TrainingArguments loads; the DeepSpeed config enables bf16 and passes DeepSpeed's own
    validation with the plan's batch."""
    import deepspeed.runtime.config as ds_config
    from transformers import TrainingArguments

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)
    demo = ["plan", "llama-3.1-8b", "--task", "train", "--seq-len", "4096", "--global-batch", "64", "--instance",
            "rtx-4090-workstation", "--export"]
    assert main([*demo, "hf-trainer", "--out", str(tmp_path / "args.json")]) == 0
    exported = json.loads((tmp_path / "args.json").read_text())
    kwargs = exported["training_arguments"]
    assert kwargs["bf16"] is True and kwargs["deepspeed"]["zero_optimization"]["stage"] == 3
    arguments = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    filled = arguments.hf_deepspeed_config.config
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"]) == (1, 64)
    assert filled["zero_optimization"]["offload_param"]["device"] == "nvme" and arguments.bf16
    assert {entry["setting"] for entry in exported["not_expressed"]} == {"checkpointing:mode=offload", "nvme-offload"}
    capsys.readouterr()
    assert main([*demo, "deepspeed"]) == 0
    config = json.loads(capsys.readouterr().out)
    checked = ds_config.DeepSpeedConfig(config, mpu=SimpleNamespace(get_data_parallel_world_size=lambda: 1))
    assert checked.bfloat16_config.enabled and checked.zero_optimization_stage == 3 and checked.train_batch_size == 64


def test_lora_and_qlora_export_the_configs_peft_and_transformers_load():
    """LoRA's rank, alpha and targets as peft.LoraConfig keyword arguments; QLoRA's 4-bit base as transformers'
    BitsAndBytesConfig."""
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    plan = SimpleNamespace(micro_batch=2, grad_accum=4)
    lora = ResolvedWorkload(model="tiny-llama", batch_size=2, seq_len=64, precision="bf16-mixed",
                            techniques=("lora:rank=8,alpha=32,targets=q_proj|k_proj",))
    out = hf_trainer_arguments(plan, lora)
    config = LoraConfig(**out["peft_config"])
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (8, 32, {"q_proj", "k_proj"})
    assert out["training_arguments"]["bf16"] is True and "peft_config" not in out["training_arguments"]
    qlora = ResolvedWorkload(model="tiny-llama", batch_size=2, seq_len=64, precision="bf16-mixed",
                             techniques=("qlora",))
    out = lightning_arguments(plan, qlora)
    quantization = BitsAndBytesConfig(**out["quantization_config"])
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "nf4"
    assert str(quantization.bnb_4bit_compute_dtype) == "torch.bfloat16" and LoraConfig(**out["peft_config"]).r == 16


def test_a_plan_deepspeed_cannot_run_is_refused_not_exported():
    """PyTorch's pipeline parallel over 8 GPUs: DeepSpeed's engine cannot run it, so --export deepspeed says so
    (it used to write a ZeRO-0 config whose batch DeepSpeed rejects); its data-parallel size sets the batch."""
    from memfit.core.errors import MemfitError
    from memfit.planner.export import data_parallel

    piped = ResolvedWorkload(model="llama-3.1-70b", batch_size=8, seq_len=1024, precision="bf16-mixed",
                             world_size=8, techniques=("pipeline-parallel:microbatches=8",))
    assert data_parallel(piped) == 1
    with pytest.raises(MemfitError, match="DeepSpeed's engine cannot run pipeline-parallel"):
        deepspeed_config(SimpleNamespace(micro_batch=8, grad_accum=4), piped)
