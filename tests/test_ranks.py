"""Every layout over two real ranks (torchrun, gloo): ddp, ZeRO-1, fsdp2 (and its variants), tensor and pipeline
parallel, DeepSpeed's ZeRO stages — the per-rank peak against both estimates, and the results against one process."""
import pytest

from memfit.specs.workload import DEEPSPEED_REDUCE_BUCKET
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import HALF_SHAPE, POINT, SHAPE, assert_analytic, host_predicted_as_measured, predicted, rel

DATA_PARALLEL = [
    (("fsdp2",), 0), (("fsdp2", "checkpointing", "bf16-mixed"), 0),
    (("fsdp2:mp=autocast", "checkpointing", "bf16-mixed"), 0), (("fsdp2:reshard=false",), 0),
    (("fsdp2", "cpu-offload"), 0), (("ddp",), 0), ((), 1),
    (("tensor-parallel",), 0), (("tensor-parallel", "checkpointing", "bf16-mixed"), 0),
    (("pipeline-parallel",), 0),
    (("pipeline-parallel:schedule=gpipe,microbatches=4", "checkpointing", "bf16-mixed"), 0)]
SAME_RESULTS = [(("ddp",), 0), ((), 1), (("fsdp2",), 0), (("fsdp2", "cpu-offload"), 0), (("tensor-parallel",), 0),
                (("pipeline-parallel",), 0)]
# FSDP2's root group (tiny-llama's embeddings, final norm and LM head) gathered in float32. A real run on gloo
# frees its all-gather output at the copy-out, as the trace does, or in some runs not before the root's
# post-backward (8 MiB above the trace; what holds it was not pinned down): either is accepted.
FSDP2_ROOT_GROUP_BYTES = (2 * 4096 * 256 + 256) * 4
# DeepSpeed's engine trains in bfloat16: at HALF_SHAPE (a bf16 step is 15-35x a float32 one on a CPU without
# bfloat16 units)
DEEPSPEED = {**HALF_SHAPE, "world_size": 2, "engine": "deepspeed", "precision": "bf16-mixed"}
# ZeRO-1, ZeRO-Offload and more DeepSpeed rows, with their host RAM, are measured in
# benchmarks/technique_table_distributed.py: compiling DeepSpeed's CPU Adam for them costs the suite a minute and a half
DEEPSPEED_CASES = [(2, ()), (3, ())]


def _ranks_workload(techniques, zero):
    return ResolvedWorkload(**SHAPE, world_size=2, zero_stage=zero, techniques=techniques)


def _deepspeed_workload(zero, techniques, reduce_bucket=1_000_000):
    return ResolvedWorkload(**DEEPSPEED, zero_stage=zero, reduce_bucket=reduce_bucket, techniques=techniques)


def _same_results_workload(techniques, zero):
    return ResolvedWorkload(model="tiny-llama", task="train", batch_size=4, seq_len=192, world_size=2,
                            zero_stage=zero, techniques=techniques)


@pytest.fixture(scope="session")
def on_ranks():
    """Every 2-rank run of this module, made in three torchrun launches (starting the ranks costs more than a
    tiny model's step): the measured steps with both estimates beside them, DeepSpeed's with the analytic one
    (there is no trace of DeepSpeed's engine), and the short training runs."""
    from memfit.measurement import measure_many
    from memfit.measurement.ranks import train_ranks_many

    pytorch = {case: _ranks_workload(*case) for case in DATA_PARALLEL}
    deepspeed = {case: _deepspeed_workload(*case) for case in DEEPSPEED_CASES}
    deepspeed["default bucket", ()] = _deepspeed_workload(2, (), reduce_bucket=DEEPSPEED_REDUCE_BUCKET)
    trained = {case: _same_results_workload(*case) for case in SAME_RESULTS}
    trained["deepspeed", ()] = ResolvedWorkload(**DEEPSPEED, zero_stage=2, reduce_bucket=1_000_000)
    runs = dict(zip(pytorch, measure_many(list(pytorch.values()), estimates=("traced", "analytic"))))
    runs |= dict(zip(deepspeed, measure_many(list(deepspeed.values()), estimates=("analytic",))))
    losses_by_case = dict(zip(trained, train_ranks_many(list(trained.values()), steps=5, lr=1e-3)))
    return runs, losses_by_case


# The analytic estimate's error today where it is more than a rounding (rank 0's peak, torch 2.13 on 2 gloo ranks).
# A 2-rank run's peak varies from run to run by more than a point (five runs of this file: up to 4.5 % beside the
# outcomes below, e.g. fsdp2 + checkpointing + bf16-mixed -4.5 % once and within 1 % otherwise), so each is held to
# its error plus that spread, not one point
RANKS_SPREAD = 0.05
RANKS_ANALYTIC_ERROR = {("fsdp2", "cpu-offload"): -0.0537, ("tensor-parallel", "checkpointing", "bf16-mixed"): -0.0154,
                        ("pipeline-parallel",): -0.0108}


@pytest.mark.distributed
@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("techniques,zero", DATA_PARALLEL)
def test_data_parallel_on_two_real_ranks(techniques, zero, measured, on_ranks):
    """torchrun starts 2 gloo ranks; each rank's peak against rank 0's trace (fake process group) and the
    analytic model: FSDP2's shards, all-gathers and reduce-scatters (and CPUOffloadPolicy's host shards);
    DDP's buckets, rebuilt in the second step (with --zero 1, ZeroRedundancyOptimizer's share of the
    states); tensor parallel's split heads and MLP channels."""
    run = on_ranks[0][techniques, zero]
    sharded = bool(techniques) and techniques[0].partition(":")[0] in ("fsdp2", "tensor-parallel", "pipeline-parallel")
    single = measured(techniques[1:] if sharded or techniques[:1] == ("ddp",) else techniques)
    assert len(run.extra["rank_peak_bytes"]) == 2
    traced = predicted(run, "traced")
    # the outcomes a real run can take (limits.md): FSDP2 may free its root all-gather late; DDP's second step
    # may let go of the old bucket set (held by gloo's work) before it peaks
    late_free = FSDP2_ROOT_GROUP_BYTES if techniques[:1] and techniques[0].startswith("fsdp2") else 0
    ddp = techniques[:1] == ("ddp",) or zero
    old_buckets = run.extra["estimates"]["traced"]["model_state_bytes"]["parameters"] if ddp else 0
    assert (traced - old_buckets) * 0.97 <= run.peak_bytes <= (traced + late_free) * 1.03, (traced, run.peak_bytes)
    recorded = RANKS_ANALYTIC_ERROR.get(techniques, 0.0)
    assert_analytic(run, error=abs(recorded) + RANKS_SPREAD - POINT,
                    outcomes=(run.peak_bytes - late_free, run.peak_bytes + old_buckets))
    if sharded:
        assert run.peak_bytes < single.peak_bytes, "sharding the model states saves memory per rank"
    else:
        assert run.peak_bytes > single.peak_bytes, "DDP adds its gradient buckets to a whole model per rank"
    if "cpu-offload" in techniques:
        assert run.host_bytes > 0
        host_predicted_as_measured(run)


@pytest.mark.distributed
@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("techniques,zero", SAME_RESULTS)
def test_data_parallel_results_equal_one_process(techniques, zero, losses, on_ranks):
    """Every rank trains on the same batches, so the averaged gradients are one process's: the losses
    agree within numerics (the all-reduce sums in another order), on both ranks."""
    ranks, base = on_ranks[1][techniques, zero], losses(())
    for got in ranks:
        assert rel(got[0], base[0]) < 1e-3 and all(rel(a, b) < 0.02 for a, b in zip(got, base)), (got, base)
    assert rel(ranks[0][-1], ranks[1][-1]) < 1e-4 and ranks[0][-1] < ranks[0][0] - 0.1


@pytest.mark.distributed
@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("zero,techniques", DEEPSPEED_CASES)
def test_deepspeed_engine_on_two_real_ranks(zero, techniques, on_ranks):
    """DeepSpeed's ZeRO optimizers run on 2 gloo ranks; the analytic model of its states and buffers against the
    measured peak. A 1M-element reduction bucket (2 MB) keeps the bucket from dominating the peak (see the
    default-bucket test)."""
    run = on_ranks[0][zero, techniques]
    assert len(run.extra["rank_peak_bytes"]) == 2
    assert_analytic(run)
    assert run.host_bytes == 0


@pytest.mark.distributed
@pytest.mark.xdist_group("ranks")
def test_deepspeed_default_bucket_is_a_gigabyte_per_rank(on_ranks):
    """DeepSpeed's default reduce_bucket_size (5e8 elements) is a 1 GB half-precision buffer on every rank,
    ten times this model's whole step: memfit predicts it (and --reduce-bucket sizes it)."""
    run = on_ranks[0]["default bucket", ()]
    assert run.peak_bytes > 1e9
    assert rel(predicted(run, "analytic"), run.peak_bytes) < 0.03


@pytest.mark.distributed
@pytest.mark.xdist_group("ranks")
def test_deepspeed_results_match_one_process(losses, on_ranks):
    """DeepSpeed trains the bf16 weights from float32 masters: the same batches give one float32 process's
    losses within bf16 numerics, on both ranks."""
    ranks, base = on_ranks[1]["deepspeed", ()], losses((), shape=HALF_SHAPE)
    for got in ranks:
        assert all(rel(a, b) < 0.02 for a, b in zip(got, base)), (got, base)
    assert ranks[0] == ranks[1] and ranks[0][-1] < ranks[0][0] - 1


MESHES = [("fsdp2", "tensor-parallel:size=2"), ("fsdp2", "pipeline-parallel:stages=2")]


@pytest.fixture(scope="module")
def on_meshes():
    """torchtitan's 2-D layouts on 4 gloo ranks, in one torchrun launch: each mesh's measured step and a short
    training run (losses(())'s shape)."""
    from memfit.measurement.ranks import run_rank_jobs

    jobs = []
    for mesh in MESHES:
        jobs += [(ResolvedWorkload(**SHAPE, world_size=4, techniques=mesh), {"job": "measure"}),
                 (ResolvedWorkload(**{**SHAPE, "seq_len": 192}, world_size=4, techniques=mesh),
                  {"job": "train", "steps": 5, "lr": 1e-3})]
    results = run_rank_jobs(jobs)
    return {mesh: (results[2 * i], results[2 * i + 1]) for i, mesh in enumerate(MESHES)}


@pytest.mark.distributed
@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("mesh", MESHES)
def test_fsdp2_on_a_2x2_mesh(mesh, losses, on_meshes):
    """torchtitan's 2-D layouts on 4 gloo ranks: each block split over a pair of ranks (tensor parallel on the
    mesh's "tp" axis), or the blocks cut into two pipeline stages ("pp" axis); FSDP2 sharding what each rank holds
    over the other axis ("dp"). Every rank's peak (a pipeline's: its last stage's ranks, the highest) within 3 % of
    the trace (fake process group, same mesh: the highest of its ranks) and of the analytic model, or above them by
    the root group's all-gather when a rank frees it late (in some runs); the losses of 5 steps are one process's."""
    from memfit import estimate

    measured, ranks = on_meshes[mesh]
    workload = ResolvedWorkload(**SHAPE, world_size=4, techniques=mesh)
    traced, analytic = (estimate(workload, method=m).peak_bytes for m in ("traced", "analytic"))
    peaks = [r["peak_bytes"] for r in measured]
    assert len(peaks) == 4, peaks
    pipeline = "pipeline-parallel" in mesh[1]
    # every rank holds the same share of every block; a pipeline's last stage (ranks 2-3: final norm, head, logits)
    # is its highest, the first (0-1: embeddings) below it
    compared = peaks[2:] if pipeline else peaks
    for estimate_bytes in (traced, analytic):   # a rank may free its root all-gather late, as on 2 ranks (above)
        assert all(estimate_bytes * 0.97 <= peak <= (estimate_bytes + FSDP2_ROOT_GROUP_BYTES) * 1.03
                   for peak in compared), (traced, analytic, peaks)
    if pipeline:
        assert max(peaks[:2]) < min(peaks[2:]) and abs(peaks[0] - peaks[1]) <= FSDP2_ROOT_GROUP_BYTES, peaks
    highest = max(peaks)
    one_rank_fsdp2 = estimate(ResolvedWorkload(**SHAPE, world_size=4, techniques=("fsdp2",)), method="analytic")
    assert one_rank_fsdp2.peak_bytes > highest, "splitting the model too leaves each rank less"
    base = losses(())
    for got in (r["losses"] for r in ranks):
        assert rel(got[0], base[0]) < 1e-3 and all(rel(a, b) < 0.02 for a, b in zip(got, base)), (got, base)
