"""Host RAM and DeepSpeed's states: what the analytic estimator adds to the simulated step.

  offload_host_bytes   an optimizer that steps in host RAM (an offload technique's `host-optimizer` trait):
                       its master weights, gradients and states, and the host step's temporaries.
  deepspeed_states     DeepSpeed's ZeRO optimizers keep their states in their own flat buffers, which the
                       simulated step (half weights, gradients into the bucket) does not hold.
"""
from __future__ import annotations

from memfit.core.precision import get_precision
from memfit.estimators.analytic.engine import Engine, Policy
from memfit.estimators.analytic.families import registry
from memfit.estimators.analytic.optimizer import create_states, step_temporaries
from memfit.estimators.analytic.simulate import engine_dtype, one_process_host_optimizer
from memfit.techniques.resolve import ResolvedWorkload


def offload_host_bytes(workload: ResolvedWorkload) -> tuple[int, int]:
    """Host RAM of an optimizer offloaded to the host (techniques/offload.py), from the closed forms of the
    device's states: (held all step: float32 master weights, their gradients and the optimizer's states — with
    a sharding wrapper that keeps its shards on the host, the shards in the model's dtype, / N; held in the step
    only: the CPU step's temporaries and the cast back to a half-precision model)."""
    if not workload.with_trait("host-optimizer") or workload.task != "train":
        return 0, 0
    family, spec = registry.family_of(workload.source)
    model_dtype = engine_dtype(get_precision(workload.precision).param_dtype)
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
    the rest. With an offload technique (ZeRO-Offload) masters, moments and float32 gradients live in host RAM,
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
    if workload.with_trait("host-optimizer"):
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
