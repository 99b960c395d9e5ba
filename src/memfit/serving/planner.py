"""`memfit plan MODEL --task serve`: the engine setups that serve a load — `concurrency` users at a context of
`max_model_len` tokens — on the GPUs given or on every priced machine, ranked by what a million output tokens cost
(or by speed).

The search, per machine (a GPU and how many): tensor parallel over the GPUs a replica takes (dividing the heads),
data-parallel replicas over the rest, the users split over the replicas; the checkpoint's own weights or, with
lossy allowed, an fp8 or an AWQ int4 checkpoint and an fp8 KV cache (each with its published accuracy cost). A setup
fits when the engine starts and its cache holds every replica's users at max_model_len (the engine's own "maximum
concurrency"). Every fitting setup is ranked on a steady-state estimate of its decode step (step_model.py: the users'
tokens and their prompts' share each step); the leaders are then simulated in full (speed.py: the users as the
benchmark client's closed loop) for the figures shown and the service levels checked. When nothing fits, the reason
names the smallest change that would: more GPUs, a quantized checkpoint, a shorter context, fewer users.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from memfit.core.errors import MemfitError
from memfit.serving.checkpoints import checkpoint_of
from memfit.serving.command import command_line
from memfit.serving.estimate import estimate_serving, served_dtype
from memfit.serving.load import Load
from memfit.serving.result import SPEED_KEYS, ServingEstimate
from memfit.serving.served_model import ServedModel
from memfit.serving.settings import ServeSettings
from memfit.serving.speed import policy_of
from memfit.serving.step_model import step_model
from memfit.specs.hardware import GPU
from memfit.specs.instances import Instance

TENSOR_PARALLEL = (1, 2, 4, 8)
DEFAULT_OUTPUT_LEN = 256
# lossy options, each with its published accuracy cost (Kurtic et al. 2024, "Give Me BF16 or Give Me Death?",
# arXiv 2411.02355: the Llama-3.1 family, over 500,000 evaluations)
LOSSY_WEIGHTS = {
    "fp8": "fp8 weights and activations, quantized as vLLM loads the checkpoint: effectively lossless (Kurtic et "
           "al. 2024)",
    "awq": "int4 weights (an AWQ checkpoint of the model, named here as the usual <model>-AWQ): competitive with "
           "int8 W8A8, whose loss is 1-3 % (Kurtic et al. 2024)",
}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128}
LOSSY_KV = "an fp8 KV cache: lossy, no published figure bundled"
OBJECTIVES = ("cheapest", "fastest")
SIMULATED = 12          # setups simulated in full at most (the leaders of the steady-state ranking)
# what a setup that does not hold the users tries next, in order (each costs speed)
ENGINE_KNOBS: dict[str, tuple[dict, ...]] = {
    "vllm": ({}, {"gpu_memory_utilization": 0.95}, {"gpu_memory_utilization": 0.95, "enforce_eager": True}),
    "sglang": ({}, {"enforce_eager": True})}


@dataclass(frozen=True)
class Machine:
    gpu: GPU
    gpus: int
    instance: Instance | None = None

    @property
    def usd_per_hour(self) -> float | None:
        return self.instance.usd_per_hour if self.instance else None

    @property
    def name(self) -> str:
        return self.instance.name if self.instance else f"{self.gpus} x {self.gpu.name}"


@dataclass(frozen=True)
class ServeRequest:
    engine: str
    engine_version: str | None
    max_model_len: int
    concurrency: int
    machines: tuple[Machine, ...]
    input_len: int | None = None       # default: the context less the answer
    output_len: int | None = None      # default: DEFAULT_OUTPUT_LEN
    allow_lossy: bool = False
    objective: str = "cheapest"
    max_ttft_ms: float | None = None
    max_tpot_ms: float | None = None
    min_output_tokens_per_s: float | None = None
    top: int = 5

    def __post_init__(self) -> None:
        for name in ("max_model_len", "concurrency", "top"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemfitError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        if self.objective not in OBJECTIVES:
            raise MemfitError(f"unknown --objective {self.objective!r}; choose {' or '.join(OBJECTIVES)}.")
        for name in ("max_ttft_ms", "max_tpot_ms", "min_output_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise MemfitError(f"--{name.replace('_', '-')} must be > 0, got {value!r}.")
        if self.lengths[0] < 1 or sum(self.lengths) > self.max_model_len:
            raise MemfitError(f"--input-len + --output-len ({sum(self.lengths)}) must fit in --max-model-len "
                              f"({self.max_model_len}), with at least one prompt token.")

    @property
    def lengths(self) -> tuple[int, int]:
        output = self.output_len or min(DEFAULT_OUTPUT_LEN, self.max_model_len // 2)
        return (self.input_len or self.max_model_len - output), output


@dataclass
class ServePlan:
    machine: Machine
    tensor_parallel: int
    replicas: int
    quantization: str | None
    kv_cache_dtype: str
    settings: ServeSettings
    estimate: ServingEstimate
    steady_tokens_per_s: float              # the ranking's steady-state estimate (all replicas)
    accuracy_cost: list[str] = field(default_factory=list)

    def output_tokens_per_s(self) -> float:
        speed = self.estimate.speed
        return speed.output_tokens_per_s * self.replicas if speed else self.steady_tokens_per_s

    def usd_per_million(self) -> float | None:
        price = self.machine.usd_per_hour
        return price / (self.output_tokens_per_s() * 3600) * 1e6 if price else None

    def to_json(self) -> dict:
        e = self.estimate
        out: dict[str, Any] = {
            "engine_args": command_line(e), "machine": self.machine.name, "gpu": self.machine.gpu.name,
            "gpus": self.tensor_parallel * self.replicas, "tensor_parallel": self.tensor_parallel,
            "data_parallel": self.replicas, "quantization": self.quantization, "kv_cache_dtype": self.kv_cache_dtype,
            "max_concurrency": round(e.max_concurrency * self.replicas, 2), "kv_cache_tokens": e.kv_cache_tokens,
            "accuracy_cost": self.accuracy_cost, "usd_per_hour": self.machine.usd_per_hour,
            "usd_per_million_output_tokens": self.usd_per_million()}
        if e.speed is not None:
            run = e.speed.to_json()
            out.update({key: run[key] for key in SPEED_KEYS})
            for key in ("request_throughput", "output_tokens_per_s", "total_tokens_per_s"):
                out[key] *= self.replicas   # the replicas serve their users side by side
        if self.machine.instance is not None:
            out["price"] = self.machine.instance.price_json()
        return out


@dataclass
class ServePlanResult:
    request: ServeRequest
    plans: list[ServePlan]
    reason: str | None = None
    tried: int = 0

    @property
    def feasible(self) -> bool:
        return bool(self.plans)

    def to_json(self) -> dict:
        r = self.request
        prompt, answer = r.lengths
        return {"schema": "memfit.serve-plan/1", "feasible": self.feasible, "reason": self.reason,
                "request": {"engine": r.engine, "engine_version": r.engine_version, "max_model_len": r.max_model_len,
                            "concurrency": r.concurrency, "input_len": prompt, "output_len": answer,
                            "allow_lossy": r.allow_lossy, "objective": r.objective,
                            "machines": [m.name for m in r.machines]},
                "plans": [p.to_json() for p in self.plans], "setups_tried": self.tried}


def plan_serving(model: ServedModel, request: ServeRequest) -> ServePlanResult:
    fitting: list[ServePlan] = []
    tried = 0
    for machine in _distinct(request.machines):
        for candidate in _setups(model, machine, request):
            tried += 1
            plan = _fits(model, machine, request, *candidate)
            if plan is not None:
                fitting.append(plan)
    if not fitting:
        return ServePlanResult(request, [], _way_out(model, request), tried)
    fitting.sort(key=lambda p: _rank(p, request))
    chosen: list[ServePlan] = []
    for plan in fitting[:SIMULATED]:
        _simulate(model, plan, request)
        if _meets(plan, request):
            chosen.append(plan)
    chosen.sort(key=lambda p: _rank(p, request))
    if not chosen:
        return ServePlanResult(request, [], _slo_reason(fitting[:SIMULATED], request), tried)
    return ServePlanResult(request, chosen[:request.top], None, tried)


def _distinct(machines: tuple[Machine, ...]) -> list[Machine]:
    """Machines alike in GPU and count plan once: the cheapest of them stays."""
    best: dict[tuple[str, int], Machine] = {}
    for m in machines:
        key = (m.gpu.name, m.gpus)
        if key not in best or (m.usd_per_hour or math.inf) < (best[key].usd_per_hour or math.inf):
            best[key] = m
    return list(best.values())


def _setups(model: ServedModel, machine: Machine, request: ServeRequest):
    quantizations: list[str | None] = [None]
    if request.allow_lossy and model.quantization is None:
        quantizations += list(LOSSY_WEIGHTS)
    kv_dtypes = ["auto", "fp8"] if request.allow_lossy else ["auto"]
    for tp in TENSOR_PARALLEL:
        if tp > machine.gpus or model.heads % tp:
            continue
        for quantization in quantizations:
            for kv in kv_dtypes:
                yield tp, quantization, kv


def _settings(request: ServeRequest, tp: int, kv: str = "auto", quantization: str | None = None,
              max_model_len: int | None = None, **knobs) -> ServeSettings:
    return ServeSettings(engine=request.engine, engine_version=request.engine_version, tensor_parallel=tp,
                         max_model_len=max_model_len or request.max_model_len, kv_cache_dtype=kv,
                         quantization="fp8" if quantization == "fp8" else None, **knobs)


def _fits(model: ServedModel, machine: Machine, request: ServeRequest, tp: int, quantization: str | None,
          kv: str) -> ServePlan | None:
    """The setup with the engine's defaults if it holds the users, else with the knobs that free memory (a higher
    utilization, then no CUDA graphs); max_num_seqs is the users a replica serves."""
    replicas = machine.gpus // tp
    users = math.ceil(request.concurrency / replicas)
    served = _quantized(model, quantization)
    for knobs in ENGINE_KNOBS[request.engine]:
        settings = _settings(request, tp, kv, quantization, max_num_seqs=users, **knobs)
        try:
            estimate = estimate_serving(served, machine.gpu, settings)
        except MemfitError:
            return None
        if estimate.starts and estimate.max_concurrency >= users:
            cost = ([LOSSY_WEIGHTS[quantization]] if quantization else []) + ([LOSSY_KV] if kv != "auto" else [])
            steady = _steady_tokens_per_s(served, machine.gpu, settings, estimate, request, users) * replicas
            return ServePlan(machine, tp, replicas, quantization, kv, settings, estimate, steady, cost)
    return None


def _quantized(model: ServedModel, quantization: str | None) -> ServedModel:
    """The model an AWQ plan serves: its AWQ checkpoint (fp8 quantizes the model's own checkpoint as it loads)."""
    if quantization != "awq":
        return model
    return dataclasses.replace(model, quantization=AWQ_CONFIG, hub_id=f"{model.hub_id}-AWQ")


def _steady_tokens_per_s(model: ServedModel, gpu: GPU, settings: ServeSettings, estimate: ServingEstimate,
                         request: ServeRequest, users: int) -> float:
    """One replica's output tokens/s in the steady state: every user decoding at the mean context, and each step
    prefilling its share of the prompts (users x prompt / answer tokens)."""
    dtype = served_dtype(model, settings, gpu)
    timing = step_model(model, checkpoint_of(model, settings.quantization, gpu.compute_capability), dtype, gpu,
                        estimate, policy_of(settings))
    prompt, answer = request.lengths
    step = timing.seconds([(max(1, round(users * prompt / answer)), 0)], [prompt + answer // 2] * users, users)
    return users / step


def _simulate(model: ServedModel, plan: ServePlan, request: ServeRequest) -> None:
    users = math.ceil(request.concurrency / plan.replicas)
    prompt, answer = request.lengths
    load = Load(prompt, answer, users * 3, max_concurrency=users)
    plan.estimate = estimate_serving(_quantized(model, plan.quantization), plan.machine.gpu, plan.settings, load)


def _meets(plan: ServePlan, request: ServeRequest) -> bool:
    speed = plan.estimate.speed
    assert speed is not None
    return ((request.max_ttft_ms is None or speed.mean_ttft_ms <= request.max_ttft_ms)
            and (request.max_tpot_ms is None or speed.mean_tpot_ms <= request.max_tpot_ms)
            and (request.min_output_tokens_per_s is None
                 or plan.output_tokens_per_s() >= request.min_output_tokens_per_s))


def _rank(plan: ServePlan, request: ServeRequest) -> tuple:
    """Cheapest per million output tokens (unpriced machines: fewest GPUs), or fastest; lossless before lossy
    among equals."""
    speed = plan.output_tokens_per_s()
    if request.objective == "fastest":
        return (-speed, len(plan.accuracy_cost))
    usd = plan.usd_per_million()
    gpus = plan.tensor_parallel * plan.replicas
    return (usd if usd is not None else math.inf, gpus, len(plan.accuracy_cost), -speed)


def _slo_reason(simulated: list[ServePlan], request: ServeRequest) -> str:
    best = min(simulated, key=lambda p: p.estimate.speed.mean_tpot_ms if p.estimate.speed else math.inf)
    speed = best.estimate.speed
    assert speed is not None
    return (f"setups fit in memory but none meets the service levels: the best reaches TTFT "
            f"{speed.mean_ttft_ms:,.0f} ms, TPOT {speed.mean_tpot_ms:,.1f} ms and {best.output_tokens_per_s():,.0f} "
            f"output tokens/s ({best.machine.name}, tensor parallel {best.tensor_parallel}); relax them, or give "
            "faster or more GPUs.")


def _way_out(model: ServedModel, request: ServeRequest) -> str:
    """Why nothing fits, and the smallest single change that would."""
    machine = max(request.machines, key=lambda m: (m.gpus * m.gpu.memory_bytes))
    fixes = []
    for gpus in (2 * machine.gpus, 4 * machine.gpus, 8):
        if gpus > machine.gpus and gpus <= 8:
            bigger = dataclasses.replace(request, machines=(Machine(machine.gpu, gpus),))
            if any(_fits(model, bigger.machines[0], bigger, *c) for c in _setups(model, bigger.machines[0], bigger)):
                fixes.append(f"{gpus} x {machine.gpu.name} (--gpus {gpus})")
                break
    if not request.allow_lossy:
        lossy = dataclasses.replace(request, allow_lossy=True)
        winners = [c for c in _setups(model, machine, lossy) if _fits(model, machine, lossy, *c)]
        if winners:
            tp, quantization, kv = min(winners, key=lambda c: (c[0], c[1] is not None, c[2] != "auto"))
            what = ", ".join(filter(None, (f"--quantization {quantization}" if quantization else None,
                                           "--kv-cache-dtype fp8" if kv != "auto" else None)))
            fixes.append(f"--allow lossy ({what} at tensor parallel {tp})")
    longest, most = _best_reach(model, machine, request)
    if longest:
        fixes.append(f"--max-model-len {longest} (the longest context {request.concurrency} users fit in)")
    if most:
        fixes.append(f"--concurrency {most} (as many users as fit at {request.max_model_len:,} tokens)")
    head = (f"no setup of {request.engine} on {machine.name} holds {request.concurrency} users at "
            f"{request.max_model_len:,} tokens")
    why = _why(model, machine, request)
    if not fixes:
        return f"{head}: {why}. No single change fits it: a GPU with more memory, or several changes together."
    return f"{head}: {why}. Each of these would: " + "; ".join(fixes) + "."


def _why(model: ServedModel, machine: Machine, request: ServeRequest) -> str:
    tp = max(t for t in TENSOR_PARALLEL if t <= machine.gpus and model.heads % t == 0)
    try:
        e = estimate_serving(model, machine.gpu, _settings(request, tp))
    except MemfitError as exc:
        return str(exc).rstrip(".")
    if not e.starts:
        return f"at tensor parallel {tp} the engine does not start ({e.refusal})".rstrip(".")
    return f"at tensor parallel {tp} its cache holds {e.max_concurrency:.2f} requests of that length"


def _best_reach(model: ServedModel, machine: Machine, request: ServeRequest) -> tuple[int | None, int | None]:
    """The longest context that fits every user, and the most users that fit at the context asked, on the widest
    lossless setup of `machine` (None where none)."""
    tp = max(t for t in TENSOR_PARALLEL if t <= machine.gpus and model.heads % t == 0)
    replicas = machine.gpus // tp
    users = math.ceil(request.concurrency / replicas)

    def concurrency(length: int) -> float:
        try:
            e = estimate_serving(model, machine.gpu, _settings(request, tp, max_model_len=length))
        except MemfitError:
            return 0.0
        return e.max_concurrency if e.starts else 0.0

    most = int(concurrency(request.max_model_len) * replicas)
    low, high = 0, request.max_model_len - 1
    while low < high:   # concurrency falls as the context grows: bisect
        mid = (low + high + 1) // 2
        if concurrency(mid) >= users:
            low = mid
        else:
            high = mid - 1
    return (low if low >= 64 else None), (most if 0 < most < request.concurrency else None)
