"""The simulated CUDA caching allocator against sequences worked out by hand from the rules of
c10/cuda/CUDACachingAllocator.cpp (the function named in each test)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import memfit
from memfit.core.caching_allocator import (
    PHASE_START,
    STEP_START,
    AllocatorSettings,
    CachingAllocator,
    OutOfMemory,
    replay,
    simulate_reserved,
)
from memfit.core.units import MiB
from memfit.estimators import estimate
from memfit.estimators.analytic.blocks import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM
from memfit.estimators.analytic.simulate import simulate
from memfit.estimators.gpu_overhead import allocator_settings, blas_workspaces, predict_reserve
from memfit.specs.hardware import get_gpu
from memfit.specs.workload import Workload
from memfit.techniques.resolve import resolve

EXPANDABLE = AllocatorSettings(expandable_segments=True)


def test_small_requests_round_to_512_bytes_and_share_a_2_mib_segment():
    """round_size, get_allocation_size (kSmallBuffer), should_split (small pool: a remainder of >= 512 bytes)."""
    allocator = CachingAllocator()
    allocator.malloc(1)
    allocator.malloc(1000)
    assert (allocator.allocated, allocator.reserved) == (512 + 1024, 2 * MiB)
    allocator.malloc(0)   # nothing allocated for an empty tensor
    assert allocator.allocated == 512 + 1024


def test_requests_under_10_mib_split_a_20_mib_segment_until_it_is_used_up():
    """get_allocation_size (kLargeBuffer under kMinLargeAlloc); should_split (large pool: remainder > 1 MiB)."""
    allocator = CachingAllocator()
    for _ in range(4):
        allocator.malloc(5 * MiB)
    assert allocator.reserved == 20 * MiB   # the fourth takes the last 5 MiB whole
    allocator.malloc(5 * MiB)
    assert (allocator.reserved, allocator.allocated) == (40 * MiB, 25 * MiB)


def test_a_large_request_gets_a_segment_rounded_to_2_mib():
    allocator = CachingAllocator()
    allocator.malloc(11 * MiB)
    assert allocator.reserved == 12 * MiB


def test_a_freed_block_too_small_for_the_next_request_stays_reserved():
    """get_free_block finds nothing >= 14 MiB: a second segment; reserved - allocated is the fragmentation."""
    result = replay([("a", 12 * MiB, 0), ("a", 0, 0), ("b", 14 * MiB, 0)])
    assert (result.reserved_bytes, result.allocated_bytes, result.fragmentation_bytes) == (26 * MiB, 14 * MiB, 12 * MiB)


def test_a_remainder_of_1_mib_or_less_stays_with_the_block_and_counts_as_allocated():
    """should_split: large pool, remaining 0.5 MiB is not > kSmallSize, so the request gets the whole 12 MiB."""
    result = replay([("a", 12 * MiB, 0), ("a", 0, 0), ("b", 11 * MiB + MiB // 2, 0)])
    assert (result.reserved_bytes, result.allocated_bytes) == (12 * MiB, 12 * MiB)


def test_best_fit_takes_the_smallest_free_block_that_is_large_enough():
    allocator = CachingAllocator()
    big, small = allocator.malloc(14 * MiB), allocator.malloc(12 * MiB)
    allocator.free(big)
    allocator.free(small)
    block = allocator.malloc(11 * MiB)
    assert block.size == 12 * MiB and allocator.reserved == 26 * MiB


def test_freed_neighbours_merge_into_one_block():
    """free_block / try_merge_blocks: A and B, adjacent in one 20 MiB segment, merge into 10 MiB that holds 9 MiB."""
    allocator = CachingAllocator()
    a, b, _ = (allocator.malloc(5 * MiB) for _ in range(3))
    allocator.free(b)
    allocator.free(a)
    block = allocator.malloc(9 * MiB)
    assert (block.size, allocator.reserved) == (10 * MiB, 20 * MiB)   # remainder 1 MiB: not split


def test_a_full_device_releases_the_cache_and_retries():
    """malloc: alloc_block fails, release_cached_blocks frees the whole free 12 MiB segment, the retry succeeds."""
    events = [("a", 12 * MiB, 0), ("a", 0, 0), ("b", 14 * MiB, 0)]
    result = simulate_reserved(events, AllocatorSettings(), capacity=20 * MiB)
    assert (result.reserved_bytes, result.cache_flushes, result.out_of_memory) == (14 * MiB, 1, False)


def test_out_of_memory_when_releasing_the_cache_frees_nothing():
    allocator = CachingAllocator(capacity=20 * MiB)
    allocator.malloc(12 * MiB)
    with pytest.raises(OutOfMemory):
        allocator.malloc(14 * MiB)
    result = simulate_reserved([("a", 12 * MiB, 0), ("b", 14 * MiB, 0)], AllocatorSettings(), capacity=20 * MiB)
    assert result.out_of_memory and result.reserved_bytes == 26 * MiB   # the unbounded figure, flagged


def test_a_block_freed_on_one_stream_is_not_reused_by_another():
    """get_free_block: the free block must be on the request's stream (BlockComparatorSize orders by stream)."""
    result = replay([("a", 12 * MiB, "compute"), ("a", 0, "compute"), ("b", 12 * MiB, "all-gather")])
    assert result.reserved_bytes == 24 * MiB


def test_max_split_size_keeps_oversize_blocks_for_large_requests():
    """get_free_block: under max_split_size a request cannot take an oversize block; at or over it, a block at most
    kLargeBuffer larger; should_split: an oversize request is never split."""
    limit = AllocatorSettings(max_split_size=40 * MiB)
    assert replay([("a", 60 * MiB, 0), ("a", 0, 0), ("b", 30 * MiB, 0)], limit).reserved_bytes == 90 * MiB
    result = replay([("a", 60 * MiB, 0), ("a", 0, 0), ("b", 50 * MiB, 0)], limit)
    assert (result.reserved_bytes, result.allocated_bytes) == (60 * MiB, 60 * MiB)
    assert replay([("a", 60 * MiB, 0), ("a", 0, 0), ("b", 30 * MiB, 0)]).reserved_bytes == 60 * MiB   # no limit


def test_expandable_segments_map_20_mib_pages_and_grow_in_place():
    """try_allocate_expandable_block / map_block: 12 MiB maps one 20 MiB page; the freed page then holds 14 MiB,
    where fixed segments needed a second one (26 MiB)."""
    result = replay([("a", 12 * MiB, 0), ("a", 0, 0), ("b", 14 * MiB, 0)], EXPANDABLE)
    assert (result.reserved_bytes, result.allocated_bytes) == (20 * MiB, 14 * MiB)


def test_an_expandable_segment_extends_its_free_tail_with_new_pages():
    """find_expandable_block starts in the free 8 MiB before the unmapped range; map_block maps one more page."""
    allocator = CachingAllocator(EXPANDABLE)
    first = allocator.malloc(12 * MiB)
    block = allocator.malloc(14 * MiB)
    assert block.address == first.address + 12 * MiB   # right after the first, across the page boundary
    assert allocator.reserved == 40 * MiB


def test_releasing_an_expandable_segment_unmaps_its_free_pages():
    """unmap_block: only whole pages inside free blocks are unmapped."""
    allocator = CachingAllocator(EXPANDABLE)
    kept, freed = allocator.malloc(12 * MiB), allocator.malloc(30 * MiB)
    assert allocator.reserved == 60 * MiB   # pages 0-2: 12 + 30 MiB need 42 MiB
    allocator.free(freed)
    allocator.empty_cache()
    assert allocator.reserved == 20 * MiB   # page 0 holds the kept block
    allocator.free(kept)
    allocator.empty_cache()
    assert allocator.reserved == 0


def test_emptying_the_cache_as_each_phase_starts_returns_the_free_segments():
    """release-cache: torch.cuda.empty_cache() at a phase start frees the whole free 12 MiB segment, so the next
    phase's 14 MiB request is the only segment left (release_cached_blocks)."""
    events = [("a", 12 * MiB, 0), ("a", 0, 0), (PHASE_START, 0, 0), ("b", 14 * MiB, 0)]
    assert replay(events).reserved_bytes == 26 * MiB
    released = replay(events, AllocatorSettings(empty_cache_between_phases=True))
    assert (released.reserved_bytes, released.cache_flushes) == (14 * MiB, 0)   # not an out-of-memory retry


# A 12 MiB weight loaded, quantized on the device into a 3 MiB copy (carved from the weight's freed segment:
# best fit), the weight freed; a 16 MiB weight loaded and dropped likewise; then the step's 1 MiB tensor.
LOAD_THEN_QUANTIZE = [("w", 12 * MiB, 0), ("v", 16 * MiB, 0), ("w", 0, 0), ("q", 3 * MiB, 0), ("v", 0, 0),
                      (STEP_START, 0, 0), ("x", 1 * MiB, 0)]


def test_the_measured_step_resets_the_peaks_and_reports_what_came_before():
    """replay at the step's start: reset_peak_memory_stats (resetPeakStats) restarts the peaks from what is reserved
    and allocated then; the cache the load left (both segments: the 12 MiB one holds the 3 MiB copy, the 16 MiB
    one is free) stays reserved; the step's 1 MiB request is a new 2 MiB small-pool segment."""
    result = replay(LOAD_THEN_QUANTIZE)
    assert result.setup_reserved_bytes == 28 * MiB
    assert (result.reserved_bytes, result.allocated_bytes) == (30 * MiB, 4 * MiB)
    assert result.fragmentation_bytes == 26 * MiB
    assert result.start_reserved_bytes == 28 * MiB   # what the set-up alone left reserved into the step


def test_what_the_set_up_leaves_reserved_is_a_floor_for_a_deeper_model():
    """predict_reserve on a sample: the step's own reserve (26 MiB here) is carried over, unless what the deeper
    model's set-up leaves reserved (extrapolated by the caller) exceeds its peak by more."""
    capacity = 80 * 1024 * MiB
    carried, note = predict_reserve(LOAD_THEN_QUANTIZE, AllocatorSettings(), capacity, 40 * MiB, "the sample",
                                    start_reserved=50 * MiB)
    assert carried.reserved_bytes == 66 * MiB and "carried over" in note
    floor, note = predict_reserve(LOAD_THEN_QUANTIZE, AllocatorSettings(), capacity, 40 * MiB, "the sample",
                                  start_reserved=100 * MiB)
    assert floor.reserved_bytes == 100 * MiB and "the segments the set-up leaves reserved" in note


def test_a_cuda_graph_capture_before_the_step_returns_the_free_segments():
    """compile:mode=reduce-overhead: capturing the CUDA graphs in the warm-up empties the cache (torch.cuda.graph's
    __enter__ calls empty_cache; release_cached_blocks): the free 16 MiB segment goes back, the 12 MiB one, split
    around the live 3 MiB copy, stays."""
    result = replay(LOAD_THEN_QUANTIZE, AllocatorSettings(empty_cache_before_step=True))
    assert (result.reserved_bytes, result.allocated_bytes, result.setup_reserved_bytes) == (14 * MiB, 4 * MiB,
                                                                                            28 * MiB)
    assert result.start_reserved_bytes == 0   # the set-up's cache went back: nothing of it reaches the step
    settings = allocator_settings(resolve(Workload(model="tiny-llama", task="inference", precision="bf16",
                                                   techniques=("compile:mode=reduce-overhead",))))
    assert settings.empty_cache_before_step


def test_a_resized_storage_frees_its_block_and_takes_a_new_one():
    """replay: FSDP2 resizes a storage to 0 and back; each new size is a new request."""
    result = replay([("p", 12 * MiB, 0), ("p", 0, 0), ("p", 12 * MiB, 0)])
    assert (result.reserved_bytes, result.allocated_bytes) == (12 * MiB, 12 * MiB)


# ---- the estimators replay their step through it ------------------------------------------------------------

def _tiny_training(techniques=()):
    return Workload(model="tiny-llama", task="train", batch_size=4, seq_len=256, precision="bf16-mixed",
                    techniques=techniques)


@pytest.mark.parametrize("techniques,settings", [
    ((), AllocatorSettings()),
    (("expandable-segments",), AllocatorSettings(expandable_segments=True)),
    (("release-cache",), AllocatorSettings(empty_cache_between_phases=True)),
])
def test_an_analytic_gpu_estimate_reserves_what_its_step_replayed_through_the_allocator_reserves(techniques,
                                                                                                settings):
    workload = resolve(_tiny_training(techniques))
    gpu = get_gpu("a100-80gb")
    result = estimate(workload, method="analytic", gpu=gpu)
    engine = simulate(workload, gpu, workload.source.num_layers, record_allocations=True)
    workspaces = [(f"workspace {i}", nbytes, 0) for i, nbytes in enumerate(blas_workspaces(gpu, workload))]
    replayed = replay(workspaces + engine.allocations, settings)
    assert replayed.allocated_bytes == result.peak_bytes + result.overhead_detail["cublas_workspace"]
    assert result.reserved_bytes == replayed.reserved_bytes > replayed.allocated_bytes
    assert result.sources["reserved_bytes"] == result.sources["allocator_reserve"] == "simulated"
    assert result.overhead_detail["allocator_reserve"] == result.reserved_bytes - replayed.allocated_bytes
    assert result.allocator["expandable_segments"] is settings.expandable_segments


def test_fsdp2_allocates_its_collectives_buffers_on_their_own_streams():
    """The analytic FSDP2 step puts each all-gather's flat output on the copy-in stream and the reduced gradient
    shards on the reduce-scatter stream, as FSDP2 does: the same tensors, but pools the default stream cannot
    reuse, so more is reserved than one stream would."""
    workload = resolve(Workload(model="tiny-llama", task="train", batch_size=4, seq_len=256, precision="bf16-mixed",
                                world_size=2, techniques=("fsdp2",)))
    engine = simulate(workload, get_gpu("a100-80gb"), workload.source.num_layers, record_allocations=True)
    assert {stream for _, nbytes, stream in engine.allocations if nbytes} == \
        {0, ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM}
    own, one = replay(engine.allocations), replay([(uid, nbytes, 0) for uid, nbytes, _ in engine.allocations])
    assert own.allocated_bytes == one.allocated_bytes and own.reserved_bytes > one.reserved_bytes


def test_traced_and_analytic_replays_of_the_same_step_reserve_alike():
    gpu = get_gpu("a100-80gb")
    traced, analytic = (estimate(_tiny_training(), method=m, gpu=gpu) for m in ("traced", "analytic"))
    assert traced.reserved_bytes == pytest.approx(analytic.reserved_bytes, rel=0.03)


@pytest.mark.parametrize("task", ["inference", "train"])
def test_a_step_deeper_than_its_trace_carries_its_sampled_reserve_over_and_says_how(task, tmp_path):
    """The same GPT-2 at 12 and at 24 layers, both traced at the same few layers: the tensors' peak grows with depth;
    an inference step's reserve beyond them stays the sample's, a training step's keeps its share of the peak."""
    config = json.loads((Path(memfit.__file__).parent / "specs/configs/gpt2.json").read_text())["hf_config"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 24}))
    results = [estimate(Workload(model=model, task=task, batch_size=8, seq_len=512), method="traced",
                        gpu=get_gpu("a100-80gb")) for model in ("gpt2", str(tmp_path))]
    how = "scaled to the model's peak" if task == "train" else "carried over"
    for result in results:
        assert any(n.startswith("allocator reserve simulated on the step at") and how in n for n in result.notes)
    (small, small_reserve), (deep, deep_reserve) = [
        (r.allocator["allocated_bytes"], r.overhead_detail["allocator_reserve"]) for r in results]
    assert deep > small * 1.3 and small_reserve > 0
    if task == "train":
        assert deep_reserve / deep == pytest.approx(small_reserve / small, rel=1e-3)
    else:
        assert deep_reserve == small_reserve


def test_tensors_larger_than_the_device_skip_the_replay_and_do_not_fit():
    result = estimate(Workload(model="llama-3.1-70b", task="train", batch_size=1, seq_len=512), method="analytic",
                      gpu=get_gpu("rtx-4090"))
    assert result.fits is False and result.allocator["out_of_memory"]
    assert "the tensors alone exceed the device" in " ".join(result.notes)


def test_a_plan_fits_on_the_simulated_reserved_bytes():
    from memfit.planner.planning import PlanRequest, plan

    result = plan(PlanRequest(model="tiny-llama", gpu=get_gpu("t4"), seq_len=256, global_batch=8))
    best = result.plans[0]
    estimate_json = best.estimate.to_json()
    assert best.device_bytes == estimate_json["reserved_bytes"] + estimate_json["overhead_detail"]["cuda_context"]
    assert result.plan_json(0)["reserved_bytes"] == estimate_json["reserved_bytes"]


@pytest.mark.parametrize("gpu,task,workspaces", [
    ("h100-sxm-80gb", "train", 2 * (32 + 1) * MiB),        # 4096 KiB x 8 on sm90, two threads (autograd's too)
    ("t4", "inference", (8 + 1) * MiB + 8 * 16 * 1024),    # 4096 KiB x 2 + 16 KiB x 8 elsewhere, one thread
])
def test_the_cublas_workspaces_are_allocated_through_the_allocator(gpu, task, workspaces):
    """CublasHandlePool.cpp allocates each (handle, stream) workspace from the caching allocator: it is in
    max_memory_allocated and max_memory_reserved, not beside them (an H200 gave +65 MiB in every row)."""
    result = estimate(Workload(model="tiny-llama", task=task, batch_size=2, seq_len=64), method="analytic",
                      gpu=get_gpu(gpu))
    assert result.overhead_detail["cublas_workspace"] == workspaces
    assert result.allocator["allocated_bytes"] == result.peak_bytes + workspaces
    assert result.reserved_bytes >= result.peak_bytes + workspaces
    assert result.peak_bytes + result.overhead_bytes == result.reserved_bytes + get_gpu(gpu).context_bytes
