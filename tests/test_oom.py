"""memfit explain-oom: PyTorch's own OOM messages and memory snapshots, read safely, and fixes ranked."""
import json
import pickle

import pytest
import torch
from torch import nn

from memfit.cli.main import main
from memfit.core.errors import MemfitError
from memfit.core.units import GiB, MiB
from memfit.measurement.oom import load_snapshot, parse_oom_message, summarize_snapshot

# Real messages as PyTorch 2.x and 1.x print them (c10/cuda/CUDACachingAllocator.cpp)
MODERN = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 19.68 GiB. GPU 0 has a total capacity of "
          "23.68 GiB of which 11.88 GiB is free. Including non-PyTorch memory, this process has 11.79 GiB memory in "
          "use. Of the allocated memory 11.44 GiB is allocated by PyTorch, and 43.59 MiB is reserved by PyTorch but "
          "unallocated. If reserved but unallocated memory is large try setting "
          "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
          "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
SHARED_GPU = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 1.25 GiB. GPU 1 has a total capacity of "
              "93.02 GiB of which 1.18 GiB is free. Process 2752205 has 91.82 GiB memory in use. Of the allocated "
              "memory 90.63 GiB is allocated by PyTorch, and 120.54 MiB is reserved by PyTorch but unallocated.")
LEGACY = ("RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB "
          "already\nallocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If reserved memory is >> "
          "allocated memory try setting max_split_size_mb to avoid fragmentation.")


def test_modern_message():
    m = parse_oom_message("Traceback (most recent call last):\n  ...\n" + MODERN)
    assert m.device == "GPU 0"
    assert m.tried_bytes == int(19.68 * GiB) and m.total_bytes == int(23.68 * GiB)
    assert m.free_bytes == int(11.88 * GiB) and m.allocated_bytes == int(11.44 * GiB)
    assert m.reserved_unallocated_bytes == int(43.59 * MiB)
    assert m.non_pytorch_bytes == int(11.79 * GiB) - int(11.44 * GiB) - int(43.59 * MiB)
    assert m.shortfall_bytes == int(19.68 * GiB) - int(11.88 * GiB)


def test_message_naming_another_process_and_the_legacy_format():
    m = parse_oom_message(SHARED_GPU)
    assert m.device == "GPU 1" and m.other_processes == {"process 2752205": int(91.82 * GiB)}
    legacy = parse_oom_message(LEGACY)
    assert legacy.tried_bytes == 36 * MiB and legacy.free_bytes == int(47.06 * MiB)
    assert legacy.reserved_unallocated_bytes == int(188 * MiB) - int(130.35 * MiB)


def test_no_message_is_a_user_error():
    with pytest.raises(MemfitError, match="no PyTorch out-of-memory message"):
        parse_oom_message("RuntimeError: shape mismatch")


@pytest.fixture(scope="module")
def profiled_snapshot(tmp_path_factory):
    """A snapshot written by PyTorch's own code (torch.cuda._memory_viz converts a memory profile into the
    snapshot format memory_viz reads) from a real training step of a small MLP with AdamW."""
    from torch.cuda._memory_viz import _profile_to_snapshot

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(32, 64)

    def step():
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()   # the optimizer's states exist from here on
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as profile:
        step()
    path = tmp_path_factory.mktemp("snap") / "step.pickle"
    with open(path, "wb") as fh:
        pickle.dump(_profile_to_snapshot(profile), fh)
    return path, sum(p.numel() * 4 for p in model.parameters())


def test_snapshot_categories_at_the_peak(profiled_snapshot):
    path, param_bytes = profiled_snapshot
    summary = summarize_snapshot(load_snapshot(str(path)))
    by = summary.by_category
    assert summary.moment == "the peak of the trace"
    assert by["optimizer_states"] >= 2 * param_bytes    # AdamW: exp_avg and exp_avg_sq per parameter
    assert by["gradients"] >= param_bytes


def test_snapshot_with_an_oom_entry(tmp_path):
    # the format's documented fields (torch.cuda.memory._snapshot): an alloc, then the failed allocation
    frames = [{"filename": "torch/optim/adamw.py", "line": 1, "name": "_init_group"}]
    snapshot = {"segments": [{"device": 0, "address": 0, "total_size": 4 * MiB, "stream": 0, "segment_type": "large",
                              "allocated_size": 2 * MiB, "active_size": 2 * MiB,
                              "blocks": [{"address": 0, "size": 2 * MiB, "requested_size": 2 * MiB,
                                          "state": "active_allocated", "frames": frames},
                                         {"address": 2 * MiB, "size": 2 * MiB, "state": "inactive", "frames": []}]}],
                "device_traces": [[{"action": "alloc", "addr": 0, "size": 2 * MiB, "stream": 0, "frames": frames},
                                   {"action": "oom", "size": 8 * MiB, "device_free": 1 * MiB, "stream": 0,
                                    "frames": []}]]}
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    summary = summarize_snapshot(load_snapshot(str(path)))
    assert summary.moment == "the OOM" and summary.by_category == {"optimizer_states": 2 * MiB}
    assert (summary.oom_tried_bytes, summary.oom_device_free_bytes) == (8 * MiB, 1 * MiB)
    assert summary.fragmentation_bytes == 2 * MiB and summary.largest_free_block_bytes == 2 * MiB


class _Boom:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_a_snapshot_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": _Boom()}))
    with pytest.raises(MemfitError, match="refuses"):
        load_snapshot(str(path))
    assert not (tmp_path / "pwned").exists()


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_ranks_fixes_for_a_workload(capsys, tmp_path):
    log = tmp_path / "oom.log"
    log.write_text("step 12\n" + MODERN + "\n")
    code, out, _ = run(capsys, "explain-oom", str(log), "--model", "tiny-llama", "--batch-size", "8", "--seq-len",
                       "256", "--json")
    data = json.loads(out)
    assert code == 0 and data["schema"] == "memfit.oom/1"
    assert data["shortfall_bytes"] == int(19.68 * GiB) - int(11.88 * GiB)
    saved = [f["saved_bytes"] for f in data["fixes"]]
    assert saved == sorted(saved, reverse=True)
    fixes = {f["fix"]: f for f in data["fixes"]}
    assert fixes["expandable-segments"]["basis"].startswith("message")   # what the run reported wins
    assert "checkpointing" in fixes and fixes["checkpointing"]["basis"].startswith("analytic")


def test_cli_reads_stdin_and_a_snapshot(capsys, monkeypatch, profiled_snapshot):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(SHARED_GPU))
    code, out, _ = run(capsys, "explain-oom")
    assert code == 0 and "stop other processes" in out
    code, out, _ = run(capsys, "explain-oom", str(profiled_snapshot[0]))
    assert code == 0 and "optimizer_states" in out and "adamw8bit" in out


def test_cli_errors_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "explain-oom", str(tmp_path / "none.log"))
    assert code == 2 and "no such file" in err
    (tmp_path / "x.log").write_text("all good")
    code, _, err = run(capsys, "explain-oom", str(tmp_path / "x.log"))
    assert code == 2 and "no PyTorch out-of-memory message" in err
    (tmp_path / "x.pickle").write_bytes(b"not a pickle")
    code, _, err = run(capsys, "explain-oom", str(tmp_path / "x.pickle"))
    assert code == 2 and "not a PyTorch memory snapshot" in err


H100 = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.15 GiB of which 1.25 GiB is free. Including non-PyTorch memory, this process has 77.88 GiB memory in "
        "use. Of the allocated memory 74.02 GiB is allocated by PyTorch, and 3.21 GiB is reserved by PyTorch but "
        "unallocated.")


def test_with_a_workload_enough_means_the_whole_step_fits(capsys, tmp_path):
    """Every fix covers the 0.75 GiB the allocation lacked; only those that bring the whole step's predicted peak
    under the device's 79 GiB are enough."""
    log = tmp_path / "oom.log"
    log.write_text(H100)
    code, out, _ = run(capsys, "explain-oom", str(log), "--model", "llama-3.1-8b", "--seq-len", "4096",
                       "--batch-size", "2", "--precision", "bf16", "--json")
    data = json.loads(out)
    assert code == 0 and data["available_bytes"] == int(79.15 * GiB) and data["step_bytes"] > data["available_bytes"]
    fixes = {f["fix"]: f for f in data["fixes"]}
    assert all(f["closes_shortfall"] for f in fixes.values())
    for fix in fixes.values():
        assert fix["enough"] == (data["step_bytes"] - fix["saved_bytes"] <= data["available_bytes"])
    assert fixes["checkpointing"]["enough"] and not fixes["adamw8bit"]["enough"]
    assert not fixes["expandable-segments"]["enough"]   # the allocator's 3.2 GiB cannot hold a 100+ GiB step
    code, out, _ = run(capsys, "explain-oom", str(log), "--model", "llama-3.1-8b", "--seq-len", "4096",
                       "--batch-size", "2", "--precision", "bf16")
    assert code == 0 and "enough = the whole step fits" in out
