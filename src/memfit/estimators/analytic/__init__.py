"""The analytic estimator: closed forms, evaluated by running each family's symbolic program.

Instant at any size (no tensors, real or fake): the program is run at three small depths and
extrapolated exactly to the model's depth, like the traced estimator. Model states follow the
optimizer's implementation (optimizer.py) and the ZeRO stages (sharding.py); `--engine deepspeed`
runs the model in half precision with DeepSpeed's own states and buffers (`deepspeed_states`).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace

from memfit.core.categories import CATEGORIES, MODEL_STATE_CATEGORIES
from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision
from memfit.estimators.analytic.distillation import declare_teacher_and_student, distillation_loss
from memfit.estimators.analytic.engine import Engine, Policy, Sym
from memfit.estimators.analytic.families import registry
from memfit.estimators.analytic.optimizer import create_states, step_temporaries
from memfit.estimators.analytic.weights import pruned_spec, transform_weights
from memfit.estimators.breakdown import MemoryEstimate
from memfit.estimators.extrapolate import (
    NotLinear,
    RegionPeak,
    extrapolate,
    extrapolate_host,
    extrapolation_depths,
    peak_of,
)
from memfit.estimators.gpu_overhead import CUDA_ALLOCATION_ROUND_BYTES, add_gpu_overheads
from memfit.estimators.sharding import per_rank, state_weights
from memfit.specs.hardware import GPU
from memfit.specs.workload import Workload
from memfit.techniques.pipeline import stage_layers
from memfit.techniques.resolve import ResolvedWorkload, resolve

def _dtype(dtype) -> str:
    """A torch dtype as the symbolic engine names it ("float32", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def policy_of(workload: ResolvedWorkload, gpu: GPU | None) -> Policy:
    precision = get_precision(workload.precision)
    checkpointing = workload.technique("checkpointing")
    deepspeed = workload.engine == "deepspeed"   # DeepSpeed casts the model to the half type, no autocast
    autocast = _dtype(precision.autocast_dtype) if precision.autocast_dtype else None
    return Policy(
        param_dtype=autocast if deepspeed else _dtype(precision.param_dtype),
        autocast_dtype=None if deepspeed else autocast,
        backend="cuda" if gpu else "cpu", train=workload.task == "train",
        round_to=CUDA_ALLOCATION_ROUND_BYTES if gpu else 1,
        checkpoint_every=checkpointing.every if checkpointing else 0,
        checkpoint_selective=bool(checkpointing) and checkpointing.mode == "selective",
        checkpoint_offload=bool(checkpointing) and checkpointing.mode == "offload",
        loss_chunks=chunked.chunks if (chunked := workload.technique("chunked-ce")) else 0,
        fsdp=(fsdp2 := workload.technique("fsdp2")) is not None,
        fsdp_reshard=not fsdp2 or fsdp2.reshard,
        grads_leave=host_optimizer(workload) or bool((ddp := workload.technique("ddp")) and ddp.bucket_view)
        or deepspeed,   # DeepSpeed copies each gradient into its reduction bucket and frees it
        grad_bucket=workload.reduce_bucket if deepspeed and workload.zero_stage < 3 else 0,
        stream_blocks=workload.technique("stream-layers") is not None,
    )


def host_optimizer(workload: ResolvedWorkload) -> bool:
    """cpu-offload in one process: the optimizer, its states and the gradients live on the host."""
    return workload.technique("cpu-offload") is not None and workload.technique("fsdp2") is None


def simulate(workload: ResolvedWorkload, gpu: GPU | None, num_layers: int, weights: dict[str, int] | None = None,
             rank: int = 0) -> Engine:
    """Run the family's program for one step at `num_layers` depth (with Python's cyclic garbage
    collector paused: the program frees by reference counting, and a collection pass only adds jitter)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(workload, gpu, num_layers, weights, rank)
    finally:
        if enabled:
            gc.enable()


def _simulate(workload: ResolvedWorkload, gpu: GPU | None, num_layers: int, weights: dict[str, int] | None,
              rank: int) -> Engine:
    family, spec = registry.family_of(workload.source)
    pipeline = workload.technique("pipeline-parallel")
    if pipeline:   # this rank's blocks, and the embeddings or the head
        num_layers = len(stage_layers(num_layers, rank, workload.world_size))
    if workload.technique("tensor-parallel"):   # one rank's blocks: its share of the heads and MLP channels
        n = workload.world_size
        spec = replace(spec, heads=spec.heads // n, kv_heads=spec.kv_heads // n, intermediate=spec.intermediate // n)
    model_spec, spec = spec, pruned_spec(spec, workload)   # with distill, pruning narrows the student only
    e = Engine(policy_of(workload, gpu), weights)
    e.set_phase("setup")
    if distill := workload.technique("distill"):   # the model is the teacher; the student trains
        teacher, student_layers = declare_teacher_and_student(e, family, model_spec, spec, num_layers, distill)
    else:
        family.declare_params(e, spec, num_layers)
    transform_weights(e, family, spec, workload)
    if pipeline:
        dropped = (() if rank == 0 else ("embed",)) + (() if rank == workload.world_size - 1 else ("norm", "lm_head"))
        for name in dropped:
            e.params.pop(name, None)
    if e.policy.stream_blocks:
        e.stream_from_host()
    e.keep += family.declare_buffers(e, spec)
    batch, seq = workload.batch_size, workload.effective_seq_len
    windows = sequence_windows(workload)
    if windows.tokens != seq or windows.count > 1 or pipeline:   # the whole batch exists; the model sees views
        e.keep += [e.input(batch * seq, "int64") for _ in range(2 if workload.task == "train" else 1)]
        e.inputs_are_views = True
    deepspeed = workload.engine == "deepspeed"
    if workload.task == "train":
        if deepspeed and workload.zero_stage == 3:   # stage 3 allocates its reduction bucket at start-up
            e.keep.append(e.new(workload.reduce_bucket, e.policy.param_dtype, category="gradients"))
        if workload.technique("ddp"):   # DDP's reduction buckets: a flat copy of every gradient, built with
            # DDP, and rebuilt in gradient order in the second step, which holds both sets (techniques/distributed.py)
            trainable = sum(p.numel for p in e.params.values() if p.grad)
            e.keep += [e.new(trainable, e.policy.param_dtype, category="gradients") for _ in range(2)]
        if not host_optimizer(workload) and not deepspeed:   # DeepSpeed's states: deepspeed_states
            e.keep += create_states(e, workload.optimizer)
        if get_precision(workload.precision).loss_scaling and not deepspeed:
            e.keep += [e.new(1, "float32", category="optimizer_states") for _ in range(2)]  # scale, growth tracker
        if pipeline:
            pipeline_schedule(e, family, spec, workload, pipeline, rank, num_layers)
        for window in range(0 if pipeline else min(windows.count, 2)):   # the second runs with gradients alive
            e.set_phase("forward")
            relabelled = e.new(batch * windows.tokens, "int64", category="inputs") if window and windows.overlap else None
            if distill:
                loss = distillation_loss(e, family, (model_spec, spec), teacher, (num_layers, student_layers),
                                         batch, windows.tokens)
            else:
                loss = family.train(e, spec, num_layers, batch, windows.tokens)
            e.cast_cache.clear()                    # the autocast region ends with the forward
            e.set_phase("backward", segment="post")
            e.backward(loss)
            del loss, relabelled
        e.set_phase("optimizer")
        # the step runs on this rank's shard (ZeRO-1/2, or FSDP2's DTensor shards)
        shards = workload.world_size if workload.zero_stage >= 1 or workload.technique("fsdp2") else 1
        on_device = not workload.technique("cpu-offload")   # cpu-offload steps on the host (FSDP2's too)
        if on_device and not deepspeed:   # DeepSpeed's fused Adam: no temporaries
            step_temporaries(e, workload.optimizer, foreach=gpu is not None, shards=shards)
    else:
        family.inference(e, spec, num_layers, batch, windows.tokens, workload.new_tokens)
    return e


def pipeline_schedule(e: Engine, family, spec, workload: ResolvedWorkload, pipeline, rank: int, num_layers: int) -> None:
    """Rank `rank`'s micro-batches in the schedule's order (techniques/pipeline.py): GPipe runs every
    forward, then every backward; 1F1B runs min(M, N - rank) forwards, then alternates a backward and a
    forward, then the remaining backwards. Each micro-batch's tape and output (the last rank's: its
    logits) live until its backward; a stage that is not the last starts its backward from the gradient
    the next rank sends."""
    n, m = workload.world_size, pipeline.microbatches
    first, last = rank == 0, rank == n - 1
    micro = workload.batch_size // m
    if pipeline.schedule == "gpipe":
        order = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    else:
        warmup = min(m, n - rank)
        order = [("F", i) for i in range(warmup)]
        for i in range(m):
            order.append(("B", i))
            if warmup + i < m:
                order.append(("F", warmup + i))
    in_flight: dict[int, tuple[list, Sym, list]] = {}
    for kind, i in order:
        if kind == "F":
            e.set_phase("forward")
            e.tape, held = [], []
            out = family.train(e, spec, num_layers, micro, workload.effective_seq_len, first=first, last=last,
                               stage_outputs=held)
            e.cast_cache.clear()
            in_flight[i] = (e.tape, out, held)
        else:
            e.set_phase("backward", segment="post")
            e.tape, out, held = in_flight.pop(i)
            e.backward(out, None if last else e.new(out.numel, out.dtype))
        del out, held
    e.tape = []


def offload_host_bytes(workload: ResolvedWorkload) -> tuple[int, int]:
    """Host RAM under cpu-offload (techniques/offload.py), from the closed forms of the device's states:
    (held all step: float32 master weights, their gradients and the optimizer's states — with fsdp2 the
    shards in the model's dtype, / N; held in the step only: the CPU step's temporaries and the cast
    back to a half-precision model)."""
    if workload.technique("cpu-offload") is None or workload.task != "train":
        return 0, 0
    family, spec = registry.family_of(workload.source)
    model_dtype = _dtype(get_precision(workload.precision).param_dtype)
    one_process = host_optimizer(workload)
    e = Engine(Policy("float32" if one_process else model_dtype, None, "cpu", train=True))
    e.set_phase("setup")
    family.declare_params(e, spec, workload.source.num_layers)
    trainable = [p for p in e.params.values() if p.grad]
    held = [e.new(p.numel, p.dtype, category="gradients") for p in trainable]
    held += create_states(e, workload.optimizer)
    persistent = e.total
    e.set_phase("optimizer")
    step_temporaries(e, workload.optimizer, foreach=False)
    if one_process and model_dtype != "float32" and trainable:
        cast = e.new(max(p.numel for p in trainable), model_dtype)
        del cast
    step = e.peaks[("optimizer", "pre")].total - persistent
    ranks = 1 if one_process else workload.world_size
    return -(-persistent // ranks), -(-step // ranks)


@dataclass(frozen=True)
class Windows:
    tokens: int          # tokens per sequence in one forward
    count: int           # forwards (with backward) per step
    overlap: bool        # later windows copy their labels to mask the overlap


def sequence_windows(workload: ResolvedWorkload) -> Windows:
    """What the sequence techniques leave of the sequence (techniques/sequence.py)."""
    from memfit.techniques.sequence import window_starts

    seq = workload.effective_seq_len
    truncate = workload.technique("truncate")
    if truncate:
        seq = min(seq, truncate.max_len)
    chunks = workload.technique("sequence-chunks")
    if not chunks or chunks.window >= seq:
        return Windows(seq, 1, False)
    stride = chunks.stride or chunks.window
    return Windows(chunks.window, len(window_starts(seq, chunks.window, stride)), stride < chunks.window)


def _regions(e: Engine, num_layers: int, period: int, tail: int | None = None) -> dict[tuple[str, str], RegionPeak]:
    """Peaks per (phase, region): pre, first `period` layers, last `tail` (default `period`) layers, post."""
    tail = tail or period
    regions: dict[tuple[str, str], RegionPeak] = {}
    for (phase, segment), (point, cmax) in e.peak_table().items():
        if phase == "setup":
            continue
        if isinstance(segment, tuple):   # (stack, layer): a layer of one of the repeated stacks
            stack, layer = segment
            if layer < period:
                name = f"{stack}:first"
            elif layer >= num_layers - tail:
                name = f"{stack}:last"
            else:
                continue
        else:
            name = segment
        at, cm = dict(point.at), dict(cmax)
        key = (phase, name)
        if key in regions:   # first and last coincide for a one-period stack
            old = regions[key]
            if sum(at.values()) > old.total:
                old.at_max = at
            old.category_max = {c: max(old.category_max[c], cm[c]) for c in CATEGORIES}
        else:
            regions[key] = RegionPeak(phase, at, cm)
    if num_layers <= period:   # one run of layers: it is both the first and the last
        for (phase, name), region in list(regions.items()):
            if name.endswith(":first"):
                regions[(phase, name[:-5] + "last")] = RegionPeak(phase, dict(region.at_max),
                                                                  dict(region.category_max))
    return regions


def analytic_estimate(workload: Workload, gpu: GPU | None = None, *, modules: bool = False) -> MemoryEstimate:
    started = time.perf_counter()
    workload = resolve(workload)
    source = workload.source
    if not source.is_hf:
        raise MemfitError(f"the analytic estimator needs a transformer config; {source.name!r} is a custom "
                          "module: use --method traced.")
    _, spec = registry.family_of(source)
    period = spec.period
    layers = source.num_layers
    weights, divisor, notes = state_weights(workload)
    pipeline = workload.technique("pipeline-parallel") is not None
    depths, failure = None, None
    # pipeline stages split the blocks (every rank, whole); a distilled student's depth is not linear in the model's
    if not (pipeline or workload.technique("distill")):
        # FSDP2 prefetches the next block's parameters, so in backward the second-to-last block differs from
        # the rest too: when the first fit fails, the last region is two periods wide, sampled from 3 periods
        for first, tail in ((2, period), (3, 2 * period)):
            depths = extrapolation_depths(layers, period, first=first)
            if not depths:
                break
            engines = {n: simulate(workload, gpu, n, weights) for n in depths}
            samples = {n: _regions(e, n, period, tail) for n, e in engines.items()}
            try:
                regions = extrapolate(samples, layers)
                saved = extrapolate_host({n: {"step": e.host_peak} for n, e in engines.items()}, layers)
                break
            except NotLinear as exc:
                failure, depths = exc, None
            del engines
    if failure and not depths:   # not expected for these programs; fall back to the full depth
        notes.append(f"depth extrapolation failed ({failure}); simulated every layer")
    if not depths:
        # Pipeline: the first rank holds the most blocks (stage_layers gives the extra ones to the first stages),
        # the embeddings and the most micro-batches in flight (1F1B), the last the head and the logits; a middle
        # rank holds no more than the first of anything, so those two bound every rank
        ranks = sorted({0, workload.world_size - 1}) if pipeline else [0]
        by_rank = {}
        for rank in ranks:
            engine = simulate(workload, gpu, layers, weights, rank)
            by_rank[rank] = (_regions(engine, layers, layers), engine.host_peak)
            del engine
        highest = max(ranks, key=lambda r: peak_of(by_rank[r][0])[0].total)
        regions, saved = by_rank[highest]
        if pipeline:
            notes.append(f"simulated pipeline ranks {' and '.join(map(str, ranks))} (the first and the last bound "
                         f"the rest); rank {highest} has the highest peak")
    top, components, _ = peak_of(regions)
    at_peak = per_rank(top.at_max, divisor)
    component_peaks = per_rank(components, divisor)
    num_parameters = count_parameters(workload)
    held, step = offload_host_bytes(workload)   # the engine's host bytes (saved activations, streamed
    # weights) are held outside the optimizer step
    if workload.engine == "deepspeed":
        at_peak, component_peaks, held = deepspeed_states(workload, num_parameters, at_peak, component_peaks)
        step = 0   # DeepSpeed's CPU Adam steps in place
        notes.append(f"engine deepspeed (ZeRO-{workload.zero_stage}): half weights, float32 master weights, Adam "
                     f"moments and gradient partition, a reduction bucket of {workload.reduce_bucket:,} elements"
                     + (" (stage 3: the gathered weights of the running module are not included)"
                        if workload.zero_stage == 3 else ""))
    estimate = MemoryEstimate(
        model=source.name, num_parameters=num_parameters, workload=workload.to_json(),
        method="analytic", device=gpu.name if gpu else "cpu", peak_bytes=sum(at_peak.values()),
        peak_phase=top.phase, at_peak=at_peak, component_peaks=component_peaks,
        model_state_bytes={k: component_peaks[k] for k in MODEL_STATE_CATEGORIES},
        host_bytes=held + max(saved, step), sources={name: "analytic" for name in CATEGORIES}, notes=notes,
    )
    if gpu:
        add_gpu_overheads(estimate, gpu, workload)
    estimate.elapsed_s = time.perf_counter() - started
    return estimate


def count_parameters(workload: Workload) -> int:
    return sum(parameter_sizes(resolve(workload)))


def parameter_sizes(workload: ResolvedWorkload) -> list[int]:
    family, spec = registry.family_of(workload.source)
    e = Engine(Policy("float32", None, "cpu", False))
    family.declare_params(e, spec, workload.source.num_layers)
    return [p.numel for p in e.params.values()]


def deepspeed_states(workload: ResolvedWorkload, psi: int, at_peak: dict[str, int], component_peaks: dict[str, int]
                     ) -> tuple[dict[str, int], dict[str, int], int]:
    """DeepSpeed's model states on one rank (read from DeepSpeed 0.19's ZeRO optimizers and measured on 2 gloo
    ranks): its half weights (stage 3: this rank's partition), float32 master weights and Adam moments of
    the partition (12 bytes per parameter / N), a float32 gradient partition (4 / N), at stage 3 also a half
    one (2 / N). The simulated step (half weights, each gradient copied into the bucket and freed) gives
    the rest. With -t cpu-offload (ZeRO-Offload) masters, moments and float32 gradients live in host RAM,
    at stage 3 the weights' partitions and the half gradient partition too; the device still holds a
    float32 partition-sized buffer (measured, not traced to its owner) and at stages 1-2 a half copy of
    the partition for the weights' way back and two largest-parameter gradient staging buffers.
    Returns the device's peak and component vectors and the host bytes."""
    n, stage = workload.world_size, workload.zero_stage

    def part(nbytes: int) -> int:
        return -(-nbytes * psi // n)

    states = {"parameters": part(2) if stage == 3 else 2 * psi, "optimizer_states": part(12),
              "gradients": part(4) + (part(2) if stage == 3 else 0)}
    host = 0
    if workload.technique("cpu-offload"):
        for name in ("optimizer_states", "gradients") + (("parameters",) if stage == 3 else ()):
            host, states[name] = host + states[name], 0
        states["gradients"] = part(4)
        if stage < 3:
            states["parameters"] += part(2)
            states["gradients"] += 2 * 2 * max(parameter_sizes(workload))
    at, comp = dict(at_peak), dict(component_peaks)
    at["parameters"], comp["parameters"] = states["parameters"], states["parameters"]
    at["optimizer_states"] = comp["optimizer_states"] = states["optimizer_states"]
    at["gradients"] += states["gradients"]           # the simulated ones: the bucket and gradients in flight
    comp["gradients"] += states["gradients"]
    return at, comp, host
