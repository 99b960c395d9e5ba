"""NVMe offload (DeepSpeed's ZeRO-Infinity, -t nvme-offload): the drive and host bytes worked out by hand from
DeepSpeed 0.19's rules, the refusals, the exported config, the planner's check of the machine's drive, and a real
run on 2 gloo ranks that swaps to files (when DeepSpeed's ops are compiled here: see the skip)."""
import json

import pytest

import memfit
from memfit.core.errors import MemfitError
from memfit.estimators.analytic.host import nvme_swap_bytes
from memfit.techniques.base import parse_technique
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import SHAPE, predicted

NVME = {**SHAPE, "engine": "deepspeed", "zero_stage": 3, "precision": "bf16-mixed", "reduce_bucket": 1_000_000}


def test_drive_and_host_bytes_by_hand():
    """Three parameters over 2 ranks: partitions of 524,288, 500 and 150,000 elements (674,788 in all, one
    sub-group). Drive (DeepSpeed's swap_tensor/ rules): masters and two moments of the sub-group, padded to
    256 float32 elements (1 KiB alignment): 12 x 674,816; the float32 gradient partitions of at least 1 MiB
    (only the first): 4 x 524,288; the half weight partitions of at least 1 MiB (the first): 2 x 524,288.
    Host: 5 weight swap buffers of 1e8 half elements (padded to 100,000,256), 4 optimizer swap buffers of the
    padded sub-group in float32, the flat half weights and half gradients (2 x 2 x 674,788), and the float32
    gradients too small to swap, held for the step (4 x 150,500)."""
    host, drive = nvme_swap_bytes([1_048_576, 1_000, 300_000], 2)
    assert drive == 12 * 674_816 + 4 * 524_288 + 2 * 524_288
    assert host == 5 * 100_000_256 * 2 + 4 * 674_816 * 4 + 4 * 674_788 + 4 * 150_500


def test_estimate_reports_the_drive_and_leaves_the_device_as_zero_offload():
    """The device holds what ZeRO-Offload leaves it; host RAM holds DeepSpeed's swap buffers (a gigabyte of weight
    buffers whatever the model's size) instead of the states, which go to the drive."""
    offload, nvme = (memfit.estimate(ResolvedWorkload(**NVME, world_size=2, techniques=(t,)), method="analytic")
                     for t in ("cpu-offload", "nvme-offload"))
    assert nvme.peak_bytes == offload.peak_bytes and offload.nvme_bytes == 0
    psi = nvme.num_parameters
    assert 12 * psi // 2 < nvme.nvme_bytes < 18 * psi // 2
    assert nvme.host_bytes > 1e9 > offload.host_bytes
    assert nvme.to_json()["nvme_bytes"] == nvme.nvme_bytes


def test_seventy_billion_on_one_gpu_swaps_its_states():
    """Llama-3.1-70B on one GPU with DeepSpeed ZeRO-3 (allowed with one rank under --engine deepspeed): the
    masters and moments (12 bytes a parameter), most float32 gradients (4) and half weights (2) go to the drive;
    host RAM keeps 1e9 half weights (max_in_cpu), the half gradients (DeepSpeed's flat buffer: 141 GB here) and
    the swap buffers (the optimizer's: 4 sub-groups of 1e9 float32 elements)."""
    workload = ResolvedWorkload(model="llama-3.1-70b", task="train", batch_size=1, seq_len=2048, engine="deepspeed",
                                zero_stage=3, precision="bf16-mixed", techniques=("nvme-offload", "checkpointing"))
    estimate = memfit.estimate(workload, method="analytic")
    psi = estimate.num_parameters
    assert 17.9 * psi < estimate.nvme_bytes < 18.1 * psi
    gib = 2**30
    assert 2 * 1e9 + 2 * psi < estimate.host_bytes < 2 * 1e9 + 2 * psi + 20 * gib


def test_refusals_say_what_to_add():
    with pytest.raises(MemfitError, match="--engine deepspeed --zero 3"):
        ResolvedWorkload(**SHAPE, techniques=("nvme-offload",))
    with pytest.raises(MemfitError, match="--engine deepspeed --zero 3"):
        ResolvedWorkload(**{**NVME, "zero_stage": 2}, world_size=2, techniques=("nvme-offload",))
    with pytest.raises(MemfitError, match="keep one"):
        ResolvedWorkload(**NVME, world_size=2, techniques=("nvme-offload", "cpu-offload"))


def test_exported_deepspeed_config_swaps_to_the_given_folder():
    technique = parse_technique("nvme-offload:path=/mnt/nvme0")
    assert technique.spec == "nvme-offload:path=/mnt/nvme0"
    workload = ResolvedWorkload(**NVME, world_size=2, techniques=(technique.spec,))
    zero = technique.export("deepspeed", workload).settings["zero_optimization"]
    assert zero["stage"] == 3
    for part in ("offload_optimizer", "offload_param"):
        assert zero[part]["device"] == "nvme" and zero[part]["nvme_path"] == "/mnt/nvme0"


def test_planner_checks_the_instance_drive():
    """On an instance whose sources list no local NVMe, a plan that swaps to a drive is short of it; on one with
    drives it fits (a plan the search makes for 2 GPUs: DeepSpeed ZeRO-3 layouts carry nvme-offload)."""
    from memfit.planner.request import PlanRequest
    from memfit.planner.search import Search
    from memfit.specs.instances import instance_catalog

    catalog = instance_catalog().values()
    with_drive = next(i for i in catalog if i.local_nvme_bytes and i.gpus >= 2)
    without = next(i for i in catalog if not i.local_nvme_bytes and i.gpus >= 2)
    for instance, short in ((with_drive, None), (without, "local NVMe")):
        request = PlanRequest(model="tiny-llama", gpu=instance.gpu, num_gpus=2, seq_len=256, global_batch=8,
                              instance=instance, host_ram_bytes=instance.host_ram_bytes)
        search = Search(request)
        swapping = [(c, w, b) for c, w, b in search.workloads() if w.with_trait("swaps-to-disk")]
        assert swapping and all(w.engine == "deepspeed" and w.zero_stage == 3 for _, w, _ in swapping)
        evaluated = search.evaluate(*swapping[0])
        assert evaluated.short == short, (instance.name, evaluated.short)


def _unbuilt_ops() -> list[str]:
    from memfit.steps.deepspeed_loop import unbuilt_deepspeed_ops
    try:
        return unbuilt_deepspeed_ops(offload=True, swaps=True)
    except MemfitError as exc:   # no libaio
        return [str(exc)]


@pytest.mark.distributed
@pytest.mark.xdist_group("ranks")
def test_real_swap_on_two_ranks_matches_the_estimate():
    """DeepSpeed swaps to files in a temporary folder on this machine's disk through its async_io op (libaio):
    what it wrote (the folder's bytes after the step) and the host buffers it swapped through, per rank, against
    the analytic estimate, to the byte; the device side as ZeRO-Offload's."""
    unbuilt = _unbuilt_ops()
    if unbuilt:
        pytest.skip(f"DeepSpeed's ops for NVMe offload are not compiled here ({', '.join(unbuilt)}): compiling them "
                    "takes about 4 minutes on 2 cores, more than this suite can spend; run "
                    "MEMFIT_DEEPSPEED_OPS=1 ./scripts/setup.sh once (it installs libaio-dev where it can) and this "
                    "test runs; benchmarks/technique_table_distributed.py measures the same row")
    from memfit.measurement import measure

    run = measure(ResolvedWorkload(**{**NVME, "batch_size": 2, "seq_len": 64}, world_size=2,
                                   techniques=("nvme-offload",)), estimates=("analytic",))
    analytic = run.extra["estimates"]["analytic"]
    assert run.nvme_bytes > 12 * run.num_parameters // 2
    assert run.nvme_bytes == analytic["nvme_bytes"] and run.host_bytes == analytic["host_bytes"]
    assert abs(predicted(run, "analytic") - run.peak_bytes) / run.peak_bytes < 0.15
    assert json.loads(json.dumps(run.to_json()))["nvme_bytes"] == run.nvme_bytes
