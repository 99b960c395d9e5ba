"""memfit's llama.cpp planner (`memfit plan MODEL --engine llama.cpp`): the file type, KV cache and split that fit a
card and the host, each with its speed, and the commands it exports."""
import json

from tests.conftest import LLAMA_FLAGS, benchmark, run_cli


def test_a_32b_on_a_12_gb_card_plans_a_partial_offload_with_its_speed(capsys):
    """The issue's case: Qwen2.5-32B on an RTX 3060 with 32 GiB of RAM at 8192 tokens. Every plan leaves llama.cpp's
    fit margin on the card and the system's share of the RAM, splits the layers (no 32B file fits 12 GB), and gets
    faster as its file gets smaller; the exported command uses only flags llama.cpp's argument parser has."""
    from memfit.serving.llamacpp_fit import FIT_TARGET
    from memfit.serving.llamacpp_plan import HOST_RESERVE

    code, out, err = run_cli(capsys, "plan", "qwen2.5-32b", "--engine", "llama.cpp", "--gpu", "rtx-3060", "--host-ram",
                         "32GiB", "--ctx-size", "8192", "--json", "--top", "30")
    data = json.loads(out)
    assert code == 0 and data["feasible"] and data["plans"], err
    for plan in data["plans"]:
        assert 0 < plan["n_gpu_layers"] < plan["layer_slots"] and plan["decode_tokens_per_s"] > 0
        assert plan["gpu_bytes"] <= 11.76 * 2**30 - FIT_TARGET and plan["host_bytes"] <= 32 * 2**30 - HOST_RESERVE
    quality = [p["ppl_increase"] for p in data["plans"]]
    assert quality == sorted(quality)
    f16_kv = {p["quant"]: p for p in data["plans"] if p["cache_type_k"] == "f16"}
    assert f16_kv["Q4_K_M"]["decode_tokens_per_s"] > f16_kv["Q8_0"]["decode_tokens_per_s"]
    assert f16_kv["Q4_K_M"]["n_gpu_layers"] > f16_kv["Q8_0"]["n_gpu_layers"]
    code, out, _ = run_cli(capsys, "plan", "qwen2.5-32b", "--engine", "llama.cpp", "--gpu", "rtx-3060", "--host-ram",
                       "32GiB", "--ctx-size", "8192", "--export", "llama-server")
    words = out.split()
    assert code == 0 and words[0] == "llama-server"
    assert {w for w in words if w.startswith("-")} <= LLAMA_FLAGS, words


def test_a_host_too_small_names_the_ram_that_would_do(capsys):
    code, out, _ = run_cli(capsys, "plan", "llama-3.1-70b", "--engine", "llama.cpp", "--gpu", "rtx-3060", "--host-ram",
                       "16GiB", "-c", "8192", "--json")
    data = json.loads(out)
    assert code == 0 and not data["feasible"] and "--host-ram" in data["reason"]
    needed = int(data["reason"].split("--host-ram ")[1].split("GiB")[0])
    code, out, _ = run_cli(capsys, "plan", "llama-3.1-70b", "--engine", "llama.cpp", "--gpu", "rtx-3060", "--host-ram",
                       f"{needed}GiB", "-c", "8192", "--json")
    assert json.loads(out)["feasible"]


def test_the_planners_stated_speed_errors_are_the_ones_it_computes():
    """SPEED_SOURCE (what the plan prints beside its speeds) quotes the speed model against the published llama-bench
    runs (benchmarks/published_llamabench.py); the quoted figures are recomputed here, so they cannot drift from the
    model. Generating is held to the calibration's own rows, and to the held-out ones within a third."""
    from memfit.serving.llamacpp_plan import SPEED_SOURCE

    bench = benchmark("published_llamabench")
    totals = bench.summary(bench.run())
    calibrated, held_out = totals["tg_calibrated"], totals["tg_held_out"]
    prompt, prompt_held_out = totals["pp_calibrated"], totals["pp_held_out"]
    assert f"mean |error| {calibrated['mean_abs_error']:.0%} on the {calibrated['rows']} rows".replace(
        "%", " %") in SPEED_SOURCE
    assert f"{held_out['mean_abs_error']:.0%} on {held_out['rows']} others".replace("%", " %") in SPEED_SOURCE
    assert (f"a prompt, {prompt['mean_abs_error']:.0%} on {prompt['rows']} and {prompt_held_out['mean_abs_error']:.0%} "
            f"on {prompt_held_out['rows']} other").replace("%", " %") in SPEED_SOURCE
    assert calibrated["mean_abs_error"] <= 0.10 and held_out["mean_abs_error"] <= 0.33 and calibrated["rows"] >= 15
    assert prompt["mean_abs_error"] <= 0.10 and prompt_held_out["mean_abs_error"] <= 0.25


def test_a_mixture_of_experts_plan_keeps_its_experts_on_the_cpu_and_reads_only_those_a_token_uses(capsys):
    """Qwen3-30B-A3B on an RTX 3060: every layer on the GPU with the first layers' experts on the CPU (--n-cpu-moe)
    beats splitting whole layers (-ngl) for the same file, since a token reads only 8 of the 128 experts; the
    command llama-server is given uses only its own flags; Ollama has no such parameter, and the export says so."""
    code, out, err = run_cli(capsys, "plan", "qwen3-30b-a3b", "--engine", "llama.cpp", "--gpu", "rtx-3060",
                             "--host-ram", "32GiB", "-c", "8192", "--json", "--top", "40")
    data = json.loads(out)
    assert code == 0 and data["feasible"], err
    q4 = [p for p in data["plans"] if p["quant"] == "Q4_K_M" and p["cache_type_k"] == "f16"]
    experts, layers = sorted(q4, key=lambda p: -p["n_cpu_moe"])
    assert experts["n_gpu_layers"] == 49 and 0 < experts["n_cpu_moe"] < 48 and layers["n_gpu_layers"] < 49
    assert experts["decode_tokens_per_s"] > layers["decode_tokens_per_s"] and experts["modelfile"] is None
    assert {w for w in experts["command"].split() if w.startswith("-")} <= LLAMA_FLAGS
    code, _, err = run_cli(capsys, "plan", "qwen3-30b-a3b", "--engine", "llama.cpp", "--gpu", "rtx-3060", "--host-ram",
                       "32GiB", "-c", "8192", "--export", "ollama")
    assert code == 2 and "--export llama-server" in err


def test_a_plan_over_two_gpus_holds_what_one_cannot(capsys):
    """Llama-3.1-70B on RTX 3090s at 8192 tokens: two cards (llama.cpp splits the layers equally) hold about twice
    the layer slots of one, each card within the fit margin, and the split is faster."""
    from memfit.serving.llamacpp_fit import FIT_TARGET

    def plan_on(gpus: str) -> dict:
        code, out, err = run_cli(capsys, "plan", "llama-3.1-70b", "--engine", "llama.cpp", "--gpu", "rtx-3090",
                                 "--gpus", gpus, "--host-ram", "64GiB", "-c", "8192", "--json", "--top", "40")
        assert code == 0, err
        return {(p["quant"], p["cache_type_k"]): p for p in json.loads(out)["plans"]}

    one, two = plan_on("1"), plan_on("2")
    for key in ("Q8_0", "f16"), ("Q6_K", "f16"):
        assert two[key]["gpus"] == 2 and two[key]["n_gpu_layers"] >= 2 * one[key]["n_gpu_layers"] - 2
        assert two[key]["gpu_bytes"] <= 23.58 * 2**30 - FIT_TARGET
        assert two[key]["decode_tokens_per_s"] > one[key]["decode_tokens_per_s"]
