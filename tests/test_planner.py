"""memfit plan: known recipes found (or refused with the reason), plans that are what they claim, JSON, CLI."""
import dataclasses
import json

import pytest

from memfit import get_gpu
from memfit.cli.main import main
from memfit.core.units import GiB, TiB
from memfit.estimators.analytic import analytic_estimate, regions_of, simulate
from memfit.estimators.extrapolate import peak_of
from memfit.planner import PlanRequest, load_plan, plan
from memfit.planner.search import device_bytes
from memfit.specs.instances import get_instance
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import rel


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def check_plans(result):
    """What every plan claims holds: it fits the budget, its micro-batches make up the batch, and its saved
    workload estimated again gives the same peak."""
    request = result.request
    for index, chosen in enumerate(result.plans):
        data = result.plan_json(index)
        assert data["peak_bytes"] <= request.budget_bytes
        replicas = chosen.candidate.data_parallel
        assert data["micro_batch"] * data["grad_accum"] * replicas == request.sequences
        workload = ResolvedWorkload.from_json(data["workload"])
        again = analytic_estimate(workload, request.gpu)
        assert device_bytes(again) == data["peak_bytes"]   # an allocator technique it needs is in its workload
    times = [p.time.total_s for p in result.plans]
    if request.objective == "fastest":   # plans near the fastest first (least change first), then the rest by time
        near = min(times) * (1 + request.speed_margin)
        rest = [t for t in times if t > near]
        assert times[0] <= near and rest == sorted(rest) and times[len(times) - len(rest):] == rest


def test_full_finetune_of_an_8b_model_fits_one_24gb_gpu():
    # torchtune fits it with bf16, paged 8-bit AdamW, checkpointing, optimizer-in-backward, chunked CE; memfit
    # must find a full fine-tune (no adapters, nothing lossy) that fits
    request = PlanRequest(model="llama-3.1-8b", gpu=get_gpu("rtx-4090"), seq_len=4096, global_batch=64,
                          host_ram_bytes=256 * GiB)
    result = plan(request)
    assert result.feasible and result.reason is None
    check_plans(result)
    for chosen in result.plans:
        assert chosen.risk != "lossy"
        assert not {"lora", "qlora"} & {t.split(":")[0] for t in chosen.techniques}
        assert chosen.host_ram_bytes <= 256 * GiB
    assert result.savings and all(row["saved_bytes"] > 0 for row in result.savings[0])


def test_llama_7b_on_eight_a100s():
    request = PlanRequest(model="llama-2-7b", gpu=get_gpu("a100-80gb"), num_gpus=8, seq_len=4096, global_batch=64)
    result = plan(request)
    assert result.feasible
    check_plans(result)
    assert all(p.candidate.num_gpus == 8 for p in result.plans)
    assert result.plans[0].risk != "lossy"


def test_offload_plans_respect_host_ram():
    request = PlanRequest(model="llama-3.1-8b", gpu=get_gpu("rtx-4090"), seq_len=4096, global_batch=8,
                          host_ram_bytes=1 * TiB)
    generous = plan(request, brief=True)
    assert generous.feasible and generous.plans[0].host_ram_bytes > 64 * GiB   # the GPU alone cannot hold it
    assert all(p.host_ram_bytes <= TiB for p in generous.plans)
    # a host too small for them: the torchtune 4090 test below (the demo's shape on 64 GiB)


def test_lossy_plans_only_when_allowed_and_within_the_accuracy_budget():
    gpu = get_gpu("l4")
    lossless = plan(PlanRequest(model="mistral-7b", gpu=gpu, task="inference", batch_size=4, seq_len=2048,
                                new_tokens=64))
    assert lossless.feasible and all(p.risk != "lossy" for p in lossless.plans)
    budget = plan(PlanRequest(model="mistral-7b", gpu=gpu, task="inference", batch_size=4, seq_len=2048,
                              new_tokens=64, allow="lossy", max_ppl_increase=0.005))
    assert budget.feasible
    assert all(p.ppl_increase is not None and p.ppl_increase <= 0.005 for p in budget.plans)
    # int8 weights halve the bytes every decoded token reads: faster than bf16 on a bandwidth-bound decode
    assert any("int8-weight-only" in p.techniques for p in budget.plans)
    assert budget.plans[0].time.total_s < lossless.plans[0].time.total_s


def test_lora_rank_and_targets_are_plan_variables_with_their_measured_costs():
    """--allow lossy searches LoRA at its defaults, at rank 64 and on every linear; a perplexity budget keeps the
    variants whose measured cost is within it (benchmarks/technique_table.py --part 2: +4.0 %, +3.8 %, +1.5 %)."""
    from dataclasses import replace

    request = PlanRequest(model="llama-3.2-1b", gpu=get_gpu("t4"), seq_len=2048, global_batch=8,
                          allow="lossy", max_ppl_increase=0.02)   # the variants and their costs do not depend on size

    def adapters(result):
        return {t for p in result.evaluated for t in p.techniques if t.startswith("lora")}

    assert adapters(plan(replace(request, max_ppl_increase=None), brief=True)) == {
        "lora", "lora:rank=64", "lora:targets=all-linear"}
    budget = plan(request, brief=True)
    assert adapters(budget) == {"lora:targets=all-linear"}
    assert budget.plans[0].ppl_increase <= 0.02
    # the analytic model has adapters for decoder families only: GPT-2's LoRA candidates are refused, not a crash
    gpt2 = plan(PlanRequest(model="tiny-gpt2", gpu=get_gpu("t4"), seq_len=256, global_batch=8, allow="lossy"),
                brief=True)
    assert gpt2.feasible and any("decoder families" in reason for reason in gpt2.rejected)


def test_objective_smallest_orders_by_memory():
    request = PlanRequest(model="tiny-llama", gpu=get_gpu("t4"), seq_len=256, global_batch=8, objective="smallest")
    result = plan(request)
    peaks = [p.device_bytes for p in result.plans]
    assert result.feasible and peaks == sorted(peaks)


def test_pipeline_estimate_is_the_highest_rank():
    # the analytic estimate simulates the first and last pipeline ranks only; every rank must be below them
    workload = ResolvedWorkload(model="llama-3.1-8b", task="train", batch_size=6, seq_len=512, world_size=3,
                        precision="bf16-mixed", techniques=("pipeline-parallel:microbatches=3", "checkpointing"))
    layers = workload.source.num_layers
    every_rank = [peak_of(regions_of(simulate(workload, None, layers, None, rank), layers, layers))[0].total
                  for rank in range(3)]
    assert analytic_estimate(workload).peak_bytes == max(every_rank)


def test_fsdp2_depth_extrapolation_matches_the_full_depth(monkeypatch):
    import memfit.estimators.analytic.estimate as analytic

    workload = ResolvedWorkload(model="llama-3.1-70b", task="train", seq_len=2048, world_size=8, precision="bf16",
                                techniques=("fsdp2", "checkpointing", "cpu-offload"))
    gpu = get_gpu("h100")
    fast = analytic_estimate(workload, gpu)
    assert not any("extrapolation failed" in n for n in fast.notes)
    monkeypatch.setattr(analytic, "extrapolation_depths", lambda *a, **k: None)
    full = analytic_estimate(workload, gpu)
    assert (fast.peak_bytes, fast.host_bytes) == (full.peak_bytes, full.host_bytes)


def test_plan_cli_json_save_and_run_the_saved_plan(capsys, tmp_path):
    saved = tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", "tiny-llama", "--gpu", "t4", "--seq-len", "128", "--global-batch", "4",
                       "--json", "--save", str(saved), "--top", "2")
    data = json.loads(out)
    assert code == 0 and data["schema"] == "memfit.plan/1" and data["feasible"] is True and data["reason"] is None
    for entry in data["plans"]:
        for key, kind in (("techniques", list), ("micro_batch", int), ("grad_accum", int), ("world_size", int),
                          ("peak_bytes", int), ("host_ram_bytes", int), ("step_time_s", float),
                          ("throughput", float)):
            assert isinstance(entry[key], kind), key
        assert entry["accuracy_risk"] in ("lossless", "numerical", "lossy")
    assert json.loads(saved.read_text()) == data
    workload, gpu = load_plan(str(saved))
    assert gpu.name == "t4" and workload.batch_size == data["plans"][0]["micro_batch"]
    code, out, _ = run(capsys, "estimate", "--plan", str(saved), "--method", "analytic", "--json")
    estimate = json.loads(out)
    assert code == 0 and estimate["peak_bytes"] + estimate["overhead_bytes"] == data["plans"][0]["peak_bytes"]
    code, out, _ = run(capsys, "measure", "--plan", str(saved), "--plan-index", "1", "--no-estimates", "--json")
    assert code == 0 and json.loads(out)["workload"]["techniques"] == data["plans"][1]["workload"]["techniques"]


def test_plan_cli_table_and_pareto_plot(capsys, tmp_path):
    png = tmp_path / "front.png"
    code, out, _ = run(capsys, "plan", "tiny-llama", "--gpu", "t4", "--seq-len", "128", "--global-batch", "4",
                       "--plot", str(png))
    assert code == 0 and "mb×acc" in out and "run plan 1: memfit estimate tiny-llama" in out
    assert png.stat().st_size > 10_000


def test_70b_full_finetune_on_one_24gb_gpu_without_offload_is_refused_with_the_reason(capsys):
    """The CLI exits 0 with the reason and the ways out in the JSON: without host RAM nothing offloads, and only
    ZeRO-Infinity (its states on a drive, 150 GiB of DeepSpeed's buffers and flat copies in host RAM) fits the
    card; more host RAM or lossy techniques would do."""
    code, out, _ = run(capsys, "plan", "llama-3.1-70b", "--gpu", "rtx-4090", "--seq-len", "2048", "--host-ram", "0",
                       "--json")
    data = json.loads(out)
    assert code == 0 and data["schema"] == "memfit.plan/1" and data["feasible"] is False and data["plans"] == []
    assert "fit the GPU but need host RAM" in data["reason"] and "nvme-offload" in data["reason"]
    assert "--host-ram 151GiB or more" in data["suggestions"]   # rounded up from 150.47 GiB
    assert any("--allow lossy" in s for s in data["suggestions"])


@pytest.mark.parametrize("argv, fragment", [
    (["tiny-llama", "--gpu", "t4", "--gpus", "0"], "--gpus"),
    (["tiny-llama", "--gpu", "nope"], "unknown GPU"),
    (["tiny-llama", "--gpu", "t4", "--max-ppl-increase", "2%"], "--allow lossy"),
    (["tiny-llama", "--gpu", "t4", "--allow", "lossy", "--max-ppl-increase", "two"], "percentage"),
    (["tiny-llama", "--gpu", "t4", "--objective", "cheapest"], "--objective"),
    (["tiny-llama", "--gpu", "t4", "--host-ram", "lots"], "size"),
    (["tiny-llama", "--gpu", "t4", "--task", "inference", "--global-batch", "4"], "--batch-size"),
    (["memfit.examples.convnet:build", "--gpu", "t4"], "custom module"),
])
def test_plan_cli_bad_input_exits_2(capsys, argv, fragment):
    code, out, err = run(capsys, "plan", *argv)
    assert code == 2 and fragment in err and out == ""


def test_estimate_plan_file_errors(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "memfit.estimate/1"}))
    code, _, err = run(capsys, "estimate", "--plan", str(bad))
    assert code == 2 and "memfit.plan/1" in err
    code, _, err = run(capsys, "estimate", "--plan", str(tmp_path / "missing.json"))
    assert code == 2 and "no such file" in err
    code, _, err = run(capsys, "estimate")
    assert code == 2 and "--plan" in err


def test_verify_traced_rechecks_the_chosen_plans():
    request = PlanRequest(model="tiny-llama", gpu=get_gpu("a100-80gb"), seq_len=128, global_batch=2, top=1)
    result = plan(request, verify_traced=True)
    data = result.plan_json(0)
    assert abs(data["traced_peak_bytes"] / data["peak_bytes"] - 1) < 0.05


def test_torchtunes_8b_full_fine_tune_on_a_4090_with_64_gib_of_host_ram():
    """torchtune's recipe (pure bf16, paged 8-bit AdamW, the step in backward, checkpointing, chunked loss: 18.9 GiB
    on a 4090) is found at its shape. At 64 x 4096 per step the 4090 workstation (64 GiB of host RAM, a 2 TB NVMe
    drive) fits it with DeepSpeed's ZeRO-Infinity: its states on the drive, mixed precision over float32 masters.
    Without a drive it cannot fit, and the plan says why: the step in backward cannot accumulate, so it would hold
    all 64 sequences at once, and ZeRO-Offload needs more host RAM."""
    workstation = get_instance("rtx-4090-workstation")
    gpu = workstation.gpu
    result = plan(PlanRequest(model="llama-3.1-8b", gpu=gpu, seq_len=2048, global_batch=2,
                              host_ram_bytes=64 * GiB, top=1), brief=True)
    best = result.plan_json(0)
    assert best["peak_bytes"] <= gpu.memory_bytes and best["host_ram_bytes"] <= 64 * GiB
    assert "optimizer-in-backward" in best["techniques"] and best["grad_accum"] == 1
    demo = plan(PlanRequest(model="llama-3.1-8b", gpu=gpu, seq_len=4096, global_batch=64, instance=workstation,
                            host_ram_bytes=workstation.host_ram_bytes, top=1), brief=True)
    best = demo.plan_json(0)
    assert "nvme-offload" in best["techniques"] and "deepspeed-zero3" in best["techniques"]
    assert best["peak_bytes"] + best["overhead_bytes"] <= gpu.memory_bytes and best["host_ram_bytes"] <= 64 * GiB
    assert 0 < best["nvme_bytes"] <= workstation.local_nvme_bytes
    no_drive = dataclasses.replace(workstation, local_nvme_bytes=None)
    demo = plan(PlanRequest(model="llama-3.1-8b", gpu=gpu, seq_len=4096, global_batch=64, instance=no_drive,
                            host_ram_bytes=no_drive.host_ram_bytes, top=1), brief=True)
    assert not demo.feasible and not demo.plans   # the offload plans fit the card but not the host
    assert "need host RAM" in demo.reason and "--host-ram is 64.00 GiB" in demo.reason
    assert any(s.startswith("--host-ram ") for s in demo.suggestions)
    assert any("cannot accumulate gradients" in s and "all 64 sequences" in s for s in demo.suggestions)


def test_a_model_that_fits_easily_keeps_float32_weights_and_states_and_the_faster_plan_is_shown(capsys):
    """tiny-phi3 fits a 4090 many times over (float32 is searched there) and its step is bound by the host issuing
    kernels: 8-bit AdamW states are the cost model's fastest by under 2 %, and no one would take them for that.
    Plan 1 trains exactly (float32, full AdamW); the tradeoff names the faster plan and what it changes. With no
    speed margin the fastest comes first. (Not tiny-llama: its grouped-query attention runs PyTorch's math kernel in
    float32 on a GPU, which makes float32 15 % slower there.)"""
    def planned(margin):
        return plan(PlanRequest(model="tiny-phi3", gpu=get_gpu("rtx-4090"), seq_len=256, global_batch=8, top=3,
                                speed_margin=margin), brief=True)

    result = planned(0.05)
    check_plans(result)
    best = result.plan_json(0)
    assert best["training_change"] == "exact" and best["techniques"] == ["fp32"]
    assert "would be" in result.tradeoff and "fewer bits" in result.tradeoff
    fastest = planned(0.0)
    assert fastest.plan_json(0)["training_change"] == "reduced-precision" and fastest.tradeoff is None
    assert fastest.plans[0].time.total_s < result.plans[0].time.total_s < 1.05 * fastest.plans[0].time.total_s


def test_a_compute_bound_model_is_planned_with_float32_masters_beside_the_faster_pure_bf16():
    """gpt2 at 32 x 1024 on an A100 fits with room to spare and its step is bound by its matmuls: float32 runs them
    at a sixteenth of the rate, autocast adds its casts and float32 pointwise kernels, and pure bf16 keeps no float32
    copy. bf16-master computes like pure bf16 with the update in float32 (mixed precision, full-precision AdamW
    states): plan 1, the reduced-precision plan shown beside it as a little faster."""
    result = plan(PlanRequest(model="gpt2", gpu=get_gpu("a100-80gb"), seq_len=1024, global_batch=32, top=3),
                  brief=True)
    check_plans(result)
    best = result.plan_json(0)
    assert best["techniques"] == ["bf16-master"] and best["training_change"] == "mixed-precision"
    assert best["workload"]["optimizer"] == "adamw"
    assert "would be" in result.tradeoff and "fewer bits" in result.tradeoff


def test_sixteen_gpus_search_2d_meshes_and_pay_the_network_between_nodes():
    """From 16 GPUs the planner pairs tensor parallel within a node (groups of 4 or 8) with FSDP2 across the groups,
    and pipeline stages of a node each with FSDP2 within them; a collective that spans nodes runs at the network's
    share per GPU (an instance's own network when planned on one), while one within a node keeps NVLink."""
    from memfit.planner.cost import timing
    from memfit.planner.space import candidates
    from memfit.specs.instances import get_instance

    request = PlanRequest(model="llama-3.1-8b", gpu=get_gpu("h100"), num_gpus=16, seq_len=4096, global_batch=64)
    base = ResolvedWorkload(model="llama-3.1-8b", task="train")
    meshes = {c.techniques[:2]: c for c in candidates(request, base) if c.techniques[:1] == ("tensor-parallel:size=8",)}
    assert meshes[("tensor-parallel:size=8", "fsdp2")].data_parallel == 2
    assert all(c.techniques[1:2] in (("fsdp2",), ("fsdp2:reshard=false",)) for c in meshes.values())
    p5 = PlanRequest(model="llama-3.1-8b", gpu=get_gpu("h100"), num_gpus=16, instance=get_instance("p5.48xlarge"))
    assert p5.cost.network_gbps == 3200 / 8 / 8   # 3200 Gb/s per machine over its 8 GPUs

    def parts(techniques, network_gbps):
        workload = ResolvedWorkload(model="llama-3.1-8b", task="train", batch_size=2, seq_len=4096, world_size=16,
                                    precision="bf16-mixed", techniques=techniques)
        cost = type(request.cost)(network_gbps=network_gbps, comm_overlap=0.0)
        return timing(workload, analytic_estimate(workload, request.gpu), request.gpu, cost)["time_parts_s"]

    sharded = parts(("fsdp2",), 50.0)
    assert parts(("fsdp2",), 5.0)["communication"] > 9 * sharded["communication"]
    tp_only = parts(("tensor-parallel:size=8", "fsdp2:reshard=false"), 1e9)   # a free network: NVLink alone is left
    assert tp_only["communication"] > 0 and parts(("tensor-parallel:size=8", "fsdp2:reshard=false"), 50.0)[
        "communication"] > tp_only["communication"]
    # one pipeline stage per node, FSDP2 within it (torchtitan's PP x FSDP): its collectives stay on NVLink
    stage_per_node = "pipeline-parallel:microbatches=2,stages=2"
    pipelines = {c.techniques[:2]: c for c in candidates(request, base) if c.techniques[:1] == (stage_per_node,)}
    assert pipelines[(stage_per_node, "fsdp2")].data_parallel == 8
    assert pipelines[(stage_per_node, "fsdp2")].batch_multiple == 2
    within_node = parts((stage_per_node, "fsdp2"), 5.0)["communication"]
    assert 0 < within_node == parts((stage_per_node, "fsdp2"), 1e9)["communication"]


def test_torchtunes_70b_full_fine_tune_on_eight_a100s_with_a_tebibyte_of_host_ram():
    """torchtune trains Llama-3.1-70B in full on 8 x A100-80GB with FSDP, CPU offload, AC and chunked CE (13.9 GiB per
    GPU, the data's lower-confidence rows): memfit's plan for that machine fits, within the host RAM; its estimate of
    torchtune's own configuration (without chunked CE, which memfit composes with FSDP2 only outside its forward)
    fits the cards too."""
    a100 = get_gpu("a100-80gb")
    result = plan(PlanRequest(model="llama-3.1-70b", gpu=a100, num_gpus=8, seq_len=2048, global_batch=16,
                              host_ram_bytes=TiB, top=1), brief=True)
    best = result.plan_json(0)
    assert result.feasible and best["peak_bytes"] <= a100.memory_bytes and best["host_ram_bytes"] <= TiB
    torchtune = ResolvedWorkload(model="llama-3.1-70b", task="train", batch_size=2, seq_len=2048, world_size=8,
                                 precision="bf16", optimizer_impl="fused",
                                 techniques=("fsdp2", "cpu-offload", "checkpointing"))
    estimate = analytic_estimate(torchtune, a100)
    assert device_bytes(estimate) < a100.memory_bytes and estimate.host_bytes * 8 < TiB


def test_torchtitans_8b_pretraining_on_eight_h100s_of_96_gb():
    """torchtitan's Llama-3.1-8B benchmark (FSDP2 with its bf16 MixedPrecisionPolicy, selective op-level AC, local
    batch 2 x 8192, 8 x H100 96 GB HBM2e): memfit's estimate of that configuration within 10 % of the 82.4 GiB
    reserved it published, and a plan for the machine that fits."""
    h100 = get_gpu("h100-96gb")
    titan = ResolvedWorkload(model="llama-3.1-8b", task="train", batch_size=2, seq_len=8192, world_size=8,
                             precision="bf16-mixed", techniques=("fsdp2", "checkpointing:mode=selective-op"))
    reserved = analytic_estimate(titan, h100).reserved_bytes
    assert rel(reserved, 82.4 * GiB) < 0.10, reserved / GiB
    result = plan(PlanRequest(model="llama-3.1-8b", gpu=h100, num_gpus=8, seq_len=8192, global_batch=16, top=1),
                  brief=True)
    assert result.feasible and result.plan_json(0)["peak_bytes"] <= h100.memory_bytes


def test_pruned_heads_that_do_not_split_over_tensor_parallel_are_refused_not_a_crash():
    """Structured pruning leaves 3 of tiny-llama's 4 key/value heads, which 4 tensor-parallel ranks cannot split (the
    config the rules check still has 4): the estimate finds it, and the search counts the combination as refused."""
    from memfit.planner.search import Search
    from memfit.planner.space import Candidate

    search = Search(PlanRequest(model="tiny-llama", gpu=get_gpu("a100-80gb"), num_gpus=4, seq_len=128,
                                global_batch=4, allow="lossy"))
    candidate = Candidate("bf16", techniques=("tensor-parallel", "prune-structured:ratio=0.25"), world_size=4)
    assert search.evaluate(candidate, candidate.workload(search.request, 1), 4) is None
    assert any("do not split over 4 ranks" in reason for reason in search.rejected)


BLOCKLESS = """
import torch
from torch import nn

def build():   # no ModuleList: block-wise techniques (checkpointing, fsdp2, ...) have nothing to wrap
    return nn.Sequential(nn.Embedding(100, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 100))

def tokens(batch_size, seq_len):
    return torch.randint(0, 100, (batch_size, seq_len))
"""


def test_a_model_without_repeated_blocks_is_planned_without_the_block_wise_techniques(tmp_path, monkeypatch):
    """A user's module with no ModuleList: the combinations that wrap blocks are refused (counted, with the reason)
    and the search goes on, over one GPU and two (where DeepSpeed's layouts, which only the analytic model of a
    transformer config predicts, are not tried)."""
    (tmp_path / "flat.py").write_text(BLOCKLESS)
    monkeypatch.chdir(tmp_path)
    for gpus in (1, 2):
        result = plan(PlanRequest(model="./flat.py:build", inputs="./flat.py:tokens", gpu=get_gpu("a10g"),
                                  num_gpus=gpus, seq_len=16, global_batch=4, top=1), brief=True)
        assert result.feasible, result.reason
        assert any("no ModuleList of repeated blocks" in reason for reason in result.rejected)
        assert "deepspeed" not in json.dumps(result.plan_json(0)["workload"])
