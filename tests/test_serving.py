"""The serving estimate (memfit.serving): the engine's view of the model from its config alone, its KV cache's
blocks and tokens, its refusals, and the command that prints them, without torch."""
import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memfit.cli.main import main
from memfit.core.errors import MemfitError
from memfit.core.units import GiB
from memfit.core.weight_formats import FP8_BLOCK
from memfit.serving import kv_cache
from memfit.serving.checkpoints import checkpoint_of, weights_bytes
from memfit.serving.estimate import estimate_serving
from memfit.serving.served_model import INVENTORIES, served_model
from memfit.serving.settings import ServeSettings
from memfit.specs.hardware import get_gpu
from memfit.specs.model_configs import catalog, find_config
from memfit.specs.model_source import resolve_source

ROOT = Path(__file__).resolve().parent.parent
JSON_KEYS = ("weights_bytes", "activation_bytes", "non_torch_bytes", "cuda_graph_bytes", "budget_bytes",
             "kv_cache_bytes", "kv_blocks", "kv_cache_tokens", "max_concurrency", "max_model_len_fits", "starts",
             "refusal", "sources")


def model(name: str):
    return served_model(find_config(name))


def serve(name: str, gpu: str = "h100", memory_gib: float | None = None, **settings):
    target = get_gpu(gpu)
    if memory_gib is not None:
        target = target.with_memory(round(memory_gib * GiB))
    return estimate_serving(model(name), target, ServeSettings(**settings))


@pytest.mark.parametrize("name", [n for n, d in catalog().items() if d["hf_config"]["model_type"] in INVENTORIES])
def test_the_inventory_has_the_parameters_transformers_builds(name):
    """Every weight the engine loads, read from the config: as many as transformers builds from it."""
    built = resolve_source(name).build(device="meta", dtype=torch.float32)
    assert sum(w.numel for w in model(name).weights) == sum(p.numel() for p in built.parameters())


def test_per_token_kv_bytes_for_each_attention_kind():
    llama = model("llama-3.1-8b")   # GQA: 8 KV heads of 128, 32 layers
    assert kv_cache.layout(llama, 1, "bfloat16", 16).token_bytes == 2 * 8 * 128 * 2 * 32
    assert kv_cache.layout(llama, 16, "bfloat16", 16).token_bytes == 2 * 1 * 128 * 2 * 32   # heads replicated
    assert kv_cache.layout(llama, 1, "float8_e4m3fn", 16).token_bytes == 2 * 8 * 128 * 32
    deepseek = model("deepseek-v3")   # MLA: one latent of 512 + 64, not split by tensor parallel
    assert kv_cache.layout(deepseek, 8, "bfloat16", 64).token_bytes == (512 + 64) * 2 * 61
    gemma = kv_cache.layout(model("gemma-3-12b"), 1, "bfloat16", 16)   # 40 sliding (1024) + 8 full layers: groups of 8
    assert gemma.tensors == 8 and len(gemma.groups) == 6
    assert sum(g.window is None for g in gemma.groups) == 1
    # a request at 32768 tokens: the full group's 2048 blocks, each sliding group its window's reach plus one
    assert gemma.request_blocks(32768, 2048) == 2048 + 5 * (-(-(1023 + 2048) // 16) + 1)
    oss = kv_cache.layout(model("gpt-oss-20b"), 1, "bfloat16", 16)   # 12 + 12: two groups of 12
    assert oss.tensors == 12 and len(oss.groups) == 2


def test_blocks_tokens_and_concurrency_of_a_given_cache():
    """Qwen2.5-7B, 57,344 bytes a token: v-v100-qwen7b-eager logs 245,360 tokens and 7.49x at 32,768."""
    given = 245_360 * 57_344
    e = serve("qwen2.5-7b", "v100-32gb", engine_version="0.18.0", max_model_len=32768, kv_cache_memory=given)
    assert (e.kv_blocks, e.kv_cache_tokens, e.max_concurrency) == (15_335, 245_360, 7.49)
    newer = serve("qwen2.5-7b", "v100-32gb", max_model_len=32768, kv_cache_memory=given)   # 2026: concurrency x L
    assert newer.kv_cache_tokens == int(15_335 / 2048 * 32768)


def test_quantized_weights_as_the_engine_stores_them():
    w8a8 = dataclasses.replace(model("llama-3.1-70b"), quantization={
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}})
    stored = weights_bytes(w8a8, checkpoint_of(w8a8, None, (9, 0)), "bfloat16", 1)
    assert stored / GiB == pytest.approx(67.7229, rel=1e-3)   # vLLM PR #12569's log
    # DeepSeek-V3's fp8 block scales: the checkpoint's count less its multi-token-prediction layer (one MoE layer),
    # which vLLM loads only for speculative decoding
    deepseek = model("deepseek-v3")
    scales = sum(FP8_BLOCK.state_elements(w.shape)[0][1] for w in deepseek.weights if w.linear)
    last_layer = sum(FP8_BLOCK.state_elements(w.shape)[0][1] for w in deepseek.weights
                     if w.linear and w.name.startswith("layers.60."))
    published = catalog()["deepseek-v3"]["published_includes"]["float32 fp8 block scales (weight_scale_inv)"]
    assert scales + last_layer == published
    awq = model("qwen2.5-7b")
    assert checkpoint_of(awq, "awq", (8, 9)).method == "awq_marlin"
    assert checkpoint_of(awq, "awq", (7, 5)).method == "awq"
    with pytest.raises(MemfitError, match="quantization_config says 'awq'"):
        checkpoint_of(dataclasses.replace(awq, quantization={"quant_method": "awq"}), "gptq", (8, 9))


def test_a_cache_too_small_for_the_context_is_refused_as_the_engine_words_it():
    """v-3090-29k: vLLM 0.6.4 refuses 29,000 tokens on an RTX 3090 (the cache held 23,648)."""
    v0 = serve("llama-3.1-8b", "rtx-3090", engine_version="0.6.4", max_model_len=29000)
    assert not v0.starts and v0.refusal.startswith("The model's max seq len (29000) is larger than the maximum")
    assert v0.max_model_len_fits == v0.kv_cache_tokens
    assert serve("llama-3.1-8b", "rtx-3090", engine_version="0.6.4", max_model_len=v0.max_model_len_fits).starts
    v1 = serve("llama-3.1-8b", "l4")   # 131,072 tokens on an L4
    assert not v1.starts and f"estimated maximum model length is {v1.max_model_len_fits}" in v1.refusal
    assert serve("llama-3.1-8b", "l4", max_model_len=v1.max_model_len_fits).starts
    assert not serve("llama-3.1-8b", "l4", max_model_len=v1.max_model_len_fits + 64).starts
    full = serve("llama-3.1-70b", "rtx-4090")
    assert not full.starts and full.refusal.startswith("No available memory for the cache blocks")


def test_tensor_parallel_and_the_eras():
    one, two = serve("llama-3-8b", max_model_len=8192), serve("llama-3-8b", max_model_len=8192, tensor_parallel=2)
    assert two.weights_bytes < one.weights_bytes / 2 + 0.6 * GiB and two.kv_blocks > 1.9 * one.kv_blocks
    stages = serve("llama-3-8b", max_model_len=8192, pipeline_parallel=2)   # 16 layers each, the head on the last
    assert stages.weights_bytes < 0.6 * one.weights_bytes and stages.kv_blocks > 1.9 * one.kv_blocks
    eager = serve("llama-3-8b", max_model_len=8192, enforce_eager=True)
    assert eager.cuda_graph_bytes == 0 and eager.kv_cache_bytes > one.kv_cache_bytes   # graphs in the budget (>= 0.21)
    old = serve("llama-3-8b", max_model_len=8192, engine_version="0.20.2")
    assert old.cuda_graph_bytes and not old.graphs_in_budget and old.settings["gpu_memory_utilization"] == 0.92
    assert serve("llama-3-8b", max_model_len=8192, engine_version="0.19.1").settings["gpu_memory_utilization"] == 0.9


@pytest.mark.parametrize("settings, message", [
    ({"tensor_parallel": 3}, "must be divisible by tensor parallel size"),
    ({"max_model_len": 200_000}, "greater than the derived max_model_len"),
    ({"gpu_memory_utilization": 1.5}, "must be in (0, 1]"),
    ({"engine_version": "0.1.0"}, "outside the releases memfit models"),
    ({"engine_version": "latest"}, "not a version number"),
    ({"engine": "sglang", "gpu_memory_utilization": 0.8}, "not a sglang setting"),
    ({"engine": "trt"}, "unknown serving engine"),
])
def test_settings_the_engine_rejects_before_loading(settings, message):
    with pytest.raises(MemfitError, match=message.replace("(", r"\(").replace("]", r"\]")):
        serve("llama-3.1-8b", **settings)


def test_the_command_answers_every_key_without_torch():
    """`memfit estimate MODEL --task serve` reads the config alone: torch is never imported."""
    code = ("import sys, json, io, contextlib; from memfit.cli.main import main; out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out): rc = main(['estimate', 'llama-3.1-8b', '--task', 'serve', "
            "'--engine', 'vllm', '--gpu', 'l4', '--json'])\n"
            "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, 'out': json.loads(out.getvalue())}))")
    result = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert result["rc"] == 0 and not result["torch"]
    assert all(key in result["out"] for key in JSON_KEYS)
    figures = [key for key in JSON_KEYS if key not in ("refusal", "sources")]
    assert sorted(set(figures) - set(result["out"]["sources"])) == []   # every figure says where it comes from


def test_the_table_and_the_command_line(capsys):
    assert main(["estimate", "qwen3-8b", "--task", "serve", "--engine", "vllm", "--gpu", "l4",
                 "--max-model-len", "16384"]) == 0
    out = capsys.readouterr().out
    assert "GPU KV cache size:" in out and "vllm serve Qwen/Qwen3-8B --max-model-len 16384" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "qwen3-8b", "--task", "serve", "--engine", "vllm", "--precision", "bf16"])
    assert exit_.value.code == 2 and "unrecognized arguments: --precision" in capsys.readouterr().err


def test_the_python_api_is_the_command():
    import memfit
    from memfit.serving import estimate

    given = dict(engine="vllm", gpu="l4", max_model_len=16384)
    by_name = memfit.estimate("qwen3-8b", task="serve", **given)
    assert by_name.to_json() == estimate("qwen3-8b", **given).to_json() and by_name.starts
    with pytest.raises(MemfitError, match="task='serve' takes a model's name"):
        memfit.estimate("qwen3-8b", task="serve", precision="bf16")
    # a notebook's config object (or its dict) is a model too; an unknown setting is one line
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                  intermediate_size=1024, vocab_size=1000)
    assert memfit.estimate(config, task="serve", gpu="l4", max_model_len=2048).to_json() == \
        estimate(config.to_dict(), gpu="l4", max_model_len=2048).to_json()
    with pytest.raises(MemfitError, match="Did you mean: max_model_len"):
        estimate("qwen3-8b", maxmodel_len=8192)


def test_auto_fit_and_a_context_beyond_the_model():
    """--max-model-len -1: the longest context that fits (vLLM's auto-fit); beyond the model's positions only with
    the override, as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN."""
    refused = serve("llama-3.1-8b", "l4")
    fitted = serve("llama-3.1-8b", "l4", max_model_len=-1)
    assert fitted.starts and fitted.max_model_len == refused.max_model_len_fits < 131072
    assert any(note.startswith("Auto-fit max_model_len: reduced from 131072") for note in fitted.notes)
    long = serve("qwen3-8b", max_model_len=65536, allow_long_max_model_len=True)   # positions: 40960
    assert long.starts and long.max_model_len == 65536


def test_tgi_sizes_its_cache_after_a_warm_up_that_keeps_every_prompt_logit():
    """TGI's warm-up asks for the prompt's log-probabilities: logits for every prefill token, gathered whole at
    tensor parallel > 1 (t-2xa100-llama31-70b: 10,049 prefill tokens, 128,256 logits each)."""
    small = serve("llama-3.1-70b", "a100-80gb", engine="tgi", engine_version="2.4.0", tensor_parallel=2,
                  max_batch_prefill_tokens=2048)
    large = serve("llama-3.1-70b", "a100-80gb", engine="tgi", engine_version="2.4.0", tensor_parallel=2,
                  max_batch_prefill_tokens=10049)
    logits = 10049 * 128256 * 2
    assert large.activation_bytes >= 2.5 * logits and large.kv_cache_tokens < small.kv_cache_tokens
    # TGI 3 keeps (1 - 0.95 x fraction) of the total back instead of 5 % of what is free
    assert serve("llama-2-7b", "a10g", engine="tgi", engine_version="3.0.0").kv_cache_tokens < \
        serve("llama-2-7b", "a10g", engine="tgi", engine_version="2.2.0").kv_cache_tokens


def test_explain_oom_reads_a_serving_failure_and_computes_its_fixes(tmp_path, capsys):
    """v-3090-29k's refusal: the log gives the context; every fix memfit lists starts when estimated."""
    log = tmp_path / "vllm.log"
    log.write_text("INFO ... # GPU blocks: 1478, # CPU blocks: 2048\nValueError: The model's max seq len (29000) is "
                   "larger than the maximum number of tokens that can be stored in KV cache (23648). Try increasing "
                   "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.\n")
    argv = ["explain-oom", str(log), "--task", "serve", "--engine", "vllm", "--model", "llama-3.1-8b", "--gpu",
            "rtx-3090", "--engine-version", "0.6.4", "--gpu-memory-utilization", "0.9", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["failure"]["kind"] == "context-too-long" and out["agrees"]
    assert out["predicted"]["settings"]["max_model_len"] == 29000
    changes = [fix["change"] for fix in out["fixes"]]
    assert changes[0].startswith("--max-model-len ") and "--kv-cache-dtype fp8" in changes
    assert all(fix["max_concurrency"] >= 1 for fix in out["fixes"])
    assert main(argv[:-1]) == 0 and "fixes, each alone" in capsys.readouterr().out
    log.write_text("nothing went wrong")
    assert main(argv) == 2 and "no serving start-up failure" in capsys.readouterr().err


def test_the_real_engine_run_here_decides_as_memfit_predicts():
    """benchmarks/vllm_cpu_check.py's record of vLLM's CPU build (0.32.0) started here on tiny models of six kinds
    (GQA, MHA, Qwen2, a float32 checkpoint, Mistral's sliding window, Gemma 2's hybrid layers): memfit's page, blocks,
    token figure, concurrency, refusal and longest context equal the engine's in every case it compares."""
    spec = importlib.util.spec_from_file_location("vllm_cpu_check", ROOT / "benchmarks" / "vllm_cpu_check.py")
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    run = json.loads((ROOT / "benchmarks" / "results" / "vllm_cpu_run.json").read_text())
    rows = [row for row in check.compare(run) if row["compared"]]
    assert len(rows) >= 20 and [row["case"] for row in rows if not row["equal"]] == []
    refused = [row for row in rows if row["engine"]["starts"] is False]
    assert refused and all(row["engine"]["longest_context"] == row["memfit"]["longest_context"] for row in refused)


def test_sglang_default_fraction_by_release():
    """server_args.py's default mem_fraction_static: by TP size to 0.4.8, then by the GPU's memory (an H100 at TP 1:
    0.874 from 0.4.9, 0.835 from 0.5.4 — SGLang's own figures, from nvidia-smi's slightly larger total)."""
    from memfit.serving.sglang import sglang_fraction

    def fraction(**settings):
        return sglang_fraction(get_gpu("h100"), ServeSettings(engine="sglang", **settings))

    assert fraction(engine_version="0.4.3", tensor_parallel=4) == 0.85
    assert fraction(engine_version="0.4.9") == pytest.approx(0.874, abs=2e-3)
    assert fraction(engine_version="0.5.4") == pytest.approx(0.835, abs=2e-3)


def test_sglang_reads_the_weights_as_the_allocator_reserves_them():
    """s-4x24g-qwen32b: SGLang's 'mem usage' for Qwen2.5-32B at TP 4 is 15.54 GB (GiB) — each fused tensor's segment
    rounded up to 2 MiB by the caching allocator, and its float32 rope cache of 131072 positions — where the tensors
    themselves are 15.26 GiB; with the log's free memory before the weights (21.63) the pool is its 46,611 tokens."""
    from memfit.serving.checkpoints import Checkpoint, engine_tensors, reserved_weights_bytes

    qwen = model("qwen2.5-32b")
    tensors = engine_tensors(qwen, Checkpoint(None, None), "bfloat16", 4)
    assert tensors["layers.0.attn.qkv"] == (40 + 8 + 8) // 4 * 128 * 5120 * 2 and "layers.0.mlp.gate_up" in tensors
    reserved = reserved_weights_bytes(qwen, Checkpoint(None, None), "bfloat16", 4)
    assert weights_bytes(qwen, Checkpoint(None, None), "bfloat16", 4) / GiB == pytest.approx(15.26, abs=0.005)
    assert reserved > sum(tensors.values()) and reserved % (2 * 2**20) == 0
    plain = serve("qwen2.5-32b", "rtx-4090", engine="sglang", engine_version="0.4.3", tensor_parallel=4)
    assert plain.weights_bytes / GiB == pytest.approx(15.54, abs=0.005)
    others = plain.gpu_memory_bytes - plain.non_torch_bytes - round(21.63 * GiB)
    logged = serve("qwen2.5-32b", "rtx-4090", engine="sglang", engine_version="0.4.3", tensor_parallel=4,
                   other_process_bytes=others)
    assert logged.kv_cache_tokens == pytest.approx(46_611, rel=0.002)


def test_tgi_keeps_the_prompt_log_probabilities_beside_the_logits():
    """At tensor parallel 1 the warm-up's log_softmax writes a second array as large as the logits."""
    from memfit.serving.tgi import tgi_warmup_logits

    llama = model("llama-2-7b")
    assert tgi_warmup_logits(llama, 4096, 1, "float16") == 2 * 4096 * 32000 * 2
