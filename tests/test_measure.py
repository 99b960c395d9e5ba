"""Real CPU runs: the allocator's peak, PyTorch's own memory timeline, and memfit's categories."""
import pytest

from memfit.measurement import measure
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
