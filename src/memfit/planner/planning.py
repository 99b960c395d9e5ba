"""`plan`: search, cost, rank, and say why when nothing fits."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import replace

from torch import nn

from memfit.core.errors import MemfitError
from memfit.core.units import GiB, format_bytes
from memfit.estimators import count_parameters
from memfit.estimators.breakdown import MemoryEstimate
from memfit.estimators.effects import describe, measured_accuracy
from memfit.estimators.traced import reusing_traces, traced_estimate
from memfit.planner.cost import GPUS_PER_NODE, step_time
from memfit.planner.live import live_request
from memfit.planner.parallel import derive_programs_ahead, forked, profiles_counted_alongside, sizing
from memfit.planner.request import PlanRequest
from memfit.planner.result import PlanResult
from memfit.planner.search import Evaluated, Search, change_of, lower_bound_estimate, risk_of
from memfit.specs.instances import usual_host_ram
from memfit.specs.model_source import catalog
from memfit.techniques.base import CHANGES
from memfit.techniques.resolve import ResolvedWorkload, all_techniques, without_technique


def plan(request: PlanRequest | nn.Module, batch=None, *, progress: Callable[[str], None] | None = None,
         explore_all: bool = False, verify_traced: bool = False, brief: bool = False, gpu=None,
         **fields) -> PlanResult:
    """The best plans for `request`, best first. `explore_all`: size every candidate (the Pareto plot needs
    them all; the `fastest` objective otherwise stops early). `brief`: the plans and the reason when none fits,
    without each technique's saving or the searches behind the suggestions (planning many machines).

    Given a live transformers model and its batch instead (`plan(model, batch, gpu="rtx-4090", ...)`, the other
    keywords PlanRequest's), the plan is made from the model's config (planner/live.py)."""
    if isinstance(request, nn.Module):
        request = live_request(request, batch, gpu=gpu, **fields)
    elif not isinstance(request, PlanRequest):
        raise MemfitError(f"expected a memfit PlanRequest or a torch.nn.Module and its batch, got "
                          f"{type(request).__name__}.")
    elif batch is not None or gpu is not None or fields:
        raise MemfitError("a PlanRequest carries its GPU, batch and settings; pass them to the PlanRequest, or pass a "
                          "live model and its batch.")
    with reusing_traces():
        return _plan(request, progress=progress, explore_all=explore_all, verify_traced=verify_traced, brief=brief)


def _plan(request: PlanRequest, *, progress: Callable[[str], None] | None, explore_all: bool, verify_traced: bool,
          brief: bool) -> PlanResult:
    started = time.perf_counter()
    search = Search(request, progress)
    with profiles_counted_alongside(search):
        accepted = search.workloads()
    num_parameters = count_parameters(accepted[0][1]) if accepted else 0
    ordered = []
    for candidate, workload, per_replica in accepted:
        ppl = ppl_increase(workload)
        if request.max_ppl_increase is not None and (ppl is None or ppl > request.max_ppl_increase):
            search.rejected["over the accuracy budget (or no perplexity cost measured)"] += 1
            continue
        bound = step_time(replace(workload, batch_size=per_replica), lower_bound_estimate(num_parameters),
                          request.gpu, grad_accum=1, num_gpus=candidate.num_gpus, cost=request.cost).total_s
        ordered.append((bound, candidate, workload, per_replica, ppl))
    ordered.sort(key=lambda item: item[0])
    feasible: list[Evaluated] = []
    with sizing(search, [item[1:4] for item in ordered]) as sized:
        for index, (bound, candidate, workload, _, ppl) in enumerate(ordered):
            if (request.objective == "fastest" and not explore_all and len(feasible) >= request.top
                    and bound > max(sorted(p.timed.total_s for p in feasible)[request.top - 1],
                                    min(p.timed.total_s for p in feasible) * (1 + request.speed_margin))):
                break
            search.progress(f"sizing {index + 1}/{len(ordered)}: {' + '.join(candidate.labels())}")
            evaluated = sized(index)
            if evaluated is None:
                continue
            search.evaluated.append(_timed(evaluated, request, workload, ppl))
            if evaluated.fits:
                feasible.append(evaluated)
    best_first = rank(feasible, request.objective, request.speed_margin)
    ranked = best_first[:request.top]
    if verify_traced:
        _verify(ranked, request, search)
    result = PlanResult(request, ranked, evaluated=search.evaluated, rejected=dict(search.rejected),
                        num_estimates=search.num_estimates)
    if ranked:
        result.warnings = unchecked_machine_warnings(request, ranked[0])
        result.tradeoff = tradeoff(best_first, request)
        if not brief:
            result.savings = [technique_savings(ranked[0], search)]   # the best plan's
    else:
        result.reason, result.suggestions = why_nothing_fits(request, search, suggest=not brief)
    result.elapsed_s = time.perf_counter() - started
    return result


def _timed(result: Evaluated, request: PlanRequest, workload: ResolvedWorkload, ppl: float | None) -> Evaluated:
    """A sized candidate with its risk, change to training, step time and throughput."""
    result.risk, result.change, result.ppl_increase = risk_of(workload), change_of(workload), ppl
    if ppl:
        result.ppl_source = ppl_source(workload, result.estimate.num_parameters)
    timed = step_time(result.workload(request), result.estimate, request.gpu, grad_accum=result.grad_accum,
                      num_gpus=result.candidate.num_gpus, cost=request.cost)
    result.time = timed
    done = request.sequences * workload.throughput_per_sample[0]   # tokens (or samples) per optimizer step
    result.throughput = done / timed.total_s / result.candidate.num_gpus
    return result


def technique_savings(chosen: Evaluated, search: Search) -> list[dict]:
    """What each technique of the plan saves: the peak without it, minus the plan's (same batch and estimator; on
    every core, parallel.py), and what it costs in step time (the plan's step over the step without it)."""
    workload = chosen.workload(search.request)
    techniques = [t for t in all_techniques(workload) if "layout" not in t.traits]   # how the GPUs are used

    def without(index: int) -> MemoryEstimate | None:
        try:
            return search.estimate(without_technique(workload, techniques[index]))
        except MemfitError:   # the plan needs it (e.g. its rules): no saving to compare
            return None

    request = search.request

    def factor(technique, other: MemoryEstimate) -> float:   # the plan's step over the step without the technique
        timed = step_time(without_technique(workload, technique), other, request.gpu, grad_accum=chosen.grad_accum,
                          num_gpus=chosen.candidate.num_gpus, cost=request.cost)
        return chosen.timed.total_s / timed.total_s

    ahead = []
    for technique in techniques:
        with contextlib.suppress(MemfitError):
            ahead.append(without_technique(workload, technique))
    derive_programs_ahead(search, ahead)
    rows = []
    with forked(without, len(techniques)) as estimate:
        for index, technique in enumerate(techniques):
            if (other := estimate(index)) is not None:
                rows.append(describe(technique, without=other, with_it=chosen.estimate,
                                     time_factor=factor(technique, other)) | {"method": other.method})
    return rows


def unchecked_machine_warnings(request: PlanRequest, best: Evaluated) -> list[str]:
    """Host RAM unchecked (a bare --gpu) and the best plan needs more than the usual hosts of that GPU hold; a local
    NVMe drive unchecked (no --instance) and the best plan swaps to one."""
    warnings = [f"plan 1 swaps {format_bytes(best.nvme_bytes)} per node to a local NVMe drive (not checked without "
                "--instance; the step reads and writes it all)"] if best.nvme_bytes and request.instance is None else []
    if request.host_ram_bytes is not None or not best.host_ram_bytes:
        return warnings
    per_node = min(request.num_gpus, GPUS_PER_NODE)
    usual = usual_host_ram(request.gpu, per_node)
    if usual is None or best.host_ram_bytes <= usual[1]:
        return warnings
    held = format_bytes(usual[1]) if usual[0] == usual[1] else f"{format_bytes(usual[0])} to {format_bytes(usual[1])}"
    return warnings + [f"plan 1 needs {format_bytes(best.host_ram_bytes)} of host RAM per node; the machines in "
                       f"`memfit instances` with {per_node} x {request.gpu.name} have {held}: pass --host-ram (or "
                       "--instance) to plan for the machine you have"]


def why_nothing_fits(request: PlanRequest, search: Search, suggest: bool = True) -> tuple[str, list[str]]:
    """Which resource is short and by how much, and what would make it fit (`suggest`: the ways out too)."""
    if not search.evaluated:
        common = ", ".join(f"{reason} ({count}x)" for reason, count in search.rejected.most_common(3))
        return f"no combination of techniques applies to this request: {common}", []
    budget = request.budget_bytes
    smallest = min(search.evaluated, key=lambda e: e.device_bytes)
    host_short = [e for e in search.evaluated if e.short == "host RAM"]
    suggestions = []
    if host_short:
        assert request.host_ram_bytes is not None   # a plan is short of host RAM only against a given --host-ram
        least = min(host_short, key=lambda e: e.host_ram_bytes)
        reason = (f"{len(host_short)} plan(s) fit the GPU but need host RAM: the least, "
                  f"{' + '.join(least.techniques)}, needs {format_bytes(least.host_ram_bytes)} per node and "
                  f"--host-ram is {format_bytes(request.host_ram_bytes)} (short by "
                  f"{format_bytes(least.host_ram_bytes - request.host_ram_bytes)})")
        suggestions.append(f"--host-ram {math.ceil(least.host_ram_bytes / GiB)}GiB or more")   # rounded up: enough
    elif disk_short := [e for e in search.evaluated if e.short == "local NVMe"]:
        least = min(disk_short, key=lambda e: e.estimate.nvme_bytes)
        assert request.instance is not None   # a plan is short of local NVMe only on a given --instance
        drive = request.instance.local_nvme_bytes
        reason = (f"{len(disk_short)} plan(s) fit the GPU but swap states to a local NVMe drive: the least, "
                  f"{' + '.join(least.techniques)}, writes {format_bytes(least.estimate.nvme_bytes)} per GPU and "
                  f"{request.instance.name} has " + (f"{format_bytes(drive)} of local NVMe" if drive else
                                                     "no local NVMe (network storage only)"))
    else:
        reason = (f"nothing fits: the smallest plan, {' + '.join(smallest.techniques)} at micro-batch "
                  f"{smallest.micro_batch}, needs {format_bytes(smallest.device_bytes)} per GPU; one "
                  f"{request.gpu.name} allows {format_bytes(budget)} ({format_bytes(request.gpu.memory_bytes)} less "
                  f"the {request.margin:.0%} margin): short by {format_bytes(smallest.device_bytes - budget)}")
        suggestions += _more_gpus(request, smallest)
    suggestions += _without_accumulation(request, search)
    if request.allow == "lossless" and suggest:
        suggestions += _lossy_alternative(request)
    return reason, suggestions


def _without_accumulation(request: PlanRequest, search: Search) -> list[str]:
    """The smallest plan that steps in backward, when the batch is more than one micro-batch: it cannot accumulate,
    so it had to hold the whole batch at once."""
    in_backward = [e for e in search.evaluated if e.micro_batch > 1 and e.workload(request).with_trait(
        "steps-in-backward")]
    if not in_backward:
        return []
    least = min(in_backward, key=lambda e: e.device_bytes)
    return [f"{' + '.join(least.techniques)} steps the optimizer in backward, which cannot accumulate gradients: it "
            f"runs all {least.micro_batch} sequences at once and needs {format_bytes(least.device_bytes)} per GPU "
            f"({format_bytes(request.budget_bytes)} allowed); a smaller --global-batch brings it down"]


def _more_gpus(request: PlanRequest, smallest: Evaluated) -> list[str]:
    """A rough count of GPUs: the smallest plan's model states sharded over more of them (fsdp2), the rest
    of its peak (activations, temporaries) unchanged."""
    states = sum(smallest.estimate.at_peak[c] for c in ("parameters", "gradients", "optimizer_states"))
    states *= smallest.candidate.num_gpus if smallest.candidate.num_gpus > 1 else 1
    rest = smallest.device_bytes - states / max(1, smallest.candidate.num_gpus)
    room = request.budget_bytes - rest
    if states <= 0 or room <= 0:
        return []
    needed = max(request.num_gpus + 1, -(-int(states) // int(room)))
    return [f"about {needed} x {request.gpu.name} with -t fsdp2 (rough: the smallest plan's model states "
            f"sharded {needed} ways; run `memfit plan ... --gpus {needed}` to check)"]


def _lossy_alternative(request: PlanRequest) -> list[str]:
    lossy = replace(request, allow="lossy", top=1, max_ppl_increase=None)
    search = Search(lossy)
    best = None
    items = [item for item in search.workloads() if risk_of(item[1]) == "lossy"]
    with sizing(search, items) as size:
        for index in range(len(items)):
            sized = size(index)
            if sized is not None and (best is None or (sized.fits, -sized.device_bytes) > (best.fits,
                                                                                          -best.device_bytes)):
                best = sized   # the smallest that fits, else the smallest
    if best is None:
        return []
    if best.fits:
        fits = "fits"
    elif best.short == "host RAM":
        assert request.host_ram_bytes is not None   # a plan is short of host RAM only against a given --host-ram
        fits = (f"fits the GPU but needs {format_bytes(best.host_ram_bytes)} of host RAM "
                f"({format_bytes(request.host_ram_bytes)} given)")
    elif best.short == "device memory":
        fits = f"is still short by {format_bytes(best.device_bytes - request.budget_bytes)}"
    else:
        fits = f"fits the GPU but not the machine's {best.short}"
    ppl = ppl_increase(best.workload(request))
    cost = f", measured perplexity cost +{ppl:.1%} on memfit's test model" if ppl else ""
    which = "the smallest plan that fits" if best.fits else "the smallest plan"
    return [f"with --allow lossy {which}, {' + '.join(best.techniques)}, needs "
            f"{format_bytes(best.device_bytes)} per GPU and {fits}{cost}"]


def rank(plans: list[Evaluated], objective: str, speed_margin: float = 0.0) -> list[Evaluated]:
    """Best first. `fastest`: among the plans within `speed_margin` of the fastest, those that change training least
    come first (a practitioner does not store weights in bf16 for 2 % more speed), the fewest techniques first among
    them; then the rest by time."""
    if objective == "smallest":
        return sorted(plans, key=lambda p: (p.device_bytes, p.timed.total_s))
    if objective == "balanced":   # time x memory, each relative to the best of its kind
        fastest = min((p.timed.total_s for p in plans), default=1.0)
        smallest = min((p.device_bytes for p in plans), default=1)
        return sorted(plans, key=lambda p: (p.timed.total_s / fastest) * (p.device_bytes / smallest))
    near = min((p.timed.total_s for p in plans), default=0.0) * (1 + speed_margin)
    changes = list(CHANGES)

    def key(p: Evaluated) -> tuple:
        if p.timed.total_s > near:
            return 1, 0, 0, p.timed.total_s, p.device_bytes
        return 0, changes.index(p.change), len(p.techniques), p.timed.total_s, p.device_bytes

    return sorted(plans, key=key)


def tradeoff(ordered: list[Evaluated], request: PlanRequest) -> str | None:
    """What the fastest plan would gain over plan 1, when plan 1 was preferred for changing training less."""
    if request.objective != "fastest" or not ordered:
        return None
    best, fastest = ordered[0], min(ordered, key=lambda p: p.timed.total_s)
    if fastest.change == best.change:
        return None
    gain = best.timed.total_s / fastest.timed.total_s - 1
    position = ordered.index(fastest)
    which = f"plan {position + 1}" if position < request.top else "the fastest plan"
    return (f"plan 1 changes training least among the plans within {request.speed_margin:.0%} of the fastest (it "
            f"{CHANGES[best.change]}); {which}, {' + '.join(fastest.techniques)}, would be {gain:.1%} faster and "
            f"{CHANGES[fastest.change]}")


def ppl_increase(workload: ResolvedWorkload) -> float | None:
    """The measured held-out perplexity increase of the workload's lossy techniques (summed), 0 when it has
    none, None when one of them has no measured figure (estimators/effects.py's accuracy data)."""
    figures = ppl_figures(workload)
    return None if figures is None else sum((change for change, _ in figures), 0.0)


def ppl_figures(workload: ResolvedWorkload) -> list[tuple[float, str]] | None:
    """Each lossy technique's measured perplexity change (the largest measured) and what it was measured on; None
    when one has none."""
    wanted = "held-out perplexity change" + (" after a 60-step fine-tune" if workload.task == "train" else "")
    out = []
    for technique in all_techniques(workload):
        if technique.risk != "lossy":
            continue
        figures = [(r["change"], r["source"]) for r in measured_accuracy(technique) or () if r.get("metric") == wanted]
        if not figures:
            return None
        out.append(max(figures))
    return out


def ppl_source(workload: ResolvedWorkload, num_parameters: int) -> str | None:
    """What the workload's perplexity cost was measured on, and how much larger the planned model is: the figures
    are a small model's on a small corpus, not a measurement of this one."""
    figures = ppl_figures(workload)
    if not figures:
        return None
    sources = sorted({source for _, source in figures})
    subject = sources[0].split()[0]
    ratio = ""
    if subject in catalog() and num_parameters:
        measured_on = count_parameters(ResolvedWorkload(model=subject))
        ratio = f"; {workload.model} has {num_parameters / measured_on:,.0f}x its parameters: extrapolated"
    return f"perplexity change measured on {'; '.join(sources)} (benchmarks/accuracy_costs.py){ratio}"


def _verify(plans: list[Evaluated], request: PlanRequest, search: Search) -> None:
    """Re-estimate the chosen plans with the traced estimator (the real step on fake tensors)."""
    for index, chosen in enumerate(plans):
        search.progress(f"tracing plan {index + 1}/{len(plans)}")
        traced = traced_estimate(chosen.workload(request), None if request.on_cpu else request.gpu)
        chosen.estimate.extra["traced_peak_bytes"] = traced.peak_bytes + traced.overhead_bytes
