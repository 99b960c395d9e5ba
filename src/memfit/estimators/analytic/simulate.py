"""One step of a workload, simulated: the family's symbolic program run under the techniques' declarations.

Each technique says how it changes the program through its analytic hooks (techniques/base.py): the policy
the engine runs under (`analytic_policy`), the model's shape (`analytic_spec`, `analytic_layers`), the model
it declares (`analytic_model`), its weights (`analytic_weights`), the sequence it sees (`analytic_windows`),
buffers the step holds (`analytic_buffers`), the step itself (`analytic_train`) and the optimizer's states
and step (`analytic_states`, `analytic_step_temporaries`). This module runs them in the canonical order; it
names no technique.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any

from memfit.core.dtypes import dtype_name
from memfit.core.errors import ImpossibleCombination, NotModelled
from memfit.core.precision import get_precision
from memfit.estimators.analytic.engine import Engine, Policy
from memfit.estimators.analytic.families import registry
from memfit.estimators.analytic.optimizer import create_states, step_in_backward, step_temporaries
from memfit.estimators.analytic.program import Program, Windows
from memfit.estimators.gpu_overhead import CUDA_ALLOCATION_ROUND_BYTES
from memfit.estimators.sharding import effective_zero_stage
from memfit.specs.hardware import GPU
from memfit.techniques.resolve import ResolvedWorkload


def one_process_host_optimizer(workload: ResolvedWorkload) -> bool:
    """The optimizer, its states and the gradients live on the host, in this process (not in a sharding
    wrapper that keeps its shards there itself)."""
    return bool(workload.with_trait("host-optimizer")) and not workload.with_trait("offloads-shards")


def policy_of(workload: ResolvedWorkload, gpu: GPU | None) -> Policy:
    precision = get_precision(workload.precision)
    deepspeed = workload.engine == "deepspeed"   # DeepSpeed casts the model to the half type, no autocast
    autocast = dtype_name(precision.autocast_dtype) if precision.autocast_dtype else None
    fields: dict[str, Any] = dict(
        param_dtype=autocast if deepspeed else dtype_name(precision.param_dtype),
        autocast_dtype=None if deepspeed else autocast,
        backend="cuda" if gpu else "cpu", train=workload.task == "train",
        capability=gpu.compute_capability if gpu else (8, 0), attention_kernel=workload.source.attention_kernel,
        round_to=CUDA_ALLOCATION_ROUND_BYTES if gpu else 1,
        grads_leave=deepspeed,   # DeepSpeed copies each gradient into its reduction bucket and frees it
        grad_bucket=workload.reduce_bucket if deepspeed and workload.zero_stage < 3 else 0,
        master_dtype=dtype_name(precision.master_dtype) if precision.master_dtype else None,
    )
    writers: dict[str, str] = {}   # a setting two techniques set to different values: a combination the rules missed
    for technique in workload.hooked_techniques:
        for name, value in technique.analytic_policy(workload).items():
            if isinstance(value, bool):   # a mechanism switched on: any technique may
                fields[name] = fields.get(name) or value
                continue
            if name in writers and fields[name] != value:
                raise ImpossibleCombination(f"{writers[name]} and {technique.spec} both set the analytic engine's "
                                            f"{name} ({fields[name]!r} and {value!r}); they do not go together.")
            fields[name], writers[name] = value, technique.spec
    return Policy(**fields)


def program_of(workload: ResolvedWorkload, gpu: GPU | None):
    """(family module, spec): the written family's, or the program derived from the model's trace, checked here."""
    def peak_of(shaped: ResolvedWorkload) -> int:
        return max(point.total for point in simulate(shaped, gpu, 1).peaks.values())

    return registry.written_or_derived(workload, gpu, peak_of)


def derive_ahead(workloads, gpu: GPU | None) -> None:
    """Derive here the programs these workloads will be estimated with (planner/parallel.py: forked workers inherit
    them instead of each deriving its own); one that cannot be derived is left for its estimate to refuse."""
    for workload in workloads:
        if registry.takes_derived(workload):
            with contextlib.suppress(NotModelled):
                program_of(workload, gpu)


def sequence_windows(workload: ResolvedWorkload) -> Windows:
    """What the step's forwards see of each sequence, as the techniques leave it."""
    windows = Windows(sequence=workload.effective_seq_len)
    for technique in workload.hooked_techniques:
        windows = technique.analytic_windows(windows, workload)
    return windows


def simulate(workload: ResolvedWorkload, gpu: GPU | None, num_layers: int, weights: dict[str, int] | None = None,
             rank: int = 0, *, record_allocations: bool = False) -> Engine:
    """Run the family's program for one step at `num_layers` depth (with Python's cyclic garbage
    collector paused: the program frees by reference counting, and a collection pass only adds jitter).
    `record_allocations`: the engine keeps every allocation and free in order (Engine.allocations)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(workload, gpu, num_layers, weights, rank, record_allocations)
    finally:
        if enabled:
            gc.enable()


def _program(workload: ResolvedWorkload, gpu: GPU | None, num_layers: int, weights: dict[str, int] | None,
             rank: int, record_allocations: bool) -> Program:
    """The model declared as the techniques leave it. A technique that narrows the model narrows the one that
    trains (a teacher keeps the model's own shape: the canonical order puts the student first)."""
    family, spec = program_of(workload, gpu)
    teacher_spec = spec
    for technique in workload.hooked_techniques:
        spec = technique.analytic_spec(spec, workload)
        num_layers = technique.analytic_layers(num_layers, rank, workload)
    program = Program(Engine(policy_of(workload, gpu), weights), family, spec, teacher_spec, workload, num_layers,
                      rank)
    program.engine.allocations = [] if record_allocations else None
    program.engine.set_phase("setup")
    for technique in workload.hooked_techniques:
        technique.analytic_model(program)
    if not program.declared:
        program.declare()
    for technique in workload.hooked_techniques:
        technique.analytic_weights(program)
    return program


def _simulate(workload: ResolvedWorkload, gpu: GPU | None, num_layers: int, weights: dict[str, int] | None,
              rank: int, record_allocations: bool) -> Engine:
    program = _program(workload, gpu, num_layers, weights, rank, record_allocations)
    e, family, spec = program.engine, program.family, program.spec
    if e.policy.stream_blocks:
        e.stream_from_host()
    e.keep += family.declare_buffers(e, spec)
    batch, seq = workload.batch_size, workload.effective_seq_len
    windows = sequence_windows(workload)
    if windows.tokens != seq or windows.count > 1 or windows.views:   # the whole batch exists; the model sees views
        e.keep += [e.input(batch * seq, "int64") for _ in range(2 if workload.task == "train" else 1)]
        e.inputs_are_views = True
    if workload.task != "train":
        family.inference(e, spec, program.num_layers, batch, windows.tokens, workload.new_tokens)
        return e
    deepspeed = workload.engine == "deepspeed"
    if deepspeed and workload.zero_stage == 3:   # stage 3 allocates its reduction bucket at start-up
        e.keep.append(e.new(workload.reduce_bucket, e.policy.param_dtype, category="gradients"))
    for technique in workload.hooked_techniques:
        technique.analytic_buffers(program)
    if not one_process_host_optimizer(workload) and not deepspeed:   # DeepSpeed's states: host.deepspeed_states
        e.keep += create_states(e, workload)
    impl = workload.optimizer_impl_on(gpu is not None)
    in_backward = workload.with_trait("steps-in-backward") is not None
    if in_backward:
        step_in_backward(e, workload, impl)
    if get_precision(workload.precision).loss_scaling and not deepspeed:
        e.keep += [e.new(1, "float32", category="optimizer_states") for _ in range(2)]  # scale, growth tracker
    if not any(technique.analytic_train(program) for technique in workload.hooked_techniques):
        for window in range(min(windows.count, 2)):   # the second runs with gradients alive
            e.set_phase("forward")
            overlap = window and windows.overlap   # a later window copies its labels to mask the overlap
            relabelled = e.new(batch * windows.tokens, "int64", category="inputs") if overlap else None
            loss = program.loss(batch, windows.tokens)
            e.cast_cache.clear()                    # the autocast region ends with the forward
            e.set_phase("backward", segment="post")
            e.backward(loss)
            del loss, relabelled
    e.set_phase("optimizer")
    # the step runs on this rank's shard (ZeRO-1/2, or a layout that shards like ZeRO-3)
    shards = workload.data_parallel_size if effective_zero_stage(workload) >= 1 else 1
    # host steps: host.py; DeepSpeed's fused Adam; a step in backward ran there
    if not workload.with_trait("host-optimizer") and not deepspeed and not in_backward:
        step_temporaries(e, workload, impl, shards=shards)
    return e
