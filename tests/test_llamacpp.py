"""llama.cpp's buffers: memfit against real llama.cpp loads here (benchmarks/llamacpp_cpu_run.py's record, and live
where ./.venv-llama holds the build), a GGUF file read from its header, and the command line."""
import json
import os
import subprocess

import pytest

from memfit.cli.main import main
from memfit.core.errors import MemfitError
from memfit.serving.gguf_file import read_gguf
from memfit.serving.llamacpp import LlamaCppSettings, estimate_llamacpp
from tests.conftest import LLAMA_FLAGS, benchmark, run_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


check, recorder = benchmark("llamacpp_cpu_check"), benchmark("llamacpp_cpu_run")
compare, model_of, settings_of, write_gguf = check.compare, check.model_of, check.settings_of, recorder.write_gguf

LLAMA_VENV_PYTHON = os.path.join(REPO, ".venv-llama", "bin", "python")
RUNS = recorder.expand(check.load_record())


def assert_equal_to_the_log(row):
    """Every figure as llama.cpp printed it: the weights' bytes exact, the KV cells exact, the KV, output and
    repacked-weights MiB to the log's 2 decimals, the compute buffer to its 4."""
    for key in ("weights", "kv_cells", "kv_mib", "output_mib", "repack_mib", "compute_mib"):
        assert row[key][0] == row[key][1], (row["case"], key, row[key])


@pytest.mark.parametrize("run", RUNS, ids=[f"{r['model']}-{r['quant']}-{i}" for i, r in enumerate(RUNS)])
def test_every_recorded_load_is_predicted_as_llamacpp_allocated_it(run):
    """Dense GQA, MHA, tied embeddings and Qwen2's biases; F32 to Q3_K_M and IQ4_XS; contexts that llama.cpp pads,
    ubatches above the context, flash attention on, off and auto, quantized K and V caches, split and unified
    slots: weights, KV cache, output and compute buffer equal to llama.cpp's own figures."""
    assert_equal_to_the_log(compare(run))


def test_the_record_covers_the_settings_that_change_the_buffers():
    settings = [r["settings"] for r in RUNS]
    assert {s.get("flash_attn", "off") for s in settings} == {"on", "off", "auto"}
    assert {s.get("type_v") for s in settings} >= {None, "q8_0", "q4_0"}
    assert any(s.get("n_seq_max", 1) > 1 and not s.get("kv_unified") for s in settings)
    assert any(s.get("kv_unified") for s in settings)
    assert any(s["n_ctx"] % 256 for s in settings) and any(s["n_ctx"] < s.get("n_ubatch", 512) for s in settings)
    # what the settings change: flash attention drops the float32 scores; slots split the cells, not the bytes
    by = {(r["quant"], json.dumps(r["settings"], sort_keys=True)): r for r in RUNS if r["model"] == "gqa"}
    plain, flash = by["Q4_K_M", '{"n_ctx": 4096}'], by["Q4_K_M", '{"flash_attn": "on", "n_ctx": 4096}']
    assert flash["compute_buffers_mib"]["CPU"] < plain["compute_buffers_mib"]["CPU"] / 5
    slots = by["Q4_K_M", '{"n_ctx": 4096, "n_seq_max": 4}']
    assert slots["kv"]["cells"] * 4 == plain["kv"]["cells"] and slots["kv"]["mib"] == plain["kv"]["mib"]


@pytest.mark.parametrize("kind", ["gqa", "gemma3", "qwen3moe"])
def test_a_gguf_file_is_read_from_its_header(kind, tmp_path):
    """The file written by the gguf package gives the model the record's load read (a dense one, Gemma 3 with its
    window and heads wider than n_embd / n_head, Qwen3-MoE's experts): same tensors, same buffers."""
    run = next(r for r in RUNS if r["model"] == kind and r["quant"] in ("F32", "Q4_K_M"))
    path = str(tmp_path / f"{kind}.gguf")
    write_gguf(path, **run["hparams"])
    model = read_gguf(path)
    recorded = model_of(run)
    assert sorted((t.name, t.shape) for t in model.tensors) == sorted((t.name, t.shape) for t in recorded.tensors)
    fields = ("n_layer", "n_head", "n_head_kv", "head_dim_k", "n_vocab", "n_swa", "swa_layers", "n_expert",
              "n_expert_used", "n_ff_exp")
    assert [getattr(model, f) for f in fields] == [getattr(recorded, f) for f in fields]
    if run["quant"] == "F32":
        assert model.weights_bytes == run["model_size_bytes"]
    model.tensors = recorded.tensors   # the quantized file's types
    settings = settings_of(run)
    assert estimate_llamacpp(model, settings).buffers["CPU"] == estimate_llamacpp(recorded, settings).buffers["CPU"]


def test_the_command_line_reads_a_gguf_file_and_prints_the_buffers(tmp_path, capsys):
    path = str(tmp_path / "model.gguf")
    write_gguf(path, **RUNS[0]["hparams"])
    assert main(["estimate", path, "--task", "serve", "--engine", "llama.cpp", "-c", "1000", "-fa", "off",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    run = RUNS[0]   # the same model at n_ctx 1000 without flash attention
    assert data["cpu_model_bytes"] == run["model_size_bytes"] and data["kv_cells"] == run["kv"]["cells"]
    assert round(data["cpu_compute_bytes"] / 2**20, 4) == run["compute_buffers_mib"]["CPU"]
    assert data["command"] == "llama-server -m model.gguf -c 1000 --flash-attn off"
    assert main(["estimate", path, "--task", "serve", "--engine", "llama.cpp"]) == 0
    assert "KV" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["llama-3.1-8b"], "Give --quant"),
    (["{path}", "--quant", "Q4_K_M"], "already quantized"),
    (["deepseek-v3", "--quant", "Q4_K_M"], "not modelled"),
    (["llama-3.1-8b", "--quant", "Q9"], "--quant Q9"),
    (["missing.gguf"], "no such GGUF file"),
    (["{path}", "-ctv", "q8_0", "-fa", "off"], "needs flash attention"),
    (["{path}", "-c", "-5"], "--ctx-size -5"),
    (["{path}", "-ctk", "q9"], "invalid choice"),
    (["{path}", "--gpus", "-1"], "--gpus -1"),
])
def test_bad_llamacpp_input_is_one_line(argv, fragment, tmp_path, capsys):
    path = str(tmp_path / "model.gguf")
    write_gguf(path, **RUNS[0]["hparams"])
    code, out, err = run_cli(capsys, "estimate", *[a.format(path=path) for a in argv], "--task", "serve", "--engine",
                         "llama.cpp")
    assert code == 2 and fragment in err and out == "" and len(err.strip().splitlines()) == 1


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(MemfitError, match="not a GGUF file"):
        read_gguf(str(bad))


def test_settings_are_checked_as_llamacpp_checks_them():
    with pytest.raises(MemfitError, match="--n-ubatch 0"):
        LlamaCppSettings(n_ubatch=0)
    with pytest.raises(MemfitError, match="on, off or auto"):
        LlamaCppSettings(flash_attn="yes")


@pytest.mark.skipif(not os.path.exists(LLAMA_VENV_PYTHON), reason="llama.cpp is built by scripts/setup_llamacpp.sh")
def test_llamacpp_loads_here_as_memfit_predicts():
    """llama.cpp itself, run now: four of the record's cases loaded again (MHA at a small ubatch, split slots, a
    quantized cache with flash attention, Qwen3-MoE's experts with a rotated q8_0 cache) equal memfit's
    prediction."""
    cases = [14, 8, 7, 54]
    child = subprocess.run([LLAMA_VENV_PYTHON, os.path.join(REPO, "benchmarks", "llamacpp_cpu_run.py"),
                            *[f"--case={i}" for i in cases]], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-2000:]
    for run in json.loads(child.stdout)["runs"]:
        assert_equal_to_the_log(compare(run))


def test_the_recipe_gives_each_tensor_the_type_llamacpps_quantizer_gave_it():
    """Every tensor of every file llama.cpp's quantizer wrote here (the record: 16 layers for its more-bits layers,
    an FFN whose rows do not split into 256-blocks for its fallbacks, 17 file types) gets the same ggml type from
    memfit's recipe, so the same bytes."""
    from memfit.serving.gguf_file import GGUFTensor
    from memfit.serving.gguf_recipe import quantize

    checked = set()
    for run in RUNS:
        source = model_of(run)
        source.tensors = [GGUFTensor(t.name, "F32", t.shape) for t in source.tensors]
        written = quantize(source, run["quant"])
        expected = [kind for _, kind, _ in run["tensors"]]
        assert [t.type for t in written.tensors] == expected, (run["model"], run["quant"])
        assert written.weights_bytes == run["model_size_bytes"]
        checked.add(run["quant"])
    assert len(checked) >= 17


@pytest.mark.parametrize("model, quant, settings, gpu_mib, cpu_mib, kv_mib", [
    # published load logs (benchmarks/published_llamacpp.md): the model buffers and KV llama.cpp printed
    ("llama-3.1-8b", "Q4_K_M", dict(ctx_size=8192, parallel=4, kv_unified=True), 4403.49, 281.81, (1024.0, 0.0)),
    ("qwen2.5-7b", "Q4_K_M", dict(ctx_size=4096), 4168.09, 292.36, (224.0, 0.0)),             # R11, R13
    ("qwen2.5-7b", "Q4_K_M", dict(ctx_size=8192, n_gpu_layers=27), 3883.68, 576.77, (416.0, 32.0)),   # R14
    ("qwen2.5-32b", "Q4_K_M", {}, 18508.35, 417.66, None),                                     # R22, R23
    ("llama-3.1-70b", "Q4_0", dict(ctx_size=4096), 37546.98, 563.62, (1280.0, 0.0)),           # R24
    ("mistral-7b", "Q4_K_M", dict(ctx_size=1024), 4095.05, 70.31, (128.0, 0.0)),               # R10
])
def test_a_hub_models_gguf_is_sized_as_published_load_logs_show(model, quant, settings, gpu_mib, cpu_mib, kv_mib):
    """A Hugging Face model written as llama.cpp's converter and quantizer would: its buffers on the GPU and CPU,
    to the MiB hundredth the published logs print, with the layer split -ngl gives."""
    from memfit.serving.llamacpp import gguf_model

    result = estimate_llamacpp(gguf_model(model, quant), LlamaCppSettings(**settings), gpus=1)
    gpu, cpu = result.buffers["GPU0"], result.buffers["CPU"]
    assert (round(gpu.model / 2**20, 2), round(cpu.model / 2**20, 2)) == (gpu_mib, cpu_mib)
    if kv_mib:
        assert (gpu.kv / 2**20, cpu.kv / 2**20) == kv_mib


def test_a_full_offloads_gpu_compute_buffer_is_the_published_one():
    """Qwen2.5-7B Q4_K_M at 4096 with flash attention (R11's CUDA and R13's Vulkan logs: 304.00 MiB): the graph on
    the GPU takes the embeddings as an input from the host, and its peak is the logits beside the final norm."""
    from memfit.serving.llamacpp import gguf_model

    result = estimate_llamacpp(gguf_model("qwen2.5-7b", "Q4_K_M"), LlamaCppSettings(ctx_size=4096, flash_attn="on"),
                               gpus=1)
    assert round(result.buffers["GPU0"].compute / 2**20, 2) == 304.00


def test_published_load_logs_are_reproduced_within_the_targets():
    """benchmarks/published_llamacpp.py: every row of the calibration set memfit can express, at its release's rules
    (the KV padding, the output buffer, set_rows' index inputs, the F32 mask cast for flash attention, the
    embeddings input): the weights and KV to the hundredth of a MiB, the compute buffers within the target."""
    bench = benchmark("published_llamacpp")
    records = bench.run()
    totals = bench.summary(records)
    assert totals["weights_and_kv"]["figures"] >= 40 and totals["weights_and_kv"]["mean_abs_error"] <= 0.005
    assert totals["compute"]["figures"] >= 15 and totals["compute"]["mean_abs_error"] <= 0.10
    # Ollama's own estimate (R01, R02, R26, R27, R31): every field compared as its log prints it
    ollama = totals["ollama_estimate"]
    assert ollama["fields"] >= 45 and ollama["as_printed"] == ollama["fields"]
    exact = {(r["id"], r["metric"]) for r in records if r["metric"] != "-" and r["error"] == 0}
    assert {("R01", "gpu_compute"), ("R01", "host_compute"), ("R06", "gpu_compute"), ("R11", "gpu_compute"),
            ("R35", "gpu_compute"), ("R43", "kv"), ("R43", "gpu_compute")} <= exact   # R43: Gemma 2 (2024-09)
    # several devices: each one's weights and KV as llama.cpp splits the layers (RPC workers first)
    assert {("R22", f"gpu{i}_model") for i in range(4)} | {("R24", "gpu1_kv"), ("R25", "gpu0_model")} <= exact


def test_the_estimates_flags_and_command_are_llamacpps_own():
    from memfit.cli.llamacpp import FLAGS

    assert {flag for flags, _, _, _ in FLAGS for flag in flags} <= LLAMA_FLAGS


OOM_LOG = """llama_context: n_ctx         = 32768
llama_context: n_ubatch      = 512
llama_context: flash_attn    = 0
load_tensors: offloaded 33/33 layers to GPU
ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB on device 0: cudaMalloc failed: out of memory
llama_kv_cache_init: failed to allocate buffer for kv cache
"""


def test_an_allocation_failure_names_its_buffer_and_the_fixes_that_fit(tmp_path, capsys):
    """Llama-3.1-8B Q4_K_M at 32768 tokens on an 8 GB card: the KV cache failed (4 GiB, the log's size); the settings
    come from the log; each fix the explanation lists fits the card by memfit's own estimate, and the context and
    layers it names are the largest that do (one more would not)."""
    from memfit.serving.llamacpp import gguf_model
    from memfit.serving.llamacpp_oom import gpu_budget
    from memfit.specs.hardware import get_gpu

    log = tmp_path / "oom.log"
    log.write_text(OOM_LOG)
    code, out, err = run_cli(capsys, "explain-oom", str(log), "--engine", "llama.cpp", "--model", "llama-3.1-8b",
                             "--quant", "Q4_K_M", "--gpu", "rtx-4060", "--json")
    data = json.loads(out)
    assert code == 0, err
    assert data["buffer"] == "kv" and data["failed_bytes"] == 4096 * 2**20
    assert data["settings_from_log"] == {"ctx_size": 32768, "n_ubatch": 512, "n_gpu_layers": 33, "flash_attn": "off"}
    budget = gpu_budget(get_gpu("rtx-4060"))
    changes = {f["change"].split(" (")[0]: f["gpu_bytes"] for f in data["fixes"]}
    assert changes and all(used <= budget for used in changes.values())
    context = int(next(c for c in changes if c.startswith("-c ")).split()[1])
    model = gguf_model("llama-3.1-8b", "Q4_K_M")
    over = estimate_llamacpp(model, LlamaCppSettings(ctx_size=context + 256, flash_attn="off"), gpus=1)
    assert over.buffers["GPU0"].total > budget
    code, _, err = run_cli(capsys, "explain-oom", str(log), "--engine", "llama.cpp", "--gpu", "t4")
    assert code == 2 and "name the model" in err


def test_ollama_is_llamacpp_with_its_runners_settings(capsys):
    """--engine ollama with Ollama's names: R01's load (Ollama 0.5.4, num_ctx 2048 x 4 slots, Llama-3.1-8B Q4_K_M)
    gives the log's KV, compute and output buffers (one cache of 8192 cells; the output holds embeddings too), and
    the Modelfile's parameters; llama.cpp's names are refused there, Ollama's elsewhere."""
    code, out, err = run_cli(capsys, "estimate", "llama-3.1-8b", "--task", "serve", "--engine", "ollama", "--quant",
                         "Q4_K_M", "--num-ctx", "2048", "--num-parallel", "4", "--gpus", "1", "--engine-version",
                         "2024-12", "--json")
    data = json.loads(out)
    assert code == 0, err
    mib = {k: round(data[k] / 2**20, 2) for k in ("gpu_kv_bytes", "gpu_compute_bytes", "cpu_compute_bytes",
                                                 "output_bytes")}
    assert mib == {"gpu_kv_bytes": 1024.0, "gpu_compute_bytes": 560.0, "cpu_compute_bytes": 24.01,
                   "output_bytes": 2.02}
    assert "PARAMETER num_ctx 2048" in data["command"] and data["kv_cells"] == 8192
    assert run_cli(capsys, "estimate", "llama-3.1-8b", "--task", "serve", "--engine", "ollama", "--quant", "Q4_K_M",
               "-c", "100")[0] == 2
    assert run_cli(capsys, "estimate", "llama-3.1-8b", "--task", "serve", "--engine", "llama.cpp", "--quant", "Q4_K_M",
               "--num-ctx", "100")[0] == 2


def test_a_model_whose_graph_is_not_replayed_is_refused_with_its_weights():
    """A GGUF of a sliding-window model other than Gemma 2 and 3 and gpt-oss, or another architecture: its weights come
    from the header, but its KV cache and compute graph are not those memfit replays; it says so rather than print
    the wrong buffers."""
    from dataclasses import replace as changed

    model = model_of(RUNS[0])
    for different in (changed(model, n_swa=1024), changed(model, arch="cohere2"), changed(model, arch="deepseek2")):
        with pytest.raises(MemfitError, match=r"not modelled.*its weights alone"):
            estimate_llamacpp(different, LlamaCppSettings(ctx_size=1024))


def test_a_notebook_reaches_llamacpp_with_its_config_object_or_through_memfit_estimate():
    """What a user tried from a notebook: a transformers config object, and memfit.estimate(..., engine=...)."""
    from transformers import LlamaConfig

    import memfit
    from memfit.serving import estimate_gguf

    config = LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=512, vocab_size=1000, tie_word_embeddings=False)
    run = next(r for r in RUNS if r["model"] == "gqa" and r["quant"] == "Q4_K_M")
    from_notebook = estimate_gguf(config, quant="Q4_K_M", ctx_size=4096)
    assert from_notebook.weights_bytes == run["model_size_bytes"]
    via_estimate = memfit.estimate("llama-3.1-8b", task="serve", engine="llama.cpp", quant="Q4_K_M", gpu="rtx-4090",
                                   ctx_size=8192)
    assert round(via_estimate.buffers["GPU0"].model / 2**20, 2) == 4403.49
    with pytest.raises(MemfitError, match="Did you mean: ctx_size"):
        estimate_gguf(config, quant="Q4_K_M", ctx=4096)
    with pytest.raises(MemfitError, match=r"llama\.cpp or ollama"):
        memfit.estimate("llama-3.1-8b", task="serve", engine="llamacpp")
    split = estimate_gguf("qwen2.5-32b", quant="Q4_K_M", gpu="rtx-3090", gpus=4, ctx_size=8192)
    assert [round(split.buffers[f"GPU{i}"].model / 2**20, 2) for i in range(4)] == [4844.72, 4366.53, 4366.53,
                                                                                     4930.57]   # R22
    # no context given: llama.cpp's --fit shrinks the training context to the card, as the command line says
    fitted = estimate_gguf("qwen2.5-7b", quant="Q4_K_M", gpu="rtx-3060")
    assert fitted.n_ctx < 131072 and fitted.notes[0].startswith("llama.cpp's --fit: projected")
    assert estimate_gguf("qwen2.5-7b", quant="Q4_K_M", gpu="rtx-3060", fit=False).n_ctx == 131072


@pytest.mark.parametrize("argv, fragment", [
    (["estimate", "bartowski/Llama-3.2-3B-Instruct-GGUF", "--task", "serve", "--engine", "llama.cpp"],
     "repository of GGUF files"),
    (["plan", "{path}", "--engine", "llama.cpp", "--gpu", "rtx-3060", "--host-ram", "16GiB"], "searches file types"),
])
def test_what_a_new_user_typed_is_answered_in_one_line(argv, fragment, tmp_path, capsys):
    path = str(tmp_path / "model.gguf")
    write_gguf(path, **RUNS[0]["hparams"])
    code, out, err = run_cli(capsys, *[a.format(path=path) for a in argv])
    assert code == 2 and fragment in err and out == ""


def test_a_truncated_log_still_names_the_failed_allocation(tmp_path, capsys):
    log = tmp_path / "cut.log"
    log.write_text("llama_context: n_ctx = 8192\nggml_backend_cuda_buffer_type_alloc_buffer: allocating 1024.00 MiB on "
                   "device 0: cudaMalloc failed: out of mem")
    code, out, err = run_cli(capsys, "explain-oom", str(log), "--engine", "llama.cpp", "--model", "llama-3.1-8b",
                         "--quant", "Q4_K_M", "--gpu", "rtx-4060", "--json")
    data = json.loads(out)
    assert code == 0 and data["buffer"] == "gpu" and data["failed_bytes"] == 2**30, err


def test_a_mixture_of_experts_is_written_as_llamacpps_converter_and_quantizer_write_it():
    """Mixtral (llama's graph, 8 experts) and Qwen3-MoE (qwen3moe, 128): a float32 router, each projection's experts in
    one 3-D tensor; the quantizer's 8-expert rules give Mixtral's attn_k and attn_v Q8_0 and its attn_output Q5_K in
    Q4_K_M, and leave Qwen3-MoE's alone."""
    from memfit.serving.llamacpp import gguf_model

    mixtral, qwen = gguf_model("mixtral-8x7b", "Q4_K_M"), gguf_model("qwen3-30b-a3b", "Q4_K_M")
    assert (mixtral.arch, mixtral.n_expert, mixtral.n_expert_used, mixtral.n_ff_exp) == ("llama", 8, 2, 14336)
    assert (qwen.arch, qwen.n_expert, qwen.n_expert_used, qwen.n_ff_exp) == ("qwen3moe", 128, 8, 768)
    layer = {t.name[len("blk.0."):]: t for t in mixtral.tensors if t.layer == 0}
    assert (layer["ffn_gate_inp.weight"].type, layer["ffn_gate_inp.weight"].shape) == ("F32", (4096, 8))
    assert layer["ffn_down_exps.weight"].shape == (14336, 4096, 8)
    assert {name: layer[name].type for name in ("attn_k.weight", "attn_v.weight", "attn_output.weight")} == {
        "attn_k.weight": "Q8_0", "attn_v.weight": "Q8_0", "attn_output.weight": "Q5_K"}
    qwen_layer = {t.name[len("blk.0."):]: t.type for t in qwen.tensors if t.layer == 0}
    assert qwen_layer["attn_k.weight"] == "Q4_K" and qwen_layer["attn_q_norm.weight"] == "F32"


def test_mixtral_layers_are_the_bytes_a_published_load_put_on_the_gpu():
    """R28 (Ollama 0.1.28, March 2024, Mixtral-8x7B Q4_0, 23 of 33 on an RTX 3090): 17999.66 MiB on the GPU, the
    25215.87 MiB file mapped on the CPU. That file's converter kept the router in F16 (now F32: 64 KiB a layer more)
    and that llama.cpp's -ngl 23 meant 23 repeating layers (the head stayed on the CPU; now the head is one of the
    23): memfit's layer tensors with those two differences give the log's figures to the hundredth."""
    from memfit.serving.llamacpp import gguf_model, gpu_tensor_bytes

    model = gguf_model("mixtral-8x7b", "Q4_0")
    router = next(t for t in model.tensors if t.name == "blk.0.ffn_gate_inp.weight")
    then = router.nbytes // 2   # the router in F16: 64 KiB less a layer, on the GPU and in the file
    layers = sum(gpu_tensor_bytes(t) for t in model.tensors if t.layer is not None and t.layer >= 32 - 23)
    assert round((layers - 23 * then) / 2**20, 2) == 17999.66
    assert round((model.weights_bytes - 32 * then) / 2**20, 2) == 25215.87


def test_n_cpu_moe_keeps_the_first_layers_experts_in_host_memory(capsys):
    """--n-cpu-moe N (llama.cpp's tensor override of blk.0..N-1's ffn_*_exps): those experts move to the CPU and
    nothing else does; --cpu-moe moves every layer's; the command says it back; a dense model is told it moves
    nothing."""
    from memfit.serving.llamacpp import gguf_model, gpu_tensor_bytes

    model = gguf_model("qwen3-30b-a3b", "Q4_K_M")
    every = estimate_llamacpp(model, LlamaCppSettings(ctx_size=4096), gpus=1)
    some = estimate_llamacpp(model, LlamaCppSettings(ctx_size=4096, n_cpu_moe=10), gpus=1)
    moved = [t for t in model.tensors if t.layer is not None and t.layer < 10 and t.name.endswith("_exps.weight")]
    assert len(moved) == 30
    assert every.buffers["GPU0"].model - some.buffers["GPU0"].model == sum(gpu_tensor_bytes(t) for t in moved)
    assert some.buffers["CPU"].model - every.buffers["CPU"].model == sum(t.nbytes for t in moved)
    assert some.buffers["GPU0"].kv == every.buffers["GPU0"].kv and some.layers_on_gpu == every.layers_on_gpu
    code, out, _ = run_cli(capsys, "estimate", "qwen3-30b-a3b", "--quant", "Q4_K_M", "--task", "serve", "--engine",
                       "llama.cpp", "--gpus", "1", "-c", "4096", "-cmoe", "--json")
    data = json.loads(out)
    assert code == 0 and data["command"].endswith("--cpu-moe") and data["gpu_model_bytes"] < 2**30
    dense = estimate_llamacpp(model_of(RUNS[0]), LlamaCppSettings(ctx_size=1024, n_cpu_moe=2))
    assert any("no experts" in note for note in dense.notes)


def test_a_quantized_cache_is_rotated_from_the_release_that_rotates_it():
    """PR 21038 (2026-04-01): a quantized K or V cache whose head size is a multiple of 64 stores rotated vectors:
    a Hadamard matrix per cache (K's the largest power of two dividing the head, V's 64), as graph inputs. The record
    holds 128-wide heads in q4_0 and q8_0 (equal to llama.cpp's compute buffer above); before the release, none."""
    from memfit.serving.ggml_graph import rotations
    from memfit.serving.llamacpp import gguf_model

    model = gguf_model("llama-3.1-8b", "Q4_K_M")
    assert rotations(model, LlamaCppSettings(cache_type_k="q8_0", cache_type_v="q4_0", flash_attn="on")) == (128, 64)
    assert rotations(model, LlamaCppSettings(cache_type_k="q8_0")) == (128, 0)
    assert rotations(model, LlamaCppSettings(cache_type_k="q8_0", engine_version="2026-03")) == (0, 0)
    assert rotations(model_of(RUNS[0]), LlamaCppSettings(cache_type_k="q8_0")) == (0, 0)   # heads of 32
    assert any(r["model"] == "head128" and r["settings"].get("type_k") == "q4_0" for r in RUNS)


def test_gemma3s_window_layers_get_a_cache_of_the_window_and_a_ubatch():
    """Gemma 3 (five sliding-window layers in six): the window layers' cache holds each slot's window plus a ubatch,
    padded to 256 (llama_kv_cache_iswa): with a 1024 window, 4 unified slots and a 512 ubatch 4608 cells, with a
    2048 ubatch 6144 (the cells published llama-server logs print for a 1024 window: R17, R20); --swa-full and
    releases before PR 13194 keep the whole context. The record's Gemma 3 loads hold both caches exactly."""
    from memfit.serving.llamacpp import gguf_model, kv_cache

    model = gguf_model("gemma-3-12b", "Q4_K_M")
    assert (model.n_swa, sum(model.swa_layers), len(model.swa_layers)) == (1024, 40, 48)
    unified = LlamaCppSettings(ctx_size=8192, parallel=4, kv_unified=True)
    assert kv_cache(model, unified, True).swa_cells == 4608
    assert kv_cache(model, LlamaCppSettings(ctx_size=8192, parallel=4, kv_unified=True, n_ubatch=2048), True
                    ).swa_cells == 6144
    full = kv_cache(model, LlamaCppSettings(ctx_size=8192, swa_full=True), True)
    assert full.swa_cells == 8192 and full.bytes == 48 * full.layer_bytes[5]
    old = kv_cache(model, LlamaCppSettings(ctx_size=8192, engine_version="2025-04"), True)
    assert old.swa_cells == 8192
    windowed = kv_cache(model, LlamaCppSettings(ctx_size=32768), True)
    assert windowed.bytes == 8 * windowed.layer_bytes[5] + 40 * windowed.layer_bytes[0]
    assert windowed.layer_bytes[0] * 32768 == windowed.layer_bytes[5] * 1536   # 1024 + 512 cells against 32768
    assert any(r["model"] == "gemma3" and r["kv"].get("swa") for r in RUNS)


def test_a_tensor_split_gives_each_gpu_its_run_of_layers(capsys):
    """--gpus N with -ts: each GPU takes the next run of layer slots in proportion to its share (the head with the
    last GPU's); 3,1 gives the first GPU three quarters of Qwen2.5-32B's 65 slots; the command says it back."""
    from memfit.serving.llamacpp import gguf_model

    model = gguf_model("qwen2.5-32b", "Q4_K_M")
    even = estimate_llamacpp(model, LlamaCppSettings(ctx_size=8192), gpus=2)
    split = estimate_llamacpp(model, LlamaCppSettings(ctx_size=8192, tensor_split=(3, 1)), gpus=2)
    per_layer_kv = even.kv.layer_bytes[0]
    assert (even.buffers["GPU0"].kv // per_layer_kv, even.buffers["GPU1"].kv // per_layer_kv) == (33, 31)
    assert (split.buffers["GPU0"].kv // per_layer_kv, split.buffers["GPU1"].kv // per_layer_kv) == (49, 15)
    assert split.placement["output.weight"] == "GPU1" and split.placement["blk.48.attn_q.weight"] == "GPU0"
    assert sum(b.model for b in split.buffers.values()) == sum(b.model for b in even.buffers.values())
    code, out, _ = run_cli(capsys, "estimate", "qwen2.5-32b", "--quant", "Q4_K_M", "--task", "serve", "--engine",
                       "llama.cpp", "--gpus", "2", "-ts", "3,1", "-c", "8192", "--json")
    data = json.loads(out)
    assert code == 0 and data["command"].endswith("--tensor-split 3,1") and len(data["gpus"]) == 2
    assert data["gpu_model_bytes"] == sum(g["model_bytes"] for g in data["gpus"])


def test_gpt_oss_is_the_file_and_caches_published_loads_show():
    """gpt-oss-20b as llama.cpp's MXFP4_MOE recipe writes it (experts MXFP4, the rest Q8_0) is the 11536.18 MiB an
    LM Studio load mapped (R45); at 131072 tokens with a 2048 ubatch its caches are the 3072 MiB of the full layers
    and the 54 MiB of a 2304-cell window cache a published llama-server log printed (R37); the tiny gpt-oss of the
    record (sinks, biases, experts, a window) loads as predicted."""
    from memfit.serving.llamacpp import gguf_model

    model = gguf_model("gpt-oss-20b", "MXFP4_MOE")
    assert round(model.weights_bytes / 2**20, 2) == 11536.18
    assert {t.type for t in model.tensors if t.name.endswith("_exps.weight")} == {"MXFP4"}
    kv = estimate_llamacpp(model, LlamaCppSettings(ctx_size=131072, n_ubatch=2048, flash_attn="on"), gpus=1).kv
    windowed = sum(size for size, sliding in zip(kv.layer_bytes, model.swa_layers) if sliding)
    assert (kv.swa_cells, (kv.bytes - windowed) / 2**20, windowed / 2**20) == (2304, 3072.0, 54.0)
    assert sum(r["model"] == "gptoss" for r in RUNS) >= 4


def test_the_process_grows_by_the_host_figure():
    """benchmarks/llamacpp_cpu_rss.py's record: llama.cpp's process on this CPU, a 250M-parameter model in four file
    types with its context filled, grew its resident size by memfit's host buffers plus the repacked weights' pages
    within 10 % each; for a repacked type (Q4_0) the pages the repacking copied from stay resident (without them
    memfit would be over 15 % short)."""
    rss = benchmark("llamacpp_cpu_rss")
    with open(rss.RESULTS + ".json") as fh:
        rows = rss.rows(json.load(fh)["runs"])
    assert len(rows) >= 5 and all(abs(row["error"]) <= 0.10 for row in rows), rows
    q4_0 = next(row for row in rows if row["quant"] == "Q4_0")
    assert q4_0["repack_mib"] > 0 and q4_0["measured_mib"] > 1.15 * q4_0["host_mib"]
