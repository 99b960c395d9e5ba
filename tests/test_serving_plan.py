"""`memfit plan MODEL --task serve` (memfit.serving.planner): the engine setups that serve C users at a context of L
tokens, the cheapest (or fastest) first, each with its launch command; the way out when nothing fits."""
import json

import yaml

from memfit.cli.main import main

VLLM_FLAGS = {"--max-model-len", "--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
              "--gpu-memory-utilization", "--max-num-seqs", "--kv-cache-dtype", "--enforce-eager", "--quantization"}


def plan(capsys, *argv):
    code = main(["plan", *argv, "--task", "serve", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_70b_at_32k_for_16_users_on_h100s_takes_tensor_parallel(capsys):
    code, out = plan(capsys, "llama-3.1-70b", "--engine", "vllm", "--max-model-len", "32768", "--concurrency", "16",
                     "--gpu", "h100")
    assert code == 0 and out["feasible"]
    best = out["plans"][0]
    assert best["tensor_parallel"] > 1 and best["max_concurrency"] >= 16
    words = best["engine_args"].split()
    assert words[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-70B"]
    assert {w for w in words if w.startswith("--")} <= VLLM_FLAGS
    assert f"--tensor-parallel-size {best['tensor_parallel']}" in best["engine_args"]
    for key in ("request_throughput", "output_tokens_per_s", "mean_ttft_ms", "mean_tpot_ms", "kv_cache_tokens"):
        assert best[key] > 0


def test_a_70b_in_bf16_on_one_4090_is_refused_with_the_way_out(capsys):
    code, out = plan(capsys, "llama-3.1-70b", "--engine", "vllm", "--max-model-len", "8192", "--concurrency", "4",
                     "--gpu", "rtx-4090", "--gpus", "1")
    assert code == 0 and not out["feasible"] and out["plans"] == []
    assert "No available memory for the cache blocks" in out["reason"] and "--gpus 8" in out["reason"]
    # too many users for one L4 at 32k: the longest context and the most users that would fit
    _, out = plan(capsys, "llama-3.1-8b", "--engine", "vllm", "--max-model-len", "32768", "--concurrency", "64",
                  "--gpu", "l4", "--gpus", "1")
    assert "--max-model-len " in out["reason"] and "--concurrency 1 " in out["reason"]


def test_priced_machines_cheapest_per_million_output_tokens_first(capsys):
    code, out = plan(capsys, "qwen3-8b", "--engine", "vllm", "--max-model-len", "8192", "--concurrency", "32",
                     "--instance", "any", "--top", "10")
    costs = [p["usd_per_million_output_tokens"] for p in out["plans"]]
    assert code == 0 and len(costs) >= 3 and costs == sorted(costs) and all(c > 0 for c in costs)
    assert all(p["usd_per_hour"] and p["price"]["source"] for p in out["plans"])
    hourly = out["plans"][0]["usd_per_hour"]
    assert out["plans"][0]["usd_per_million_output_tokens"] == \
        hourly / (out["plans"][0]["output_tokens_per_s"] * 3600) * 1e6


def test_lossy_plans_name_their_accuracy_cost_and_their_checkpoint(capsys):
    _, lossless = plan(capsys, "qwen3-32b", "--engine", "vllm", "--max-model-len", "16384", "--concurrency", "24",
                       "--gpu", "l40s")
    _, lossy = plan(capsys, "qwen3-32b", "--engine", "vllm", "--max-model-len", "16384", "--concurrency", "24",
                    "--gpu", "l40s", "--allow", "lossy")
    assert all(not p["accuracy_cost"] for p in lossless["plans"])
    best = lossy["plans"][0]
    assert best["gpus"] < lossless["plans"][0]["gpus"] and best["accuracy_cost"]
    if best["quantization"] == "awq":
        assert "Qwen/Qwen3-32B-AWQ" in best["engine_args"]
    if best["quantization"] == "fp8":
        assert "--quantization fp8" in best["engine_args"]
    if best["kv_cache_dtype"] == "fp8":
        assert "--kv-cache-dtype fp8" in best["engine_args"]


def test_service_levels_and_exports(capsys, tmp_path):
    base = ["llama-3.1-8b", "--engine", "vllm", "--max-model-len", "4096", "--concurrency", "8", "--gpu", "h100"]
    _, out = plan(capsys, *base, "--max-tpot-ms", "0.5")
    assert not out["feasible"] and "none meets the service levels" in out["reason"]
    _, out = plan(capsys, *base, "--max-tpot-ms", "50", "--max-ttft-ms", "5000")
    assert out["feasible"] and all(p["mean_tpot_ms"] <= 50 for p in out["plans"])
    manifest = tmp_path / "deploy.yaml"
    assert main(["plan", *base, "--task", "serve", "--export", "kubernetes", "--out", str(manifest)]) == 0
    capsys.readouterr()
    deployment = yaml.safe_load(manifest.read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["kind"] == "Deployment" and container["command"] == ["vllm", "serve"]
    assert container["args"][0] == "meta-llama/Llama-3.1-8B" and container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    for argv, message in ((["--export", "sglang"], "plan with --engine sglang"), (["--out", "x"], "--out writes"),
                          (["--concurrency", "0"], "--concurrency must be a positive"),
                          (["--input-len", "4000", "--output-len", "200"], "must fit in --max-model-len")):
        assert main(["plan", *base, "--task", "serve", *argv]) == 2
        assert message in capsys.readouterr().err
