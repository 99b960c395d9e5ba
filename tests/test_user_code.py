"""The user's own code: model factories named as a file or a module in the current folder, and the user's own step
(`--step`), traced and measured as it runs. Each test writes its code into a folder of its own, as a user would."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import memfit
from memfit.core.errors import MemfitError
from memfit.estimators import estimate, methods_for
from memfit.estimators.sdpa_backend import EFFICIENT, FLASH, MATH, cuda_backend
from memfit.measurement import measure
from memfit.specs.hardware import get_gpu
from memfit.specs.model_source import resolve_source
from memfit.specs.user_code import import_callable
from memfit.techniques.adapters import all_linear_but_head
from memfit.techniques.resolve import ResolvedWorkload

DECODER = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


class Decoder(nn.Module):
    """Two layers of attention (a static KV cache when generating) and an MLP, an LM head."""

    def __init__(self, vocab=512, dim=64, heads=4, layers=2):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                 for _ in range(layers))
        self.out = nn.Linear(dim, vocab)
        self.cache = None

    def forward(self, ids, pos=None):
        b, s = ids.shape
        x = self.emb(ids)
        for i, (qkv, mlp) in enumerate(zip(self.qkv, self.mlp)):
            q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            if self.cache is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                keys, values, mask = self.cache[i][0], self.cache[i][1], self.mask[None, None, pos]
                keys[:, :, pos], values[:, :, pos] = k, v
                y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            x = x + y.transpose(1, 2).reshape(b, s, self.dim)
            x = x + mlp(x)
        return self.out(x)


def build():
    return Decoder()


def deep():
    return Decoder(layers=8)


class Stacked(nn.Module):
    """Eight residual MLP blocks in one list."""

    def __init__(self, vocab=512, dim=64, layers=8):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                  nn.Linear(4 * dim, dim)) for _ in range(layers))

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def stacked():
    return Stacked()


def tied():
    """The LM head shares the embedding's weight."""
    model = Decoder()
    model.out.bias = None
    model.out.weight = model.emb.weight
    return model


class SquaredReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.relu(x) ** 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * torch.relu(x)


class Handmade(nn.Module):
    """RMSNorm written out, eager attention through a boolean masked_fill, a custom autograd Function."""

    def __init__(self, vocab=512, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.emb, self.qkv, self.o = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm = nn.Parameter(torch.ones(dim))
        self.up, self.down, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        b, s, d = x.shape
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        x = x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d))
        return self.out(x + self.down(SquaredReLU.apply(self.up(x))))


def handmade_large_vocab():
    return Handmade(vocab=4096)


def tokens(batch_size, seq_len):
    return torch.randint(0, 512, (batch_size, seq_len))


def keep_logits(model, batch, optimizer):
    """A hand-written step: its own loss, the logits alive through backward."""
    logits = model(batch)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return logits


def accumulate(model, batch, optimizer):
    """Two micro-batches, gradients accumulated, then one optimizer step."""
    for half in batch.chunk(2):
        model(half).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def own_autocast(model, batch, optimizer):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch).float().mean()
    loss.backward()
    optimizer.step()


@torch.no_grad()
def generate(model, prompt, optimizer, backends=(SDPBackend.MATH,)):
    """A static cache of 512 tokens, a dense boolean causal mask, decode steps on the math kernel."""
    b, s = prompt.shape
    dtype = model.out.weight.dtype
    model.cache = [(torch.zeros(b, model.heads, 512, model.dim // model.heads, dtype=dtype),
                    torch.zeros(b, model.heads, 512, model.dim // model.heads, dtype=dtype)) for _ in model.qkv]
    model.mask = torch.tril(torch.ones(512, 512, dtype=torch.bool))
    token = model(prompt, torch.arange(s))[:, -1:].argmax(-1)
    for step in range(4):
        with sdpa_kernel(list(backends)):
            token = model(token, torch.tensor([s + step]))[:, -1:].argmax(-1)


def generate_any_kernel(model, prompt, optimizer):
    generate(model, prompt, optimizer, backends=(SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                  SDPBackend.MATH))


def selected(model, batch, optimizer):
    logits = model(batch)
    keep = (batch > 100).nonzero()
    logits[keep[:, 0], keep[:, 1]].mean().backward()
'''


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    (tmp_path / "userdec.py").write_text(textwrap.dedent(DECODER))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _workload(step=None, **kw):
    return ResolvedWorkload(model="./userdec.py:build", inputs="./userdec.py:tokens", step=step, **kw)


def test_a_module_in_the_current_folder_or_a_file_path_names_a_model(user_folder):
    assert resolve_source("userdec:build", "userdec:tokens").kind == "factory"
    source = resolve_source("./userdec.py:build", "userdec.py:tokens")
    assert type(source.build(device="meta", dtype=None)).__name__ == "Decoder"
    with pytest.raises(MemfitError, match="no module 'nosuchmod' installed or in the current folder"):
        resolve_source("nosuchmod:build", "nosuchmod:tokens")
    with pytest.raises(MemfitError, match=r"no file '\./missing\.py'"):
        resolve_source("./missing.py:build", "./missing.py:tokens")
    with pytest.raises(MemfitError, match="has no callable 'nothing'"):
        resolve_source("./userdec.py:nothing", "./userdec.py:tokens")


def test_a_users_step_is_traced_as_it_runs(user_folder):
    """The logits kept alive through backward cost what the measured run shows; memfit's own step drops them."""
    own = _workload(step="./userdec.py:keep_logits", batch_size=8, seq_len=256)
    assert methods_for(own) == ("traced",)
    measured = measure(own, estimates=("traced",))
    assert abs(measured.extra["ratios"]["measured/traced"] - 1) < 0.02
    builtin = measure(_workload(batch_size=8, seq_len=256), estimates=())
    assert measured.peak_bytes > 1.1 * builtin.peak_bytes
    with pytest.raises(MemfitError, match="analytic model knows memfit's own step"):
        estimate(own, method="analytic")


def test_a_users_generation_loop_on_a_gpu_target(user_folder):
    """Static cache, dense mask, decode forced onto the math kernel: traced within 2 % of the CPU run, and on a GPU
    target the decode steps take the math kernel the loop asks for."""
    generate = _workload(step="./userdec.py:generate", task="inference", batch_size=2, seq_len=16)
    measured = measure(generate, estimates=("traced",))
    assert abs(measured.extra["ratios"]["measured/traced"] - 1) < 0.02
    assert measured.peak_bytes > 512 * 512   # the dense mask is there
    a100 = get_gpu("a100-80gb")
    forced, free = (estimate(_workload(step=f"./userdec.py:{fn}", task="inference", batch_size=2, seq_len=16,
                                       precision="bf16"), method="traced", gpu=a100)
                    for fn in ("generate", "generate_any_kernel"))
    upcasts = 2 * 2 * 4 * 512 * 16 * 4   # at least float32 keys and scaled keys over the whole cache (bf16 inputs)
    assert forced.peak_bytes - free.peak_bytes >= upcasts


def test_a_step_that_accumulates_gradients_inside(user_folder):
    measured = measure(_workload(step="./userdec.py:accumulate", batch_size=8, seq_len=256), estimates=("traced",))
    assert abs(measured.extra["ratios"]["measured/traced"] - 1) < 0.02
    whole = measure(_workload(batch_size=8, seq_len=256), estimates=())
    assert measured.peak_bytes < whole.peak_bytes   # half the activations at a time


def test_a_7b_model_on_the_meta_device_estimates_in_little_memory():
    code = ("import re, torch, memfit, transformers; from memfit.specs.model_source import resolve_source;"
            "cfg = resolve_source('llama-2-7b').config();"
            "ctx = torch.device('meta');\nwith ctx: model = transformers.LlamaForCausalLM(cfg)\n"
            "batch = {'input_ids': torch.zeros(1, 512, dtype=torch.long, device='meta')};"
            "e = memfit.estimate(model, batch, optimizer='adamw', precision='bf16');"
            "print(e.peak_bytes, re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 4 * 6.7e9          # bf16 weights, gradients and two AdamW states of 6.7B parameters ...
    assert int(out[1]) * 1024 < 2 * 2**30   # ... estimated in under 2 GiB of resident memory


def test_the_estimate_says_whether_memfit_wrapped_the_step_in_autocast(user_folder):
    notes = {step: estimate(_workload(step=f"./userdec.py:{step}", batch_size=2, seq_len=32, precision="bf16-mixed"),
                            method="traced").notes for step in ("own_autocast", "keep_logits")}
    assert "your step enters autocast itself: memfit's bf16-mixed autocast does not wrap it" in notes["own_autocast"]
    assert "your step runs inside memfit's bf16-mixed autocast" in notes["keep_logits"]


def test_a_tied_weight_is_one_parameter_in_a_trace(user_folder):
    """Its gradient and Adam states are counted once, as the real run holds them."""
    tied = ResolvedWorkload(model="./userdec.py:tied", inputs="./userdec.py:tokens", batch_size=2, seq_len=64)
    measured = measure(tied, estimates=("traced",))
    assert abs(measured.extra["ratios"]["measured/traced"] - 1) < 0.001
    untied = measure(_workload(batch_size=2, seq_len=64), estimates=())
    assert untied.at_peak["parameters"] - measured.at_peak["parameters"] >= 512 * 64 * 4


def test_a_handwritten_decoder_in_bf16_mixed_is_traced_as_it_runs(user_folder):
    """The peak is memfit's loss for a custom module, the mean of the bf16 logits, which the CPU computes over a
    float32 copy of them (estimators/kernel_probe.py)."""
    handmade = ResolvedWorkload(model="./userdec.py:handmade_large_vocab", inputs="./userdec.py:tokens",
                                batch_size=4, seq_len=256, precision="bf16-mixed")
    measured = measure(handmade, estimates=("traced",))
    assert measured.peak_phase == "forward"
    assert abs(measured.extra["ratios"]["measured/traced"] - 1) < 0.02


def test_lora_on_a_custom_model_adapts_every_linear_but_the_head(user_folder):
    decoder, tied = _user("build")(), _user("tied")()
    assert all_linear_but_head(decoder) == ["qkv.0", "qkv.1", "mlp.0.0", "mlp.0.2", "mlp.1.0", "mlp.1.2"]
    assert all_linear_but_head(tied) == all_linear_but_head(decoder)   # the head tied to the embedding
    measured = measure(_workload(batch_size=2, seq_len=64, techniques=("lora",)), estimates=("traced",))
    assert abs(measured.extra["ratios"]["measured/traced"] - 1) < 0.02
    adapters = 16 * sum(i + o for i, o in ((64, 192), (64, 192), (64, 256), (256, 64), (64, 256), (256, 64)))
    states = measured.at_peak["optimizer_states"]   # AdamW's m and v of the adapters only, and a step count each
    assert 2 * 4 * adapters <= states <= 2 * 4 * adapters + 12 * 8


def test_what_cannot_run_with_a_users_step_is_refused(user_folder):
    with pytest.raises(MemfitError, match="chunked-ce cannot apply to your --step"):
        ResolvedWorkload(model="tiny-llama", step="./userdec.py:keep_logits", techniques=("chunked-ce",))
    with pytest.raises(MemfitError, match="--step 'userdec' must look like"):
        ResolvedWorkload(model="tiny-llama", step="userdec")
    with pytest.raises(MemfitError, match=r"userdec.py:\d+ \(keep = \(batch > 100\).nonzero\(\)\).*fake tensors"):
        estimate(_workload(step="./userdec.py:selected", batch_size=2, seq_len=16), method="traced")


def test_sdpa_kernel_narrows_the_backends_a_gpu_would_try():
    args = dict(mask=False, causal_unequal=False, needs_grad=False)
    assert cuda_backend((8, 0), "bfloat16", 128, **args) == FLASH
    assert cuda_backend((8, 0), "bfloat16", 128, **args, enabled=frozenset({EFFICIENT, MATH})) == EFFICIENT
    assert cuda_backend((8, 0), "bfloat16", 128, **args, enabled=frozenset({MATH})) == MATH
    with pytest.raises(MemfitError, match="no enabled backend"):
        cuda_backend((7, 5), "bfloat16", 128, **args, enabled=frozenset({FLASH}))


def _user(name):
    return import_callable(f"./userdec.py:{name}", "test")


def test_a_live_model_is_estimated_on_a_meta_copy(user_folder):
    """memfit.estimate(model, batch): the figures of the same model named by its factory, and the live model, its
    gradients and the optimizer are left as they were."""
    model, batch = _user("build")(), _user("tokens")(8, 256)
    before = {name: (p.data_ptr(), p.requires_grad) for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    live = memfit.estimate(model, batch, optimizer=optimizer, step=_user("keep_logits"), gpu="a100-80gb")
    named = estimate(_workload(step="./userdec.py:keep_logits", batch_size=8, seq_len=256, optimizer_impl="fused"),
                     method="traced", gpu=get_gpu("a100-80gb"))
    assert live.peak_bytes == named.peak_bytes and live.reserved_bytes == named.reserved_bytes
    assert live.workload["optimizer_impl"] == "fused" and live.workload["batch_size"] == 8
    assert {name: (p.data_ptr(), p.requires_grad) for name, p in model.named_parameters()} == before
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state
    assert memfit.estimate(_user("build")(), batch, optimizer="adamw").peak_bytes > 0   # a model made in the call
    with torch.device("meta"):
        on_meta = _user("build")()
    assert memfit.estimate(on_meta, batch.to("meta"), step=_user("keep_logits"), optimizer=optimizer,
                           gpu="a100-80gb").peak_bytes == live.peak_bytes


def test_what_a_live_model_cannot_do_is_said(user_folder):
    model, batch = _user("build")(), _user("tokens")(2, 16)
    with pytest.raises(MemfitError, match="this SGD has no momentum"):
        memfit.estimate(model, batch, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(MemfitError, match="a live model is only estimated"):
        measure(memfit.Workload(**memfit.estimate(model, batch).workload))
    with pytest.raises(MemfitError, match=r"the batch holds an empty tensor \(shape \(2, 0\)\)"):
        memfit.estimate(model, batch[:, :0])
    with pytest.raises(MemfitError, match="a Workload carries its batch shape"):
        memfit.estimate(_workload(batch_size=2, seq_len=16), batch)
    with pytest.raises(MemfitError, match=r"unknown keyword argument\(s\) inputs.*memfit.estimate\(model, batch\)"):
        memfit.estimate(model, inputs=lambda: batch)   # the Workload's inputs= is a factory's name, not a batch
    with pytest.raises(MemfitError, match="never runs a live model or optimizer"):
        measure(model, batch)
    with pytest.raises(MemfitError, match=r"has none \(no `model.config`\)"):
        memfit.plan(model, batch, gpu="rtx-4090")


def test_a_live_transformers_model_is_planned_from_its_config():
    """memfit.plan(model, batch, gpu=...): the model's own config, the batch's shape; the same plans as its
    config.json named on the command line."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.specs.model_source import catalog

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**catalog()["tiny-llama"]["hf_config"]))
    live = memfit.plan(model, torch.zeros(8, 128, dtype=torch.long, device="meta"), gpu="rtx-4090", top=2)
    named = memfit.plan(memfit.PlanRequest(model="tiny-llama", gpu=get_gpu("rtx-4090"), seq_len=128, global_batch=8,
                                           top=2))
    assert [p["techniques"] for p in live.to_json()["plans"]] == [p["techniques"] for p in named.to_json()["plans"]]
    assert [p["peak_bytes"] for p in live.to_json()["plans"]] == [p["peak_bytes"] for p in named.to_json()["plans"]]
    with pytest.raises(MemfitError, match="a PlanRequest carries its GPU"):
        memfit.plan(memfit.PlanRequest(model="tiny-llama", gpu=get_gpu("rtx-4090")), gpu="rtx-4090")


def test_a_custom_model_is_planned_with_the_traced_estimator(user_folder, capsys):
    """`memfit plan ./userdec.py:build --inputs ...`: every configuration sized by traces (cut to the model's first
    blocks and extrapolated in depth, as for a transformer config), the step timed from the FLOPs PyTorch's counter
    counts on a fake forward; plan 1's figures are the traced estimate of its own workload."""
    from memfit.cli.main import main
    from memfit.estimators.kernels import forward_flops_per_token
    from memfit.planner.search import device_bytes
    from memfit.techniques.resolve import ResolvedWorkload as Resolved

    code = main(["plan", "./userdec.py:build", "--inputs", "./userdec.py:tokens", "--gpu", "t4", "--seq-len", "64",
                 "--global-batch", "1", "--top", "1", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["feasible"] and data["search"]["estimator"] == "traced"
    best = data["plans"][0]
    assert best["sources"]["memory"] == "traced" and best["time_parts_s"]["compute"] > 0
    again = estimate(Resolved.from_json(best["workload"]), method="traced", gpu="t4")
    assert device_bytes(again) == best["peak_bytes"]
    # `memfit estimate --gpu` of plan 1's workload times it as the plan did
    saved = user_folder / "plan.json"
    saved.write_text(json.dumps(data))
    code = main(["estimate", "--plan", str(saved), "--json"])
    timed = json.loads(capsys.readouterr().out)
    assert code == 0 and timed["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-4)
    linear_weights = sum(p.numel() for n, p in torch.nn.Module.named_parameters(
        resolve_source("./userdec.py:build", "./userdec.py:tokens").build(device="meta", dtype=torch.float32))
        if n.endswith("weight") and p.dim() == 2 and not n.startswith("emb"))
    counted = forward_flops_per_token(_workload(batch_size=1, seq_len=64))
    assert 2 * linear_weights <= counted < 2 * linear_weights * 1.5   # the matmuls, and attention's on 64 tokens


def test_a_custom_model_cut_to_its_first_blocks_is_traced_as_the_whole(user_folder):
    """A custom module's repeated blocks are traced at 2, 3 and 4 of them and extrapolated, as a transformer's: the
    full trace's figures. Blocks kept in parallel lists (qkv[i], mlp[i]) are cut together; their trace does not
    step block by block, the check says so, and the whole model is traced instead."""
    from memfit.specs.model_source import block_stacks

    for factory, parallel in (("stacked", False), ("deep", True)):
        workload = ResolvedWorkload(model=f"./userdec.py:{factory}", inputs="./userdec.py:tokens", batch_size=2,
                                    seq_len=64)
        depth, stacks = block_stacks(workload.source.build(device="meta", dtype=torch.float32))
        assert depth == 8 and len(stacks) == (2 if parallel else 1)
        short, full = estimate(workload, method="traced"), estimate(workload, method="traced", full_trace=True)
        assert any(("extrapolation check failed" if parallel else "extrapolated") in n for n in short.notes)
        assert (short.peak_bytes, short.at_peak) == (full.peak_bytes, full.at_peak)


def test_a_precision_technique_decides_a_live_models_precision(user_folder):
    """A live model's precision is its weights' unless a precision technique is asked for: a bf16 model estimated
    with bf16-master (which keeps bf16 weights) or bf16-mixed is estimated so, not refused as disagreeing with the
    weights' bf16."""
    model, batch = _user("build")().to(torch.bfloat16), _user("tokens")(2, 16)
    assert memfit.estimate(model, batch).workload["precision"] == "bf16"
    for precision in ("bf16-master", "bf16-mixed"):
        assert memfit.estimate(model, batch, techniques=[precision]).workload["precision"] == precision
