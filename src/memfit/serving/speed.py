"""How fast an engine serves a load: its scheduler simulated (scheduler.py) with each step timed (step_model.py), and
the figures vLLM's benchmark client prints, defined as it defines them:

- the duration runs from the first request sent to the last answer finished;
- request / output / total (prompt + output) tokens per second over that duration;
- TTFT: sent -> first token (queueing included); TPOT: per request (end-to-end - TTFT) / (output tokens - 1), then
  the mean over requests; ITL: every gap between tokens, pooled; E2EL: sent -> last token.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from statistics import mean, median

from memfit.core.errors import MemfitError
from memfit.serving import kv_cache
from memfit.serving.checkpoints import Checkpoint
from memfit.serving.load import Load
from memfit.serving.result import SPEED_KEYS, ServingEstimate
from memfit.serving.scheduler import Limits, Run, simulate
from memfit.serving.served_model import ServedModel
from memfit.serving.settings import ServeSettings
from memfit.serving.sglang import sglang_chunk, sglang_max_running
from memfit.serving.step_model import step_model
from memfit.specs.hardware import GPU

# vLLM's scheduler_reserve_full_isl (on by default in 0.32; the option came with PR #37307, merged in March 2026:
# the release it first defaults in is assumed)
WHOLE_PROMPT_FITS = "0.19.0"


@dataclass
class ServingSpeed:
    load: dict
    policy: str
    completed: int
    duration_s: float
    request_throughput: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    mean_ttft_ms: float
    median_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    mean_itl_ms: float
    mean_e2el_ms: float
    steps: int
    preemptions: int
    most_running: int
    kv_blocks: int                # the blocks the requests may hold (the timeline's kv_blocks are of these)
    timeline: dict = field(repr=False, default_factory=dict)
    sources: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "timeline"}


def policy_of(settings: ServeSettings) -> str:
    release = settings.release
    if settings.engine == "vllm":
        return "vllm-v1" if release.v1 else "vllm-v0"
    if settings.engine == "sglang":
        return "sglang"
    raise MemfitError(f"the serving speed of {settings.engine} is not modelled (its scheduler differs); memfit "
                      "simulates vllm and sglang.")


def serving_speed(model: ServedModel, gpu: GPU, settings: ServeSettings, dtype: str, checkpoint: Checkpoint,
                  estimate: ServingEstimate, load: Load) -> ServingSpeed:
    """`load` served by the engine `estimate` describes (it must start)."""
    if not estimate.starts:
        raise MemfitError(f"the engine does not start, so it serves nothing: {estimate.refusal}")
    if settings.pipeline_parallel > 1:
        raise MemfitError("the serving speed with pipeline parallel is not modelled (its stages' schedule); give "
                          "--pipeline-parallel 1.")
    policy = policy_of(settings)
    longest = max(p + o for p, o in load.requests())
    if longest > estimate.max_model_len:
        raise MemfitError(f"a request of {longest} tokens (prompt + answer) is longer than max_model_len "
                          f"({estimate.max_model_len}): the engine rejects it; raise --max-model-len or shorten "
                          "--input-len / --output-len.")
    limits = _limits(model, gpu, settings, dtype, estimate, policy)
    run = simulate(load, limits, step_model(model, checkpoint, dtype, gpu, estimate, policy), policy)
    speed = _metrics(run, load, policy, limits)
    if load.prefix_len and not limits.prefix_caching:
        speed.notes.append("no prefix cache here (SGLang's radix cache and vLLM V0's are not modelled, or it is off): "
                           "every request computes the shared prefix")
    return speed


def _limits(model: ServedModel, gpu: GPU, settings: ServeSettings, dtype: str, estimate: ServingEstimate,
            policy: str) -> Limits:
    tp = settings.tensor_parallel
    kv_dtype = kv_cache.kv_dtype(settings.kv_cache_dtype, dtype)
    layout = kv_cache.layout(model, tp, kv_dtype, estimate.block_size, grouped=policy == "vllm-v1")
    blocks = estimate.kv_blocks - (1 if policy == "vllm-v1" else 0)   # V1's null block
    blocks //= len(layout.groups)   # a request holds blocks in every group (a sliding group's as if full)
    if policy == "sglang":
        seqs = sglang_max_running(estimate.kv_cache_tokens, estimate.max_model_len, settings)
        return Limits(seqs, sglang_chunk(gpu, settings), blocks, 1)
    seqs, tokens = estimate.settings["max_num_seqs"], estimate.settings["max_num_batched_tokens"]
    return Limits(seqs, tokens, blocks, estimate.block_size, chunked=policy == "vllm-v1" or
                  tokens < estimate.max_model_len,
                  whole_prompt_fits=policy == "vllm-v1" and settings.release.at_least(WHOLE_PROMPT_FITS),
                  prefix_caching=policy == "vllm-v1" and settings.enable_prefix_caching)


def _metrics(run: Run, load: Load, policy: str, limits: Limits) -> ServingSpeed:
    done = run.requests
    times = [(r.sent, r.first, r.end) for r in done if r.first is not None and r.end is not None]
    if len(times) != len(done):
        raise RuntimeError("the simulation left requests unfinished")
    start = min(sent for sent, _, _ in times)
    duration = max(end for _, _, end in times) - start
    outputs = sum(r.generated for r in done)
    prompts = sum(r.prompt for r in done)
    ttft = [(first - sent) * 1e3 for sent, first, _ in times]
    tpot = [(end - first) * 1e3 / (r.generated - 1) for r, (_, first, end) in zip(done, times) if r.generated > 1]
    gaps = sum(end - first for _, first, end in times)
    return ServingSpeed(
        load=dataclasses.asdict(load), policy=policy, completed=len(done), duration_s=duration,
        request_throughput=len(done) / duration, output_tokens_per_s=outputs / duration,
        total_tokens_per_s=(prompts + outputs) / duration, mean_ttft_ms=mean(ttft), median_ttft_ms=median(ttft),
        mean_tpot_ms=mean(tpot) if tpot else 0.0, median_tpot_ms=median(tpot) if tpot else 0.0,
        mean_itl_ms=gaps * 1e3 / max(1, outputs - len(done)),
        mean_e2el_ms=mean((end - sent) * 1e3 for sent, _, end in times),
        steps=run.steps, preemptions=run.preemptions, most_running=max(run.timeline["running"], default=0),
        kv_blocks=limits.blocks,
        timeline=run.timeline,
        sources={key: "simulated (the scheduler over the step model)" for key in SPEED_KEYS},
        notes=[f"scheduler: {policy}, up to {limits.max_num_seqs} requests and {limits.token_budget} tokens a step, "
               f"{limits.blocks} KV blocks of {limits.block_size}"]
        + ([f"{run.preemptions} preemptions (the cache ran out of blocks; preempted requests recompute)"]
           if run.preemptions else []))
