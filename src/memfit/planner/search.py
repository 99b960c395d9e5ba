"""The search: the fastest (or smallest) configuration whose predicted per-GPU peak fits.

For each candidate (space.py) the analytic estimator (milliseconds; for a custom module or the user's own step,
which it cannot run, the traced estimator, and no workload is estimated twice) sizes the step at the smallest
micro-batch; a candidate that fits there is sized at the next micro-batch too, the peak taken as linear in the
micro-batch between them (activations grow with it, model states do not), the largest micro-batch predicted to fit
is estimated exactly, and stepped down until it does. A traced search reads those larger micro-batches off its
traces at the first two (traced.reusing_traces: exact when every allocation keeps its size or grows with the
micro-batch, which it checks), and starts above one sequence, which takes paths of its own; it sizes one sequence
only when two do not fit. Candidates are sized on every core (parallel.py). Gradient accumulation
makes up the rest of the user's global batch. Fit means tensors + CUDA context + cuBLAS workspace +
the allocator's simulated reserve (gpu_overhead.py) <= device memory x (1 - margin); an allocator technique
(expandable segments) changes the reserve, so a plan that only fits that way gets it (space.allocator_options).

With the `fastest` objective candidates are tried in order of a FLOPs-only lower bound on their step
time, and the search stops once that bound is slower than the plans already found. A transformer config's
plans are traced only when asked (`verify_traced`).
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from memfit.core.categories import zero_categories
from memfit.core.errors import ImpossibleCombination, MemfitError, NotModelled
from memfit.estimators import methods_for
from memfit.estimators.analytic import analytic_estimate
from memfit.estimators.analytic.families.registry import has_family
from memfit.estimators.analytic.simulate import one_process_host_optimizer
from memfit.estimators.breakdown import MemoryEstimate
from memfit.estimators.traced import traced_estimate
from memfit.planner.cost import GPUS_PER_NODE, StepTime
from memfit.planner.request import PlanRequest
from memfit.planner.space import Candidate, allocator_options, candidates
from memfit.specs.workload import Workload
from memfit.techniques.base import CHANGES, RISKS, parse_technique
from memfit.techniques.resolve import ResolvedWorkload, all_techniques, resolve

MAX_VERIFY = 4          # exact estimates while stepping the micro-batch down


@dataclass
class Evaluated:
    candidate: Candidate
    micro_batch: int
    grad_accum: int
    estimate: MemoryEstimate
    device_bytes: int           # tensors + overheads per GPU
    host_ram_bytes: int         # per node
    added: tuple[str, ...]      # allocator techniques the plan needs to fit (space.allocator_options)
    fits: bool
    short: str | None = None    # "device memory" | "host RAM" | "local NVMe"
    time: StepTime | None = None
    throughput: float = 0.0     # tokens (or samples: throughput_per_sample) per second per GPU
    risk: str = "lossless"
    change: str = "exact"       # what the plan changes in training (techniques.base.CHANGES)
    ppl_increase: float | None = None
    ppl_source: str | None = None   # what the perplexity change was measured on (planning.ppl_source)

    @property
    def techniques(self) -> list[str]:
        return self.candidate.labels() + list(self.added)

    @property
    def timed(self) -> StepTime:
        """`time`, set on every plan the planner keeps (planning._timed): those it ranks and reports."""
        assert self.time is not None
        return self.time

    @property
    def nvme_bytes(self) -> int:
        """Swapped to the node's local NVMe drive (NVMe offload), per node."""
        return self.estimate.nvme_bytes * min(self.candidate.num_gpus, GPUS_PER_NODE)

    def workload(self, request: PlanRequest) -> ResolvedWorkload:
        return replace(self.candidate, techniques=self.candidate.techniques + self.added).workload(
            request, self.micro_batch)


def estimate_for(request: PlanRequest, workload: ResolvedWorkload) -> MemoryEstimate:
    """The estimate for the request's target (the GPU's kernels and overheads, or this CPU's): analytic for a
    transformer config, traced for a custom model or the user's own step (what the analytic model cannot run)."""
    gpu = None if request.on_cpu else request.gpu
    methods = methods_for(workload)
    if request.method is not None and request.method not in methods:
        raise NotModelled(f"--method {request.method} does not model {' + '.join(workload.techniques) or 'this'} "
                          f"on {workload.model}; it takes {' or '.join(methods) or 'no estimator'}.")
    if request.method == "traced" or "analytic" not in methods:
        return traced_estimate(workload, gpu)
    try:
        return analytic_estimate(workload, gpu)
    except NotModelled:   # a program derived from the trace that missed its check (derived_program.py)
        if request.method == "analytic" or has_family(workload.source):
            raise
        return traced_estimate(workload, gpu)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def device_bytes(estimate: MemoryEstimate) -> int:
    """Tensors and overheads per GPU."""
    return estimate.peak_bytes + estimate.overhead_bytes


class Search:
    def __init__(self, request: PlanRequest, progress: Callable[[str], None] | None = None) -> None:
        self.request = request
        self.progress = progress or (lambda message: None)
        self.rejected: Counter[str] = Counter()
        self.evaluated: list[Evaluated] = []
        self.num_estimates = 0
        self.base = resolve(Workload(model=request.model, inputs=request.inputs, step=request.step, task=request.task,
                                     seq_len=request.seq_len, new_tokens=request.new_tokens))
        # a custom model or the user's own step, or --method traced
        self.traces = request.method == "traced" or "analytic" not in methods_for(self.base)
        self.estimated: dict[str, MemoryEstimate] = {}   # by workload: a trace is not made twice
        self.allocator_options = allocator_options(request, self.base)

    # ---- one candidate -----------------------------------------------------------------------
    def estimate(self, workload: ResolvedWorkload) -> MemoryEstimate:
        key = json.dumps(workload.to_json(), sort_keys=True)
        if key not in self.estimated:
            self.num_estimates += 1
            self.estimated[key] = estimate_for(self.request, workload)
        return self.estimated[key]

    def _sized(self, candidate: Candidate, micro_batch: int, estimate: MemoryEstimate,
               per_replica: int) -> Evaluated:
        request = self.request
        budget = request.budget_bytes
        device = device_bytes(estimate)
        added: tuple[str, ...] = ()
        reserve = estimate.overhead_detail.get("allocator_reserve", 0)
        only_the_reserve_is_over = device - reserve <= budget < device
        for option in self.allocator_options if only_the_reserve_is_over else ():
            with_option = replace(candidate, techniques=candidate.techniques + (option.spec,))
            option_estimate = self.estimate(with_option.workload(request, micro_batch))
            if device_bytes(option_estimate) <= budget:
                estimate, device, added = option_estimate, device_bytes(option_estimate), (option.spec,)
                break
        processes_per_node = min(candidate.num_gpus, GPUS_PER_NODE)
        host = estimate.host_bytes * processes_per_node
        evaluated = Evaluated(candidate, micro_batch, per_replica // micro_batch, estimate, device, host, added,
                              fits=True)
        if device > budget:
            evaluated.short = "device memory"
        elif request.host_ram_bytes is not None and host > request.host_ram_bytes:
            evaluated.short = "host RAM"
        elif request.instance and evaluated.nvme_bytes > (request.instance.local_nvme_bytes or 0):
            evaluated.short = "local NVMe"   # swapped to a drive the instance does not have (or not that large)
        evaluated.fits = evaluated.short is None
        return evaluated

    def evaluate(self, candidate: Candidate, workload: ResolvedWorkload, per_replica: int) -> Evaluated | None:
        """The largest micro-batch of `candidate` that fits (or its smallest, sized, when none does); None when its
        estimate finds the combination impossible or has no model of it (counted as refused)."""
        try:
            return self._evaluate(candidate, workload, per_replica)
        except (ImpossibleCombination, NotModelled) as exc:
            self.rejected[str(exc)] += 1
            return None

    def _evaluate(self, candidate: Candidate, workload: ResolvedWorkload, per_replica: int) -> Evaluated:
        if workload.with_trait("steps-in-backward"):   # it cannot accumulate: one micro-batch is the whole batch
            whole = workload if per_replica == candidate.batch_multiple else candidate.workload(self.request,
                                                                                                  per_replica)
            return self._sized(candidate, per_replica, self.estimate(whole), per_replica)
        sizes = [m for m in divisors(per_replica) if m % candidate.batch_multiple == 0]
        if len(sizes) == 1 or self.request.objective == "smallest":
            return self._sized(candidate, sizes[0], self.estimate(workload), per_replica)
        # a traced search starts above one sequence, which takes paths of its own (views where more sequences are
        # copied): larger micro-batches are read off the traces at two sizes (traced.reusing_traces) that have none
        low = 1 if sizes[0] == 1 and self.traces else 0
        first = self._size_at(candidate, sizes[low], per_replica)
        if not first.fits:
            return self._sized(candidate, sizes[0], self.estimate(workload), per_replica) if low else first
        if low + 1 == len(sizes):
            return first
        second = self._size_at(candidate, sizes[low + 1], per_replica)
        if not second.fits:
            return first
        slope = (second.device_bytes - first.device_bytes) / (second.micro_batch - first.micro_batch)
        room = self.request.budget_bytes - first.device_bytes
        predicted = [m for m in sizes if slope <= 0 or (m - first.micro_batch) * slope <= room]
        best = second
        for size in reversed(predicted[-MAX_VERIFY:]):
            if size <= second.micro_batch:
                break
            trial = self._size_at(candidate, size, per_replica)
            if trial.fits:
                best = trial
                break
        return best

    def _size_at(self, candidate: Candidate, micro_batch: int, per_replica: int) -> Evaluated:
        return self._sized(candidate, micro_batch, self.estimate(candidate.workload(self.request, micro_batch)),
                           per_replica)

    # ---- all of them -------------------------------------------------------------------------
    def workloads(self) -> list[tuple[Candidate, ResolvedWorkload, int]]:
        """Candidates the rules accept, with their smallest workload and the sequences per model replica."""
        request = self.request
        out = []
        for candidate in candidates(request, self.base):
            sequences = request.sequences
            if sequences % candidate.data_parallel:
                self.rejected[f"batch {sequences} does not split over {candidate.data_parallel} GPUs"] += 1
                continue
            per_replica = sequences // candidate.data_parallel
            if per_replica % candidate.batch_multiple:
                self.rejected[f"batch {per_replica} does not split into {candidate.batch_multiple} pipeline "
                              "micro-batches"] += 1
                continue
            try:
                workload = candidate.workload(request, candidate.batch_multiple)
            except MemfitError as exc:
                self.rejected[str(exc)] += 1
                continue
            given = {parse_technique(spec).name for spec in candidate.techniques}
            implied = tuple(t.name for t in workload.technique_configs if t.name not in given)
            out.append((replace(candidate, implied=implied), workload, per_replica))
        return out


def risk_of(workload: ResolvedWorkload) -> str:
    risks = [t.risk for t in all_techniques(workload)]
    return max(risks, key=RISKS.index) if risks else "lossless"


def change_of(workload: ResolvedWorkload) -> str:
    """The most a workload changes training (techniques.base.CHANGES, least first): its precision, optimizer and
    techniques (DeepSpeed's half precision included), and data parallel, which sums gradients across ranks. Half
    weights whose optimizer steps on float32 masters in host RAM (cpu-offload in one process) train as mixed
    precision does."""
    order = list(CHANGES)
    host_masters = one_process_host_optimizer(workload)
    changes = ["mixed-precision" if host_masters and t.workload_field == "precision"
               and t.training_change() == "reduced-precision" else t.training_change()
               for t in workload.hooked_techniques]
    changes += ["reduction-order"] if workload.world_size > 1 else []
    return max(changes, key=order.index, default="exact")


def lower_bound_estimate(num_parameters: int) -> MemoryEstimate:
    """An estimate with no bytes: `step_time` on it counts FLOPs only (a lower bound on the step time)."""
    return MemoryEstimate(model="", num_parameters=num_parameters, workload={}, method="bound", device="",
                          peak_bytes=0, peak_phase="", at_peak=zero_categories(), component_peaks=zero_categories(),
                          model_state_bytes={"parameters": 0, "gradients": 0, "optimizer_states": 0})
