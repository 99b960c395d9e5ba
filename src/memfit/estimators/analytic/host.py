"""Host RAM and DeepSpeed's states: what the analytic estimator adds to the simulated step.

  offload_host_bytes   an optimizer that steps in host RAM (an offload technique's `host-optimizer` trait):
                       its master weights, gradients and states, and the host step's temporaries.
  deepspeed_states     DeepSpeed's ZeRO optimizers keep their states in their own flat buffers, which the
                       simulated step (half weights, gradients into the bucket) does not hold.
  nvme_swap_bytes      ZeRO-Infinity: what DeepSpeed swaps to the drive, and the host buffers it swaps through.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, cast

from memfit.core.dtypes import dtype_name
from memfit.core.precision import get_precision
from memfit.estimators.analytic.engine import Engine, Policy
from memfit.estimators.analytic.optimizer import create_states, step_temporaries
from memfit.estimators.analytic.simulate import one_process_host_optimizer, program_of
from memfit.techniques.resolve import ResolvedWorkload


def offload_host_bytes(workload: ResolvedWorkload, gpu=None) -> tuple[int, int]:
    """Host RAM of an optimizer offloaded to the host (techniques/offload.py), from the closed forms of the
    device's states: (held all step: float32 master weights, their gradients and the optimizer's states — with
    a sharding wrapper that keeps its shards on the host, the shards in the model's dtype, / N; held in the step
    only: the CPU step's temporaries and the cast back to a half-precision model)."""
    if not workload.with_trait("host-optimizer") or workload.task != "train":
        return 0, 0
    family, spec = program_of(workload, gpu)
    model_dtype = dtype_name(get_precision(workload.precision).param_dtype)
    one_process = one_process_host_optimizer(workload)
    if not one_process:   # the sharding wrapper's shards of what this rank holds (on a 2-D mesh: its split)
        for technique in workload.technique_configs:
            spec = technique.analytic_spec(spec, workload)
    e = Engine(Policy("float32" if one_process else model_dtype, None, "cpu", train=True))
    e.set_phase("setup")
    family.declare_params(e, spec, workload.source.num_layers)
    trainable = [p for p in e.params.values() if p.grad]
    held = [e.new(p.numel, p.dtype, category="gradients") for p in trainable]
    held += create_states(e, workload)
    persistent = e.total
    e.set_phase("optimizer")
    step_temporaries(e, workload, workload.optimizer_impl_on(False))
    if one_process and model_dtype != "float32" and trainable:
        cast = e.new(max(p.numel for p in trainable), model_dtype)
        del cast
    step = e.peaks[("optimizer", "pre")].total - persistent
    ranks = 1 if one_process else workload.data_parallel_size
    return -(-persistent // ranks), -(-step // ranks)


def parameter_sizes(workload: ResolvedWorkload, gpu=None) -> list[int]:
    family, spec = program_of(workload, gpu)
    try:
        hash(spec)
    except TypeError:   # a spec that cannot be a cache key
        return list(_declared_sizes.__wrapped__(family, spec, workload.source.num_layers))
    return list(_declared_sizes(family, spec, workload.source.num_layers))


@functools.lru_cache(maxsize=64)   # a planner asks for the same model's sizes once per candidate
def _declared_sizes(family, spec, num_layers: int) -> tuple[int, ...]:
    e = Engine(Policy("float32", None, "cpu", False))
    family.declare_params(e, spec, num_layers)
    return tuple(p.numel for p in e.params.values())


# DeepSpeed 0.19's ZeRO-Infinity defaults (runtime/swap_tensor/constants.py, runtime/zero/offload_config.py, config.py)
AIO_MIN_BYTES = 1 << 20             # a tensor smaller than this is not swapped (max(MIN_AIO_BYTES, aio block_size))
AIO_ALIGN_BYTES = 1024              # swapped tensors are padded to it (AIO_ALIGNED_BYTES x intra_op_parallelism 1)
WEIGHT_SWAP_BUFFERS, WEIGHT_SWAP_BUFFER_ELEMENTS = 5, 100_000_000   # offload_param buffer_count, buffer_size
OPTIMIZER_SWAP_BUFFERS = 4          # offload_optimizer buffer_count
SUB_GROUP_ELEMENTS = 1_000_000_000  # zero_optimization sub_group_size
WEIGHTS_IN_CPU = 1_000_000_000      # offload_param max_in_cpu: half weights also kept flat in host RAM


def _aligned(numel: int, itemsize: int) -> int:
    step = AIO_ALIGN_BYTES // itemsize
    return -(-numel // step) * step


def nvme_swap_bytes(sizes: list[int], n: int) -> tuple[int, int]:
    """ZeRO-Infinity on one of `n` ranks for parameters of `sizes` elements (read from DeepSpeed 0.19's stage3.py,
    partition_parameters.py and swap_tensor/, and measured on 2 and 4 gloo ranks): (host bytes, drive bytes).
    Drive: the float32 masters and both Adam moments of each sub-group of the rank's partition (padded to the
    I/O alignment), each parameter's float32 gradient partition and half weight partition that is at least 1 MiB
    (smaller ones stay in host RAM). Host: the weights' swap buffers (5 x 1e8 half elements, allocated whatever
    the model's size), the optimizer's (4 x the largest sub-group in float32), the flat half weights up to
    max_in_cpu (beyond it they are read from their swap files), the flat half gradients, and the unswapped
    float32 gradients (from backward to the step). Not modelled: weight partitions under 1 MiB beyond max_in_cpu
    (they stay in host RAM one by one)."""
    parts = [-(-size // n) for size in sizes]
    total = sum(parts)
    groups, group = [], 0
    for part in parts:   # stage3._create_fp16_sub_groups: close a group once it reaches sub_group_size
        group += part
        if group >= SUB_GROUP_ELEMENTS:
            groups.append(group)
            group = 0
    groups += [group] if group else []
    swapped_groups = [g for g in groups if g * 4 >= AIO_MIN_BYTES]
    big_grads = [part for part in parts if part * 4 >= AIO_MIN_BYTES]
    swapped_grads = sum(part // (AIO_ALIGN_BYTES // 4) * (AIO_ALIGN_BYTES // 4) for part in big_grads)
    drive = (12 * sum(_aligned(g, 4) for g in swapped_groups)
             + 4 * swapped_grads
             + 2 * sum(_aligned(part, 2) for part in parts if part * 2 >= AIO_MIN_BYTES))
    host = (WEIGHT_SWAP_BUFFERS * _aligned(WEIGHT_SWAP_BUFFER_ELEMENTS, 2) * 2
            + OPTIMIZER_SWAP_BUFFERS * _aligned(max(groups), 4) * 4
            + 2 * min(total, WEIGHTS_IN_CPU) + 2 * total
            + 12 * (sum(groups) - sum(swapped_groups)) + 4 * (total - swapped_grads))
    return host, drive


PERSISTENCE_THRESHOLD = 100_000     # stage3_param_persistence_threshold: smaller weights are never partitioned
MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance (and max_live_parameters): gathered weights kept


def stage3_gathered_bytes(sizes: list[int]) -> int:
    """ZeRO-3's gathered half weights on a rank's device at the forward's end (DeepSpeed 0.19's
    partitioned_param_coordinator.py and partition_parameters.py; measured on gloo ranks): a gathered weight is
    released after use only when its next use is more than max_reuse_distance elements away, so up to 1e9
    partitioned elements stay gathered; weights of at most param_persistence_threshold elements are never
    released (held whole on every rank)."""
    persistent = sum(size for size in sizes if size <= PERSISTENCE_THRESHOLD)
    return 2 * (min(sum(sizes) - persistent, MAX_REUSE_DISTANCE) + persistent)


class DeepSpeedStates(NamedTuple):
    at_peak: dict[str, int]           # the device's categories at its peak
    component_peaks: dict[str, int]
    host_bytes: int
    nvme_bytes: int
    in_optimizer_step: bool           # the peak is the optimizer step's (stage 3), not the simulated step's


def deepspeed_states(workload: ResolvedWorkload, psi: int, at_peak: dict[str, int], component_peaks: dict[str, int]
                     ) -> DeepSpeedStates:
    """DeepSpeed's model states on one rank (read from DeepSpeed 0.19's ZeRO optimizers and measured on 2 and 4 gloo
    ranks): its half weights, float32 master weights and Adam moments of the partition (12 bytes per parameter
    / N) and a float32 gradient partition (4 / N). Stages 1-2: the whole half weights, the float32 gradient
    partition held throughout. Stage 3 (`stage3_gathered_bytes`): the half weights' partition, the weights it gathers
    (kept until reused) and the small ones it never partitions; a half gradient partition (2 / N) through the
    step, the float32 one (4 / N) made for the optimizer step only. The simulated step (half weights, each
    gradient copied into the bucket and freed) gives the rest. With an offload technique (ZeRO-Offload)
    masters, moments and float32 gradients live in host RAM, at stage 3 the weights' partitions and the half
    gradient partition too; at stages 1-2 the device still holds a float32 partition-sized buffer (measured,
    not traced to its owner), a half copy of the partition for the weights' way back and two
    largest-parameter gradient staging buffers. NVMe offload (ZeRO-Infinity) leaves the device as ZeRO-Offload
    does; host and drive: `nvme_swap_bytes`."""
    n, stage = workload.world_size, workload.zero_stage
    offload = bool(workload.with_trait("host-optimizer"))

    def part(nbytes: int) -> int:
        return -(-nbytes * psi // n)

    at, comp = dict(at_peak), dict(component_peaks)
    sizes = parameter_sizes(workload)
    host = drive = 0
    if stage == 3:
        gathered = stage3_gathered_bytes(sizes)
        states = {"parameters": gathered + (0 if offload else part(2)),
                  "optimizer_states": 0 if offload else part(12), "gradients": 0 if offload else part(2)}
        host = part(12) + part(4) + part(2) + part(2) if offload else 0   # + half weights and gradients
        step = {**dict.fromkeys(at, 0), **states, "gradients": states["gradients"] + (0 if offload else part(4))}
    else:
        states = {"parameters": 2 * psi, "optimizer_states": part(12), "gradients": part(4)}
        if offload:
            host = part(12) + part(4)
            states.update(optimizer_states=0, parameters=2 * psi + part(2),
                          gradients=part(4) + 2 * 2 * max(sizes))
        step = None
    at["parameters"] = comp["parameters"] = states["parameters"]
    at["optimizer_states"] = comp["optimizer_states"] = states["optimizer_states"]
    at["gradients"] += states["gradients"]           # the simulated ones: the bucket and gradients in flight
    comp["gradients"] += states["gradients"]
    in_step = step is not None and sum(step.values()) > sum(at.values())
    if step is not None:   # stage 3: the optimizer step, with its float32 gradient partition, may peak higher
        comp["gradients"] = max(comp["gradients"], step["gradients"])
    if workload.with_trait("swaps-to-disk"):
        host, drive = nvme_swap_bytes(sizes, n)
    return DeepSpeedStates(cast("dict[str, int]", step) if in_step else at, comp, host, drive, in_step)
