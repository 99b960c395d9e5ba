"""Real CPU runs: the allocator's peak, PyTorch's own memory timeline, and memfit's categories."""
import glob
import tempfile

import pytest

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
    monkeypatch.setenv("MEMFIT_RANK_TIMEOUT_S", "25")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # the launch's folder, in each rank's command line
    slow = ResolvedWorkload(model="gpt2", batch_size=2, seq_len=1024, world_size=2, techniques=("ddp",))
    with pytest.raises(MemfitError, match="did not finish in 25 s") as error:
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
