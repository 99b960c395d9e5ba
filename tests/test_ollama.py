"""Ollama's own memory estimate (serving/ollama.py: llm/memory.go's EstimateGPULayers and GraphSize by release), its
scheduler's choice of slots and GPUs, and `memfit estimate --engine ollama` by release: the estimate up to 0.12,
its layout (0.12.11 to 0.2x), llama-server's --fit from 0.30."""
import json

import pytest

from memfit.core.errors import MemfitError
from memfit.serving.llamacpp import gguf_model
from memfit.serving.ollama import (
    OllamaGPU,
    estimate_ollama,
    graph_sizes,
    human_bytes,
    layer_groups,
    projector,
    schedule_ollama,
)
from memfit.serving.ollama_layout import layout_ollama
from memfit.serving.ollama_releases import OllamaRelease, default_num_ctx
from tests.conftest import run_cli

GiB = 1 << 30


def _estimate(*argv):
    return ("estimate", "llama-3.1-8b", "--quant", "Q4_K_M", "--task", "serve", "--engine", "ollama", *argv)


def test_r01s_estimate_line_and_the_load_it_chose(capsys):
    """R01 (Ollama 0.5.4, an RTX 4090 with 23.3 GiB free, OLLAMA_NUM_PARALLEL unset): its scheduler keeps its
    default 4 slots of the default 2048 tokens, and the log's memory.* line comes out as printed; the llama.cpp
    buffers then loaded at -ngl 33 are the log's (1024 MiB of KV, 560 MiB of compute)."""
    code, out, err = run_cli(capsys, *_estimate("--engine-version", "0.5.4", "--gpu-free", str(int(23.3 * 1024)),
                                                "--json"))
    assert code == 0, err
    data = json.loads(out)
    fields = data["ollama"]["estimate"]
    assert data["ollama"]["sizing"] == "estimate" and fields["layers.offload"] == "33"
    assert {k: fields[k] for k in ("memory.required.full", "memory.required.kv", "memory.weights.repeating",
                                   "memory.graph.full", "memory.graph.partial")} == {
        "memory.required.full": "6.5 GiB", "memory.required.kv": "1.0 GiB", "memory.weights.repeating": "4.5 GiB",
        "memory.graph.full": "560.0 MiB", "memory.graph.partial": "677.5 MiB"}
    assert data["layers_on_gpu"] == 33 and data["n_ctx"] == 8192
    assert round(data["gpu_kv_bytes"] / 2**20, 2) == 1024.0 and round(data["gpu_compute_bytes"] / 2**20, 2) == 560.0
    assert "PARAMETER num_ctx 2048" in data["command"] and "OLLAMA_NUM_PARALLEL=4" in data["command"]


def test_r26_four_gpus_partial_load_split_as_ollama_split_it():
    """R26 (Ollama ~0.5.11, four 24 GB GPUs with 22.0 GiB free, num_ctx 64000, a 70B in Q8_0): 4 slots do not fit,
    nor 1, so the scheduler loads one slot partially on every GPU: 11 layers each, the log's figures."""
    model = gguf_model("llama-3.3-70b", "Q8_0")
    estimate, slots, chosen = schedule_ollama(model, [OllamaGPU(22 * GiB)] * 4, release=OllamaRelease.parse("0.5.11"),
                                              num_ctx=64000)
    assert slots == 1 and chosen == [0, 1, 2, 3] and estimate.split == [11, 11, 11, 11]
    fields = estimate.fields()
    assert (fields["memory.required.full"], fields["memory.required.partial"], fields["memory.required.kv"]) == (
        "127.4 GiB", "87.1 GiB", "19.5 GiB")
    assert fields["memory.required.allocations"] == "[21.8 GiB 21.8 GiB 21.8 GiB 21.8 GiB]"


def test_the_rules_that_changed_by_release():
    """The same load under the releases' rules: memory.weights counted the KV cache until 0.6.1 and the total the
    output layer from 0.6.3; from 0.7.0 the layers go last first, and those left off the GPU count in
    required.full layer by layer; num_ctx's default went 2048 -> 4096 (0.6.7) -> by the GPUs' memory (0.15.5)."""
    model = gguf_model("llama-3.1-8b", "Q4_K_M")
    gpu = [OllamaGPU(5 * GiB)]
    old, new = (estimate_ollama(model, gpu, release=OllamaRelease.parse(v), num_ctx=4096) for v in ("0.5.4", "0.7.1"))
    assert old.weights_total - new.weights_repeating == old.kv   # 0.5.4: blocks + KV; 0.7.1: blocks alone
    assert new.weights_total == new.weights_repeating + new.weights_nonrepeating
    assert old.layers == new.layers == 27   # 27 of 32 blocks; the output layer is left off too
    groups, kv = layer_groups(model), old.kv // 32
    # required.full is what the GPU holds plus what was left off it: 0.5.4 counts the 5 blocks left as 5 of the
    # last one it looked at (blk.31, which Q4_K_M gives more bits); 0.7.1, going last first, each of blk.0-4
    assert old.required_full - old.required_partial == 5 * (groups["blk.31"] + kv) + old.weights_nonrepeating
    assert new.required_full - new.required_partial == sum(groups[f"blk.{i}"] + kv for i in range(5)) + (
        new.weights_nonrepeating)
    assert [default_num_ctx(OllamaRelease.parse(v), 24 * GiB) for v in ("0.5.4", "0.9.0", "0.15.5")] == [
        2048, 4096, 32768]


def test_a_gpu_too_small_for_one_layer_leaves_the_model_on_the_cpu(capsys):
    """Less free memory than the minimum, the graph and two layers: no layer placed, required.partial 0 B (as
    Ollama prints it) and the CPU runner: llama.cpp's buffers all on the CPU."""
    model = gguf_model("llama-3.1-8b", "Q4_K_M")
    estimate = estimate_ollama(model, [OllamaGPU(GiB)], release=OllamaRelease.parse("0.5.4"))
    assert estimate.layers == 0 and estimate.fields()["memory.required.partial"] == "0 B"
    code, out, err = run_cli(capsys, *_estimate("--engine-version", "0.5.4", "--gpu-free", "1024", "--json"))
    assert code == 0, err
    assert json.loads(out)["layers_on_gpu"] == 0 and json.loads(out)["gpu_model_bytes"] == 0


def test_each_release_sizes_the_load_its_own_way(capsys):
    """Up to 0.12.10 the estimate; 0.12.11 to 0.2x the layout; from 0.30 llama-server with --fit, which memfit
    replays (the context Ollama gives it stays; the layers move)."""
    assert [OllamaRelease.parse(v).sizing for v in ("0.3.8", "0.12.10", "0.12.11", "0.24.0", "0.30.0")] == [
        "estimate", "estimate", "layout", "layout", "fit"]
    code, out, _ = run_cli(capsys, *_estimate("--engine-version", "0.20.0", "--gpu", "rtx-3060", "--json"))
    data = json.loads(out)
    assert code == 0 and data["ollama"]["layout"]["layers"] == 33 and data["layers_on_gpu"] == 33
    code, out, err = run_cli(capsys, "estimate", "qwen2.5-32b", "--quant", "Q4_K_M", "--task", "serve", "--engine",
                             "ollama", "--gpu", "rtx-3060", "--json")
    data = json.loads(out)
    assert code == 0, err
    assert data["ollama"]["sizing"] == "fit" and data["fit"]["status"] == "fitted" and data["n_ctx"] == 4096
    assert 0 < data["layers_on_gpu"] < 65 and data["fits"] is True


@pytest.mark.parametrize("version", ["0.5", "v0.5.4", "2024-12"])
def test_a_release_is_named_by_version_or_date(version):
    release = OllamaRelease.at(version) if "-" in version else OllamaRelease.parse(version)
    assert release.version[:2] == (0, 5)


def test_bad_releases_and_sizes_are_refused_plainly(capsys):
    for bad in ("five", "0.x", "1999-01"):
        code, _, err = run_cli(capsys, *_estimate("--engine-version", bad, "--gpu", "rtx-3060"))
        assert code == 2 and "--engine-version" in err and "Traceback" not in err
    with pytest.raises(MemfitError, match="its layout"):
        estimate_ollama(gguf_model("llama-3.1-8b", "Q4_K_M"), [OllamaGPU(GiB)], release=OllamaRelease.parse("0.13"))
    assert [human_bytes(n) for n in (512, 2048, 5 * 2**20, int(6.25 * GiB))] == ["512 B", "2.0 KiB", "5.0 MiB",
                                                                                 "6.2 GiB"]


def test_the_layout_packs_as_few_gpus_as_hold_the_most_layers_evenly():
    """0.12.11's layout (llamaServer.Load on GraphSize's memory): one GPU where the model fits on it; else the layers
    spread over two so that neither is fuller than it must be (the bisection on the capacity factor); a GPU too
    small for all of them takes the last ones, without the output layer if that places more; each GPU used keeps
    the graph besides (its log's lines). R32's two 24 GB GPUs: CUDA0's 11.5 GiB as its log printed."""
    release = OllamaRelease.parse("0.13.0")
    model = gguf_model("llama-3.1-8b", "Q4_K_M")
    alone = layout_ollama(model, [OllamaGPU(23 * GiB), OllamaGPU(23 * GiB)], release=release)
    assert [(g, len(slots)) for g, slots in alone.gpu_layers] == [(0, 33)]
    shared = layout_ollama(model, [OllamaGPU(6 * GiB), OllamaGPU(6 * GiB)], release=release, num_ctx=8192)
    counts = shared.per_gpu(2)
    assert sum(counts) == 33 and abs(counts[0] - counts[1]) <= 3 and shared.gpu_layers[-1][1][-1] == 32
    small = layout_ollama(model, [OllamaGPU(4 * GiB)], release=release)
    slots = small.gpu_layers[0][1]
    assert 0 < len(slots) < 32 and 32 not in slots and slots[-1] == 31   # the last blocks, the output layer off
    assert small.graph == graph_sizes(model, release, 4096, 512, sum(small.layer_cache))[0]   # partial offload
    lines = small.log_lines()
    assert lines[0].startswith('msg="model weights" device=CUDA0 size=') and lines[-1].startswith('msg="total memory"')
    r32 = layout_ollama(gguf_model("mistral-small-24b", "Q8_0"), [OllamaGPU(22 * GiB)] * 2, release=release)
    assert 'msg="model weights" device=CUDA0 size="11.5 GiB"' in r32.log_lines()


def test_a_layout_without_the_output_layer_says_llamacpp_loads_it(capsys):
    """Ollama's layout may leave the output layer off while its runner passes llama.cpp -ngl N, which puts the last N
    slots, the output layer among them, on the GPU: memfit shows llama.cpp's buffers and says so."""
    code, out, err = run_cli(capsys, *_estimate("--engine-version", "0.20.0", "--gpu-free", "4096", "--json"))
    data = json.loads(out)
    assert code == 0, err
    assert data["layers_on_gpu"] == data["ollama"]["layout"]["layers"] > 0
    assert any("output layer off the GPUs" in note for note in data["notes"])


def test_ollamas_flash_attention_and_cache_type(capsys):
    """OLLAMA_FLASH_ATTENTION and OLLAMA_KV_CACHE_TYPE: with flash attention a q8_0 cache is half the f16 one in
    Ollama's estimate (one byte an element) and llama.cpp's 34/32 of that; without it Ollama ignores the type."""
    code, out, err = run_cli(capsys, *_estimate("--engine-version", "0.5.4", "--gpu", "rtx-4090", "--flash-attention",
                                                "on", "--kv-cache-type", "q8_0", "--json"))
    data = json.loads(out)
    assert code == 0, err
    assert data["ollama"]["estimate"]["memory.required.kv"] == "512.0 MiB"
    assert data["gpu_kv_bytes"] == 544 * 2**20
    code, out, _ = run_cli(capsys, *_estimate("--engine-version", "0.5.4", "--gpu", "rtx-4090", "--kv-cache-type",
                                              "q8_0", "--json"))
    data = json.loads(out)
    assert data["gpu_kv_bytes"] == 1024 * 2**20 and any("ignores OLLAMA_KV_CACHE_TYPE" in n for n in data["notes"])


def test_a_plans_modelfile_names_the_servers_environment_it_needs():
    """A llama.cpp plan exported for Ollama: flash attention, the KV cache type and the slots are the server's
    environment, not Modelfile parameters, so the Modelfile is headed by them (without them Ollama before 0.30 runs
    with flash attention off: another compute buffer than the plan's)."""
    from memfit.serving.llamacpp_plan import plan_llamacpp
    from memfit.specs.hardware import get_gpu

    result = plan_llamacpp("llama-3.2-1b", get_gpu("rtx-3060"), host_ram_bytes=16 * GiB, ctx_size=8192,
                           quants=("Q4_K_M",))
    by_kv = {p.settings.cache_type_k: p.modelfile("llama-3.2-1b") for p in result.plans}
    assert by_kv["q8_0"].splitlines()[0] == ("# serve with: OLLAMA_FLASH_ATTENTION=1 OLLAMA_NUM_PARALLEL=1 "
                                             "OLLAMA_KV_CACHE_TYPE=q8_0 ollama serve")
    assert "OLLAMA_KV_CACHE_TYPE" not in by_kv["f16"] and "PARAMETER num_gpu 17" in by_kv["f16"]


def test_an_ollama_plan_takes_the_layers_ollama_chooses(capsys):
    """`memfit plan --engine ollama`: each file type and environment at the layers Ollama's release itself puts on
    the GPU (its estimate here, 0.5.4), llama.cpp's buffers there within the card, the Modelfile to export; the
    llama.cpp planner's names (-c) are refused for it."""
    from memfit.serving.ollama_plan import plan_ollama
    from memfit.specs.hardware import get_gpu

    gpu = get_gpu("rtx-3060")
    release = OllamaRelease.parse("0.5.4")
    result = plan_ollama("qwen2.5-32b", gpu, release, host_ram_bytes=64 * GiB, num_ctx=4096, quants=("Q4_K_M",))
    model = gguf_model("qwen2.5-32b", "Q4_K_M")
    chosen = schedule_ollama(model, [OllamaGPU(gpu.memory_bytes - gpu.context_bytes)], release=release,
                             num_ctx=4096)[0]
    f16 = next(p for p in result.plans if p.settings.flash_attn == "off")
    assert 0 < f16.estimate.layers_on_gpu == chosen.layers < 65 and f16.gpu_bytes <= gpu.memory_bytes
    assert {p.settings.cache_type_k for p in result.plans} == {"f16", "q8_0"}
    code, out, err = run_cli(capsys, "plan", "llama-3.1-8b", "--engine", "ollama", "--engine-version", "0.5.4",
                             "--gpu", "rtx-3060", "--host-ram", "32GiB", "--num-ctx", "8192", "--export", "ollama")
    assert code == 0, err
    assert "PARAMETER num_ctx 8192" in out and "PARAMETER num_gpu 33" in out
    code, _, err = run_cli(capsys, "plan", "llama-3.1-8b", "--engine", "ollama", "--gpu", "rtx-3060", "--host-ram",
                           "32GiB", "-c", "8192")
    assert code == 2 and "--num-ctx" in err


OLLAMA_OOM_LOG = """level=INFO source=memory.go:356 msg="offload to cuda" layers.requested=-1 layers.model=33 \
layers.offload=33 layers.split="" memory.available="[7.6 GiB]" memory.required.full="6.5 GiB"
level=INFO source=server.go:376 msg="starting llama server" cmd="ollama_llama_server runner --model blob \
--ctx-size 32768 --batch-size 512 --n-gpu-layers 33 --threads 8 --parallel 4 --port 41234"
llama_new_context_with_model: n_ctx      = 32768
llama_new_context_with_model: flash_attn = 0
ggml_backend_cuda_buffer_type_alloc_buffer: allocating 2176.00 MiB on device 0: cudaMalloc failed: out of memory
llama_new_context_with_model: failed to allocate compute buffers
"""


def test_explain_oom_reads_ollamas_log_and_answers_in_its_words(tmp_path, capsys):
    """An Ollama log whose load failed on the GPU: its runner's settings (--ctx-size 32768, --parallel 4, 33 layers)
    and the free memory it found (7.6 GiB) read from the log; llama.cpp's buffers there beside what Ollama's own
    estimate expected; the fixes as a Modelfile PARAMETER or the server's environment."""
    log = tmp_path / "ollama.log"
    log.write_text(OLLAMA_OOM_LOG)
    code, out, err = run_cli(capsys, "explain-oom", str(log), "--engine", "ollama", "--engine-version", "0.5.4",
                             "--model", "llama-3.1-8b", "--quant", "Q4_K_M", "--gpu", "rtx-3060", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["buffer"] == "compute" and data["settings"]["num_ctx"] == 8192 and data["settings"]["num_gpu"] == 33
    assert data["gpu_budget_bytes"] == int(7.6 * GiB) and data["gpu_bytes"] > data["gpu_budget_bytes"]
    changes = [f["change"] for f in data["fixes"]]
    assert "OLLAMA_FLASH_ATTENTION=1, OLLAMA_KV_CACHE_TYPE=q8_0" in changes
    assert any(c.startswith("PARAMETER num_gpu ") for c in changes) and all(
        f["gpu_bytes"] <= data["gpu_budget_bytes"] for f in data["fixes"])
    code, _, err = run_cli(capsys, "explain-oom", str(log), "--engine", "ollama", "--model", "llama-3.1-8b",
                           "--quant", "Q4_K_M", "--gpu", "rtx-3060", "-c", "4096")
    assert code == 2 and "Ollama's names" in err


def test_explain_oom_replays_ollamas_system_memory_check(tmp_path, capsys):
    """"model requires more system memory (X) than is available (Y)": X is what Ollama's estimate leaves off the GPU
    (required.full less required.partial); memfit replays it and finds the longest num_ctx and the best file type
    whose X is within Y."""
    from memfit.serving.ollama_load import place, runner_settings
    from memfit.serving.ollama_oom import system_bytes
    from memfit.specs.hardware import get_gpu

    release, gpu = OllamaRelease.parse("0.5.4"), get_gpu("rtx-3060")
    model = gguf_model("qwen2.5-32b", "Q4_K_M")
    settings = runner_settings(release, num_ctx=16384, parallel=4)
    needed = system_bytes(place(model, settings, release, [OllamaGPU(gpu.memory_bytes - gpu.context_bytes)])[2])
    available = needed - 2 * GiB
    log = tmp_path / "ollama.log"
    log.write_text(f"Error: model requires more system memory ({needed / GiB:.1f} GiB) than is available "
                   f"({available / GiB:.1f} GiB)\n")
    code, out, err = run_cli(capsys, "explain-oom", str(log), "--engine", "ollama", "--engine-version", "0.5.4",
                             "--model", "qwen2.5-32b", "--quant", "Q4_K_M", "--gpu", "rtx-3060", "--num-ctx", "16384",
                             "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["buffer"] == "host" and data["system_bytes"] == needed
    context = next(f for f in data["fixes"] if f["change"].startswith("PARAMETER num_ctx"))
    assert int(context["change"].split()[-1]) < 16384 and context["system_bytes"] <= data["available_bytes"]
    assert any(f["change"].startswith("a ") for f in data["fixes"])


def test_gemma3s_image_encoder_is_counted_as_ollama_counts_it():
    """Gemma 3's SigLIP encoder (the catalog's vision_config): with the multimodal projection its parameters are the
    checkpoints' published figure for 4B, 12B and 27B; Ollama's estimate counts its v.* tensors (795.9 MiB for
    12B, R31's log) and its graph (1.0 GiB), from 0.7.1 with the output layer, which then leaves one slot off an
    11.1 GiB GPU (R31: 48 of 49)."""
    from memfit.specs.model_configs import find_config

    for name in ("gemma-3-4b", "gemma-3-12b", "gemma-3-27b"):
        found, vision = find_config(name), gguf_model(name, "Q4_K_M").vision
        embd, ff = vision.n_embd, vision.n_ff
        encoder = vision.n_layer * (4 * embd * embd + 2 * embd * ff + 4 * embd + 4 * embd + ff + embd) \
            + vision.channels * vision.patch_size ** 2 * embd + embd + (vision.image_size // vision.patch_size) ** 2 \
            * embd + 2 * embd
        projection = embd * found.hf_config["hidden_size"] + embd   # mm input projection and its norm
        assert encoder + projection == found.doc["published_includes"]["vision tower and projector"], name
    release = OllamaRelease.parse("0.11.7")
    weights, graph = projector(gguf_model("gemma-3-12b", "Q4_K_M"), release)
    assert (human_bytes(weights), human_bytes(graph)) == ("795.9 MiB", "1.0 GiB")
    assert projector(gguf_model("gemma-3-12b", "Q4_K_M"), OllamaRelease.parse("0.6.0")) == (0, 0)
    assert projector(gguf_model("qwen2.5-7b", "Q4_K_M"), release) == (0, 0)


def test_a_notebook_asks_for_ollamas_load():
    """memfit.serving.estimate_gguf(..., engine="ollama", version=...): Ollama's names, its own choice of layers
    (its estimate's log line first in the notes), llama.cpp's buffers at it; llama.cpp's names refused there."""
    from memfit.serving import estimate_gguf

    result = estimate_gguf("llama-3.1-8b", engine="ollama", version="0.5.4", quant="Q4_K_M", gpu="rtx-4090",
                           num_ctx=2048)
    assert "memory.required.full=\"6.5 GiB\"" in result.notes[0] and result.n_ctx == 8192
    assert result.layers_on_gpu == 33 and result.kv.bytes == 1 << 30
    layout = estimate_gguf("llama-3.1-8b", engine="ollama", version="0.20", quant="Q4_K_M", gpu="rtx-3060")
    assert layout.notes[0].startswith("Ollama 0.20.0's layout: msg=\"model weights\" device=CUDA0")
    with pytest.raises(MemfitError, match="unknown Ollama setting"):
        estimate_gguf("llama-3.1-8b", engine="ollama", quant="Q4_K_M", ctx_size=4096)
