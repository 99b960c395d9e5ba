"""Real CPU runs: the allocator's peak, PyTorch's own memory timeline, and memfit's categories."""
import glob
import tempfile

import pytest
import torch

import memfit
from memfit.core.errors import MemfitError
from memfit.measurement import measure
from memfit.measurement.ranks import measure_ranks_many
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import rel


def test_measured_categories_agree_with_the_profiler_timeline():
    measured = measure(ResolvedWorkload(model="tiny-llama", batch_size=2, seq_len=128),
                       estimates=("traced", "analytic"), profiler_categories=True)
    profiler = measured.extra["profiler_categories_at_peak"]
    assert rel(measured.extra["profiler_timeline_peak_bytes"], measured.peak_bytes) < 0.001
    assert profiler["parameters"] == measured.at_peak["parameters"]
    assert profiler["optimizer_states"] == measured.at_peak["optimizer_states"]
    assert profiler["gradients"] == measured.at_peak["gradients"]
    assert rel(profiler["activations"], measured.at_peak["activations"]) < 0.01
    for method in ("traced", "analytic"):
        assert abs(measured.extra["ratios"][f"measured/{method}"] - 1) < 0.01


def test_measurement_json_has_the_estimates():
    workload = ResolvedWorkload(model="tiny-gpt2", task="inference", batch_size=2, seq_len=64, new_tokens=4)
    data = measure(workload).to_json()
    assert data["schema"] == "memfit.estimate/1" and data["method"] == "measured" and data["device"] == "cpu"
    assert set(data["estimates"]) == {"traced", "analytic"} and data["at_peak"]["kv_cache"] > 0
    assert sum(data["at_peak"].values()) == data["peak_bytes"]
    assert data["peak_phase"] in ("prefill", "decode")


@pytest.mark.gpu
def test_cuda_measurement_reports_the_allocator(tmp_path):
    measured = measure(ResolvedWorkload(model="tiny-llama", batch_size=2, seq_len=128, precision="bf16-mixed"),
                       device="cuda:0", snapshot_path=str(tmp_path / "snap.pickle"))
    assert measured.extra["max_memory_reserved"] >= measured.extra["max_memory_allocated"] == measured.peak_bytes
    assert (tmp_path / "snap.pickle").exists()


@pytest.mark.distributed
def test_a_launch_that_hangs_is_stopped_with_the_ranks_stacks(monkeypatch, tmp_path):
    """A torchrun launch past MEMFIT_RANK_TIMEOUT_S ends in one error that says where the ranks were (their
    Python stacks), and no rank is left running: torchrun starts each in a session of its own."""
    monkeypatch.setenv("MEMFIT_RANK_TIMEOUT_S", "12")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # the launch's folder, in each rank's command line
    slow = ResolvedWorkload(model="gpt2", batch_size=2, seq_len=1024, world_size=2, techniques=("ddp",))
    with pytest.raises(MemfitError, match="did not finish in 12 s") as error:
        measure_ranks_many([slow])
    assert 'File "' in str(error.value)
    left = [p for p in glob.glob("/proc/[0-9]*/cmdline") if str(tmp_path) in _read(p)]
    assert not left


def test_a_bad_rank_timeout_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("MEMFIT_RANK_TIMEOUT_S", "ten minutes")
    with pytest.raises(MemfitError, match="MEMFIT_RANK_TIMEOUT_S must be a whole number"):
        measure_ranks_many([ResolvedWorkload(model="tiny-llama", world_size=2, techniques=("ddp",))])


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:   # the process ended meanwhile
        return ""


IMPLS = [("adamw", "foreach"), ("adamw", "fused"), ("adamw", "for-loop"), ("sgd", "fused"), ("adafactor", "foreach")]


def test_each_optimizer_implementation_is_run_and_predicted():
    """--optimizer-impl on a step whose peak is the optimizer's (a tiny batch): each runs for real on the CPU and
    both estimators predict it; foreach holds a copy of every parameter at once, the for-loop one parameter's
    worth twice, fused nothing (the peak moves to backward)."""
    peaks = {}
    for optimizer, impl in IMPLS:
        run = measure(ResolvedWorkload(model="tiny-llama", batch_size=1, seq_len=16, optimizer=optimizer,
                                       optimizer_impl=impl))
        assert all(abs(ratio - 1) < 0.01 for ratio in run.extra["ratios"].values()), (optimizer, impl, run.extra)
        peaks[optimizer, impl] = run.peak_bytes, run.peak_phase
    assert peaks["adamw", "foreach"][0] > peaks["adamw", "for-loop"][0] > peaks["adamw", "fused"][0]
    assert peaks["adamw", "fused"][1] == "backward" and peaks["adamw", "foreach"][1] == "optimizer"


@pytest.mark.parametrize("optimizer,state_bytes", [("paged-adamw8bit", 1), ("paged-adamw", 4)])
def test_a_paged_optimizer_runs_unpaged_on_the_cpu_and_keeps_its_large_states_apart_on_a_gpu(optimizer, state_bytes):
    """bitsandbytes' PagedAdamW8bit and PagedAdamW: on the CPU their states are ordinary tensors (the measured step
    against both estimators within 1 %, bitsandbytes' CPU kernels' temporaries included); on a GPU target m and v
    of the tensors of 1e5 elements or more leave the allocator's figures for `paged_bytes`, by exactly their size
    in both estimators, and only the small tensors' states stay."""
    from memfit.specs.hardware import get_gpu

    shape = dict(model="tiny-llama", batch_size=2, seq_len=64, precision="bf16", optimizer=optimizer)
    run = measure(ResolvedWorkload(**shape))
    assert run.paged_bytes == 0 and run.peak_phase == "optimizer"
    assert all(abs(ratio - 1) < 0.01 for ratio in run.extra["ratios"].values()), run.extra
    model = ResolvedWorkload(**shape).source.build(device="meta", dtype=torch.bfloat16)
    params = [p.numel() for p in model.parameters()]
    large = [n for n in params if n >= 100_000]
    gpu = get_gpu("a100-80gb")
    for method in ("traced", "analytic"):
        on_gpu = memfit.estimate(ResolvedWorkload(**shape), method=method, gpu=gpu)
        assert on_gpu.paged_bytes == 2 * state_bytes * sum(large) > 0, method
        on_cpu = memfit.estimate(ResolvedWorkload(**shape), method=method)
        states = on_cpu.component_peaks["optimizer_states"] - on_gpu.component_peaks["optimizer_states"]
        assert abs(states - on_gpu.paged_bytes) <= 512 * len(params), method   # the allocator's 512-byte rounding
        assert "on the device beside the rest" in " ".join(on_gpu.notes)


def test_paged_states_that_do_not_fit_beside_the_rest_page_to_host_ram():
    """torchtune's Llama-3.1-8B full fine-tune on one RTX 4090: the step fits, 15 GiB of 8-bit states do not."""
    from memfit.specs.hardware import get_gpu

    workload = ResolvedWorkload(model="llama-3.1-8b", batch_size=2, seq_len=2048, precision="bf16",
                                optimizer="paged-adamw8bit",
                                techniques=("optimizer-in-backward", "checkpointing", "chunked-ce"))
    result = memfit.estimate(workload, method="analytic", gpu=get_gpu("rtx-4090"))
    assert result.fits and result.paged_bytes > result.headroom_bytes > 0
    assert result.host_bytes == result.paged_bytes - result.headroom_bytes
    assert "pages to host RAM" in " ".join(result.notes)


@pytest.mark.parametrize("flags,message", [
    (dict(optimizer="adafactor", optimizer_impl="fused"), "adafactor runs as foreach or for-loop only"),
    (dict(optimizer="adamw8bit", optimizer_impl="foreach"), "adamw8bit runs its own kernels"),
    (dict(task="inference", optimizer_impl="fused"), "drop it for --task inference"),
    (dict(optimizer_impl="fast"), "unknown --optimizer-impl 'fast'"),
    (dict(optimizer_impl="fused", world_size=2, zero_stage=2, engine="deepspeed", precision="bf16-mixed"),
     "DeepSpeed's own AdamW"),
])
def test_an_optimizer_implementation_it_cannot_run_is_refused(flags, message):
    with pytest.raises(MemfitError, match=message):
        ResolvedWorkload(model="tiny-llama", **flags)


@pytest.mark.parametrize("task,new_tokens", [("train", 0), ("inference", 4)])
def test_pure_fp16_runs_and_is_predicted(task, new_tokens):
    """--precision fp16: float16 weights (half of float32's bytes), no autocast, no master copy; training says it
    has no loss scaler. Within 1 %, or under by no more than the run's kernel scratch that no tensor accounts for:
    oneDNN reorders inside float16 matrix products, which depend on the CPU's instruction set (about 250 KB at
    the prefill's peak on an AMX CPU, none elsewhere) and are not modelled (estimators/kernel_probe.py)."""
    shape = dict(model="tiny-llama", task=task, batch_size=2, seq_len=64, new_tokens=new_tokens)
    half, full = measure(ResolvedWorkload(**shape, precision="fp16")), measure(ResolvedWorkload(**shape))
    slack = 0.01 * half.peak_bytes
    for estimate in half.extra["estimates"].values():
        under = half.peak_bytes - estimate["peak_bytes"]
        assert -slack < under < slack + half.extra["untracked_bytes"], (half.extra["ratios"], half.extra)
    assert half.model_state_bytes["parameters"] * 2 == full.model_state_bytes["parameters"]
    notes = " ".join(half.extra["estimates"]["traced"]["notes"])
    assert ("no loss scaler" in notes) == (task == "train")
