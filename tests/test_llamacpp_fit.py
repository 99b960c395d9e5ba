"""llama.cpp's --fit replayed on memfit's buffers (serving/llamacpp_fit.py): against published fit logs, the rules
of common/fit.cpp, and the command line."""
import json
import os
from dataclasses import replace

import pytest

from memfit.core.errors import MemfitError
from memfit.core.units import MiB
from memfit.serving.llamacpp import LlamaCppSettings, estimate_llamacpp, gguf_model
from memfit.serving.llamacpp_fit import FIT_TARGET, _step, fit_llamacpp, parse_overrides
from tests.conftest import LLAMA_FLAGS, benchmark, run_cli


@pytest.fixture(scope="module")
def qwen7b():
    return gguf_model("qwen2.5-7b", "Q4_K_M")


def test_published_fit_logs_are_replayed(qwen7b):
    """R13 and R14 (Qwen2.5-7B Q4_K_M, a 6 GB card with 5752 MiB free, a 2026-09 build): at 4096 tokens the fit
    projects 4696 MiB and changes nothing (1055 MiB left >= 1024); at -c 8192 it projects 4920 MiB and moves layers
    until 27 of the 29 slots remain, as the log's "offloaded 27/29 layers to GPU" says."""
    settings = LlamaCppSettings(ctx_size=4096, engine_version="2026-09")
    fit = fit_llamacpp(qwen7b, settings, free=[5752 * MiB])
    assert fit.status == "unchanged" and fit.settings == settings
    assert "projected to use 4696 MiB of device memory vs. 5752 MiB free" in fit.steps[0]
    fit = fit_llamacpp(qwen7b, replace(settings, ctx_size=8192), free=[5752 * MiB])
    assert fit.status == "fitted" and fit.settings.n_gpu_layers == 27 and fit.settings.ctx_size == 8192
    assert "projected to use 4920 MiB" in fit.steps[0] and "set by user" in fit.steps[1]
    assert fit.arguments() == "-c 8192 -ngl 27"


def test_a_fit_that_fails_still_shrinks_the_context():
    """R23 (Qwen2.5-32B Q4_K_M, a ROCm card with 20252 MiB free, -ngl 999, the file's 32768-token context): the log
    projects 27091 MiB, shrinks the context to 4096 (7252 MiB less, so 19839 MiB: not enough for 19228) and aborts
    because -ngl was given; llama.cpp then loads at 4096 tokens. memfit's 4096-token projection is the log's to the
    MiB; at 32768 its compute buffer is 84 MiB short of ROCm's (0.3 % of the projection)."""
    model = replace(gguf_model("qwen2.5-32b", "Q4_K_M"), n_ctx_train=32768)
    fit = fit_llamacpp(model, LlamaCppSettings(n_gpu_layers=999), free=[20252 * MiB])
    assert fit.status == "failed" and fit.reason == "n_gpu_layers already set by user to 999"
    assert fit.settings.ctx_size == 4096 and fit.settings.n_gpu_layers == 999
    projected = int(fit.steps[0].split("use ")[1].split(" MiB")[0])
    assert abs(projected - 27091) / 27091 < 0.005
    least = estimate_llamacpp(model, fit.settings, gpus=1).buffers["GPU0"].total // MiB
    assert least == 27091 - 7252


def test_the_layers_it_keeps_are_the_most_that_fit(qwen7b):
    """A dense model on two GPUs: each keeps its target free, and one more layer slot on either would not fit; the
    split is given as layer counts (-ts) and -ngl is their sum, as llama-fit-params prints them."""
    free = [3000 * MiB, 2500 * MiB]
    fit = fit_llamacpp(qwen7b, LlamaCppSettings(ctx_size=16384), free=free)
    counts = [int(share) for share in fit.settings.tensor_split]
    assert fit.status == "fitted" and sum(counts) == fit.settings.n_gpu_layers < qwen7b.n_layer + 1
    used = estimate_llamacpp(qwen7b, fit.settings, gpus=2)
    assert all(used.buffers[f"GPU{i}"].total <= free[i] - FIT_TARGET for i in range(2))
    for device in range(2):
        more = [c + (i == device) for i, c in enumerate(counts)]
        bigger = estimate_llamacpp(qwen7b, replace(fit.settings, n_gpu_layers=sum(more),
                                                   tensor_split=tuple(map(float, more))), gpus=2)
        assert bigger.buffers[f"GPU{device}"].total > free[device] - FIT_TARGET
    assert fit.arguments().startswith(f"-c 16384 -ngl {sum(counts)} -ts {counts[0]},{counts[1]}")


def test_a_mixture_keeps_every_layer_and_sends_experts_to_the_cpu():
    """Qwen3-30B-A3B on a 12 GB card: every layer slot stays on the GPU; the fit overrides the experts of the last
    layers to the CPU with fit.cpp's own patterns (the first partial layer may keep part of its FFN), within the
    target, and the overrides move exactly those weights (the experts of the last layers, not the first's)."""
    model = gguf_model("qwen3-30b-a3b", "Q4_K_M")
    free = [12 * 1024 * MiB - 500 * MiB]
    fit = fit_llamacpp(model, LlamaCppSettings(ctx_size=8192), free=free)
    assert fit.status == "fitted" and fit.settings.n_gpu_layers == model.n_layer + 1
    patterns = [pattern for pattern, device in fit.settings.override_tensor]
    assert all(device == "CPU" for _, device in fit.settings.override_tensor)
    # fit.cpp numbers the output slot as a layer: its last pattern names a block the model does not have
    assert patterns[-1] == rf"blk\.{model.n_layer}\.ffn_(up|down|gate_up|gate)_(ch|)exps"
    used = estimate_llamacpp(model, fit.settings, gpus=1)
    assert used.buffers["GPU0"].total <= free[0] - FIT_TARGET
    on_cpu = {name for name, device in used.placement.items() if device == "CPU" and name.startswith("blk.")}
    assert on_cpu and all("ffn" in name for name in on_cpu)
    assert f"blk.{model.n_layer - 1}.ffn_up_exps.weight" in on_cpu and "blk.0.ffn_up_exps.weight" not in on_cpu


def test_an_unset_context_shrinks_to_a_multiple_of_256_and_not_below_fit_ctx(qwen7b):
    """The training context (131072) does not fit a 12 GB card: the fit interpolates a context between it and
    --fit-ctx, rounded down to 256, and stops there on one GPU; -c 0 (the full context asked for) is never shrunk."""
    fit = fit_llamacpp(qwen7b, LlamaCppSettings(), free=[11 * 1024 * MiB])
    assert fit.status == "fitted" and 4096 < fit.settings.ctx_size < 131072 and fit.settings.ctx_size % 256 == 0
    assert fit.settings.n_gpu_layers == -1
    full = fit_llamacpp(qwen7b, LlamaCppSettings(), free=[11 * 1024 * MiB], n_ctx_min=None)
    assert full.settings.ctx_size == 131072 and full.settings.n_gpu_layers < qwen7b.n_layer + 1
    alone = fit_llamacpp(qwen7b, LlamaCppSettings(), free=[], host_total=12 * 1024 * MiB)
    assert alone.status == "fitted" and alone.settings.ctx_size < 131072
    tiny = fit_llamacpp(qwen7b, LlamaCppSettings(), free=[], host_total=4 * 1024 * MiB)
    assert tiny.status == "failed" and "system memory" in tiny.reason and tiny.settings.ctx_size == 4096


def test_the_false_position_step_keeps_cpp_arithmetic():
    """fit.cpp stores the int64 step in a uint32_t: a negative one wraps, and the clamp then takes delta - 1."""
    assert _step(10, 500, 100, 900) == 5
    assert _step(10, 0, 1000, 1800) == 9    # the target below the low measurement: -12 wraps, clamped
    assert _step(10, 50, 100, 900) == 1     # -0.625 truncates to 0, raised to 1
    assert _step(2, 500, 100, 900) == 1


def test_override_tensor_moves_the_weights_it_names():
    model = gguf_model("qwen3-30b-a3b", "Q4_K_M")
    settings = LlamaCppSettings(ctx_size=4096, override_tensor=parse_overrides("exps=CPU"))
    estimate = estimate_llamacpp(model, settings, gpus=1)
    assert {d for n, d in estimate.placement.items() if "_exps" in n} == {"CPU"}
    assert {d for n, d in estimate.placement.items() if n.startswith("blk.") and "_exps" not in n} == {"GPU0"}
    assert parse_overrides(r"blk\.1\.=CUDA1,x=Vulkan0") == ((r"blk\.1\.", "GPU1"), ("x", "GPU0"))
    for bad in ("exps", "exps=NPU0"):
        with pytest.raises(MemfitError):
            parse_overrides(bad)
    with pytest.raises(MemfitError, match="GPU"):
        estimate_llamacpp(model, replace(settings, override_tensor=(("exps", "GPU1"),)), gpus=1)


def test_the_command_line_shows_the_fit(capsys):
    """A new user's runs: the fit's steps and what llama.cpp loads with, the verdict against the free memory, the
    command as given (llama.cpp fits the rest itself); --fit off estimates the settings as given; bad input: one
    line each."""
    code, out, err = run_cli(capsys, "estimate", "qwen2.5-7b", "--quant", "Q4_K_M", "--task", "serve", "--engine",
                         "llama.cpp", "--gpu-free", "5752", "-c", "8192", "--engine-version", "2026-09", "--json")
    data = json.loads(out)
    assert code == 0, err
    assert data["fit"]["status"] == "fitted" and data["fit"]["arguments"] == "-c 8192 -ngl 27"
    assert data["layers_on_gpu"] == 27 and data["fits"] is True and data["gpu_free_bytes"] == [5752 * MiB]
    assert data["command"] == "llama-server -m MODEL.gguf -c 8192"
    code, out, _ = run_cli(capsys, "estimate", "qwen2.5-7b", "--quant", "Q4_K_M", "--task", "serve", "--engine",
                       "llama.cpp", "--gpu", "rtx-3060", "--host-ram", "16GiB")
    out = " ".join(out.split())
    assert code == 0 and "context size reduced from 131072" in out and "fits: free on the GPU(s)" in out
    code, out, _ = run_cli(capsys, "estimate", "qwen2.5-7b", "--quant", "Q4_K_M", "--task", "serve", "--engine",
                       "llama.cpp", "--gpu", "rtx-3060", "-fit", "off", "--json")
    data = json.loads(out)
    assert code == 0 and data["fit"] is None and data["fits"] is False and data["n_ctx"] == 131072
    assert data["gpu_total_bytes"] > data["gpu_buffers_bytes"]
    code, out, _ = run_cli(capsys, "estimate", "qwen3-30b-a3b", "--quant", "Q4_K_M", "--task", "serve", "--engine",
                       "llama.cpp", "--gpus", "1", "-ot", "exps=CPU", "-c", "4096", "--json")
    data = json.loads(out)
    assert code == 0 and data["command"].endswith('--override-tensor "exps=CPU"')
    assert {w for w in data["command"].split() if w.startswith("-")} <= LLAMA_FLAGS
    assert any("--gpu NAME or --gpu-free" in note for note in data["notes"])
    for argv, message in ((["-ot", "exps"], "PATTERN=BUFFER"), (["-fit", "maybe"], "on or off"),
                          (["--gpu", "rtx-3060", "--gpu-free", "5000"], "--gpu or --gpu-free"),
                          (["--gpu-free", "0"], "more than 0")):
        code, _, err = run_cli(capsys, "estimate", "qwen2.5-7b", "--quant", "Q4_K_M", "--task", "serve", "--engine",
                           "llama.cpp", *argv)
        assert code == 2 and message in err, (argv, err)


def _fit_run():
    return benchmark("llamacpp_fit_run")


def test_fits_and_split_graphs_recorded_from_real_llamacpp_runs_here():
    """llama.cpp's own llama-fit-params fitting tiny models to fake GPUs here (RPC devices of a chosen memory:
    benchmarks/llamacpp_fit_run.py's record): memfit's replay gives the same context, -ngl, split and overrides in
    every case, and projects the GPUs' use to the MiB its trace prints. Each device's compute buffer for a graph split
    between the GPUs and the CPU (layers, a mixture's experts, tensor overrides, two GPUs, two GPUs pipelining every
    layer) equals llama.cpp's to its log's 0.01 MiB."""
    bench = _fit_run()
    with open(bench.RESULT) as fh:
        recorded = json.load(fh)
    rows = [bench.compare(case) for case in recorded["cases"]]
    assert len(rows) >= 17 and all(row["same"] for row in rows), [row for row in rows if not row["same"]]
    assert all(row["projected_mib"] == row["memfit_projected_mib"] for row in rows)
    splits = [bench.compare_split(case) for case in recorded["splits"]]
    assert len(splits) >= 16 and all(split["same"] for split in splits), [s for s in splits if not s["same"]]
    assert {name for split in splits for name in split["compute_mib"]} == {"CPU", "GPU0", "GPU1"}
    # real loads (llama-batched-bench) with --no-kv-offload: the attention's output set to the CPU (without flash
    # attention the scores stay there; with it the GPU copies the cache in), each device as allocated
    loads = [bench.compare_split(case) for case in recorded["loads"]]
    assert len(loads) >= 8 and all(load["same"] for load in loads), [s for s in loads if not s["same"]]


@pytest.mark.skipif(not os.path.exists(os.path.join(_fit_run().TOOLS, "build", "bin", "llama-batched-bench")),
                    reason="llama.cpp's fit tools are not built: bash scripts/setup_llamacpp_fit.sh (CI builds them)")
def test_llamacpp_fits_here_as_memfit_replays_it(tmp_path):
    """Live: llama.cpp's own fit on fake GPUs now (a shrunk context, layers moved, a mixture's experts sent to the
    CPU, two GPUs) gives the arguments memfit's replay gives, a split graph the compute buffers memfit gives, and a
    real load with --no-kv-offload the buffers memfit gives."""
    bench = _fit_run()
    for model, free_mib, arguments in (("dense", [100], "-fitt 1 -fitc 256"), ("dense", [40], "-c 4096 -fitt 1"),
                                       ("moe", [90], "-c 4096 -fitt 1"), ("dense", [20, 30], "-c 4096 -fitt 1")):
        row = bench.compare(bench.run_case(str(tmp_path), model, free_mib, arguments))
        assert row["same"], row
    split = bench.compare_split(bench.run_case(str(tmp_path), "moe", [400], "-c 4096 -ncmoe 3", split=True))
    assert split["same"] and set(split["compute_mib"]) == {"CPU", "GPU0"}, split
    load = bench.compare_split(bench.run_case(str(tmp_path), "dense", [400], "-c 2048 -ngl 3 -nkvo -fa off", load=True))
    assert load["same"] and set(load["compute_mib"]) == {"CPU", "GPU0"}, load
