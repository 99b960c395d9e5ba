"""What a serving engine sets aside on each GPU at start-up, and whether it starts: `estimate_serving`.

vLLM (per GPU): budget = total x gpu_memory_utilization; the KV cache gets the budget less the weights, the profile
run's activation peak, the memory outside torch and (from 0.21) the CUDA graphs' estimate; blocks = that space over
one block of every layer (kv_cache.py). SGLang: the pool is the memory free after the weights less the total free
before them times (1 - mem_fraction_static). Every figure carries its source label (analytic, modelled, calibrated,
assumed, given).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from memfit.core.dtypes import dtype_bytes
from memfit.core.errors import MemfitError
from memfit.core.units import GiB, MiB
from memfit.serving import kv_cache
from memfit.serving.checkpoints import Checkpoint, checkpoint_of, weights_bytes
from memfit.serving.profile_run import ProfileShape, activation_peak, capture_sizes, cuda_graph_bytes
from memfit.serving.served_model import ServedModel
from memfit.serving.settings import ServeSettings
from memfit.specs.hardware import GPU

# Memory outside torch that one instance adds after its start snapshot (vLLM >= 0.6.5): the kernel modules CUDA's
# lazy loading brings in at their first use in the profile run (cuBLAS, attention, sampler and Triton kernels);
# calibrated: the median of the single-GPU rows that log it (v-16g-qwen7b-awq 0.06, v-80g-llama31 0.12,
# v-24g-qwen05-lora 0.07, v-4090-qwen2vl 0.28 GiB)
LAZY_MODULES_BYTES = int(0.1 * GiB)
# NCCL's and the custom all-reduce's buffers per GPU at tensor parallel > 1; calibrated on v-l40s-qwen3-235b (0.21
# GiB at TP 4, less the single-GPU figure)
COLLECTIVES_BYTES = int(0.11 * GiB)


@dataclass
class ServingEstimate:
    model: str
    hub_id: str
    engine: str
    engine_version: str
    gpu: str
    gpu_memory_bytes: int
    gpus: int
    settings: dict
    weights_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    budget_bytes: int
    kv_cache_bytes: int
    kv_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    max_model_len: int
    max_model_len_fits: int
    starts: bool
    refusal: str | None
    block_size: int
    kv_bytes_per_token: int
    graphs_in_budget: bool
    sources: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"schema": "memfit.serve/1", **dataclasses.asdict(self)}


def estimate_serving(model: ServedModel, gpu: GPU, settings: ServeSettings) -> ServingEstimate:
    """The engine's start-up on `gpu` (each of tensor x pipeline parallel GPUs of one replica; data-parallel replicas
    are alike), or a one-line MemfitError for a setting the engine rejects before loading."""
    _check_parallel(model, settings)
    dtype = served_dtype(model, settings, gpu)
    checkpoint = checkpoint_of(model, settings.quantization, gpu.compute_capability)
    if settings.engine == "vllm":
        return _vllm(model, gpu, settings, dtype, checkpoint)
    if settings.engine == "sglang":
        return _sglang(model, gpu, settings, dtype, checkpoint)
    raise MemfitError(f"--engine {settings.engine}: not modelled yet; memfit models vllm and sglang.")


def served_dtype(model: ServedModel, settings: ServeSettings, gpu: GPU) -> str:
    """--dtype auto: the checkpoint's dtype; float32 checkpoints are served in bfloat16, and bfloat16 becomes
    float16 on GPUs without it (compute capability < 8.0), as the engines do."""
    dtype = {"half": "float16"}.get(settings.dtype, settings.dtype)
    if dtype == "auto":
        dtype = "bfloat16" if model.dtype == "float32" else model.dtype
    if dtype == "bfloat16" and tuple(gpu.compute_capability) < (8, 0):
        dtype = "float16"
    return dtype


def _check_parallel(model: ServedModel, settings: ServeSettings) -> None:
    tp, pp = settings.tensor_parallel, settings.pipeline_parallel
    if model.heads % tp:
        raise MemfitError(f"Total number of attention heads ({model.heads}) must be divisible by tensor parallel "
                          f"size ({tp}): --tensor-parallel must divide {model.heads}.")
    if pp > model.layers:
        raise MemfitError(f"--pipeline-parallel {pp} is more stages than the model's {model.layers} layers.")
    limit = model.max_positions
    if settings.max_model_len is not None and settings.max_model_len > limit:
        raise MemfitError(f"User-specified max_model_len ({settings.max_model_len}) is greater than the derived "
                          f"max_model_len (max_position_embeddings={limit} in the model's config): the engine "
                          "refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (positions beyond the model's are "
                          "untrained); give --max-model-len <= " f"{limit}.")


def _stage_layers(model: ServedModel, pp: int) -> list[tuple[int, int]]:
    """Each pipeline stage's layers [start, stop): as even as possible, the first stages taking the remainder."""
    base, extra = divmod(model.layers, pp)
    bounds, start = [], 0
    for stage in range(pp):
        stop = start + base + (stage < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def vllm_defaults(settings: ServeSettings, gpu: GPU, max_model_len: int, model: ServedModel) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) as the release sets them for this GPU and entry point."""
    release = settings.release
    seqs, tokens = settings.max_num_seqs, settings.max_num_batched_tokens
    if not release.v1:
        seqs = seqs or 256
        if tokens is None:
            chunked = max_model_len > 32768 and not any(a.kind == "sliding" for a in model.attention)
            tokens = (2048 if release.at_least("0.6.5") else 512) if chunked else max(max_model_len, 2048)
        return tokens, seqs
    memory = gpu.memory_bytes
    offline = settings.entrypoint == "offline"
    large = (memory >= 70 * GiB and "a100" not in gpu.name) if release.at_least("0.8.5") else \
        gpu.name.startswith(("h100", "h200"))
    if memory >= 160 * GiB and release.at_least("0.28.0"):
        default_tokens, default_seqs = 16384, 1024
    elif large:
        default_tokens, default_seqs = (16384 if offline else 8192), 1024
    else:
        default_tokens, default_seqs = (8192 if offline else 2048), 256
    if tokens is None:
        tokens = default_tokens
        if release.at_least("0.11.2"):
            tokens = min(tokens, (seqs or default_seqs) * max_model_len)
    if seqs is None:
        seqs = default_seqs
        if release.at_least("0.11.2"):
            seqs = min(seqs, tokens)
    return tokens, seqs


def _vllm(model: ServedModel, gpu: GPU, settings: ServeSettings, dtype: str, checkpoint: Checkpoint) -> ServingEstimate:
    release = settings.release
    tp, pp = settings.tensor_parallel, settings.pipeline_parallel
    max_len = settings.max_model_len or model.max_positions
    tokens, seqs = vllm_defaults(settings, gpu, max_len, model)
    util = settings.gpu_memory_utilization or release.default_utilization
    kv_dtype = kv_cache.kv_dtype(settings.kv_cache_dtype, dtype)
    block = settings.block_size or (64 if model.mla_latent and release.v1 else 16)
    notes: list[str] = []
    sources = {"weights_bytes": "analytic", "activation_bytes": "modelled", "kv_cache_bytes": "modelled"}
    per_stage = []
    for stage, layers in enumerate(_stage_layers(model, pp)):
        stage_layers = layers if pp > 1 else None
        if settings.expert_parallel and model.experts:
            weights = _expert_parallel_weights(model, checkpoint, dtype, tp, tp * settings.data_parallel, stage_layers)
        else:
            weights = weights_bytes(model, checkpoint, dtype, tp, pp_layers=stage_layers)
        weights += rotary_cache_bytes(model, dtype)
        weights -= min(weights, int(settings.cpu_offload_gb * GiB))
        attention = model.attention[layers[0]:layers[1]]
        per_stage.append((weights, attention, stage == pp - 1))
    weights, attention, _ = max(per_stage, key=lambda s: s[0])
    shape = ProfileShape(tokens, min(seqs, tokens))
    activation = max(activation_peak(model, shape, tp, dtype, release.v1, last) for _, _, last in per_stage)
    global_budget = release.global_budget or (release.v1 and not release.at_least("0.9.1"))
    if global_budget:
        non_torch = gpu.context_bytes + settings.other_process_bytes
        sources["non_torch_bytes"] = "assumed (the CUDA context, gpus.json) + given (other processes)"
    else:
        non_torch = LAZY_MODULES_BYTES
        sources["non_torch_bytes"] = "calibrated (kernel modules loaded at first use)"
    if tp * pp > 1:
        non_torch += COLLECTIVES_BYTES
        sources["non_torch_bytes"] += " + calibrated (NCCL and custom all-reduce buffers)"
    graphs = 0 if settings.enforce_eager else cuda_graph_bytes(model, capture_sizes(seqs, tokens, release.v1), tp,
                                                               dtype, release.v1)
    sources["cuda_graph_bytes"] = "calibrated" if graphs else "none (--enforce-eager)"
    total = gpu.memory_bytes
    budget = int(total * util)
    refusal = None
    free_at_start = total - gpu.context_bytes - settings.other_process_bytes
    if not global_budget and free_at_start < budget:
        refusal = (f"Free memory on device ({free_at_start / GiB:.2f}/{total / GiB:.2f} GiB) on startup is less than "
                   f"desired GPU memory utilization ({util}, {budget / GiB:.2f} GiB). Decrease GPU memory "
                   "utilization or reduce GPU memory used by other processes.")
    if settings.kv_cache_memory is not None:
        available = settings.kv_cache_memory
        sources["kv_cache_bytes"] = "given (--kv-cache-memory)"
    else:
        available = budget - weights - activation - non_torch - (graphs if release.graphs_in_budget else 0)
    grouped = release.v1
    layout = kv_cache.layout(model, tp, kv_dtype, block, attention, grouped=grouped)
    blocks = layout.blocks(available)
    step_tokens = tokens
    if release.v1:
        concurrency = layout.max_concurrency(blocks, max_len, step_tokens)
        cache_tokens = int(concurrency * max_len) if release.at_least("0.20.1") else layout.cache_tokens(blocks)
    else:
        cache_tokens = blocks * block
        concurrency = cache_tokens / max_len
    fits = layout.longest_fitting(blocks - (1 if release.v1 else 0), step_tokens, model.max_positions)
    if refusal is None:
        refusal = _vllm_refusal(release.v1, available, layout, blocks, cache_tokens, max_len, step_tokens, fits)
    if not release.graphs_in_budget and graphs:
        notes.append(f"CUDA graphs ({graphs / GiB:.2f} GiB) are captured after the cache, on top of the budget "
                     f"(vLLM < 0.21): the GPU holds about {(budget + graphs) / GiB:.2f} GiB")
    if checkpoint.method:
        notes.append(f"weights stored as {checkpoint.method} ({checkpoint.fmt.library if checkpoint.fmt else ''})")
    resolved = {"tensor_parallel": tp, "pipeline_parallel": pp, "data_parallel": settings.data_parallel,
                "max_model_len": max_len, "gpu_memory_utilization": util, "max_num_seqs": seqs,
                "max_num_batched_tokens": tokens, "block_size": block, "kv_cache_dtype": settings.kv_cache_dtype,
                "dtype": dtype, "quantization": checkpoint.method, "enforce_eager": settings.enforce_eager,
                "entrypoint": settings.entrypoint}
    return ServingEstimate(
        model=model.name, hub_id=model.hub_id, engine="vllm", engine_version=release.version, gpu=gpu.name,
        gpu_memory_bytes=total,
        gpus=tp * pp * settings.data_parallel, settings=resolved, weights_bytes=weights, activation_bytes=activation,
        non_torch_bytes=non_torch, cuda_graph_bytes=graphs, budget_bytes=budget, kv_cache_bytes=available,
        kv_blocks=blocks, kv_cache_tokens=cache_tokens, max_concurrency=round(concurrency, 2), max_model_len=max_len,
        max_model_len_fits=fits, starts=refusal is None, refusal=refusal, block_size=block,
        kv_bytes_per_token=layout.token_bytes, graphs_in_budget=release.graphs_in_budget, sources=sources,
        notes=notes)


def _expert_parallel_weights(model, checkpoint, dtype, tp: int, ep: int, layers) -> int:
    """Expert parallel: the experts split whole over the tensor x data parallel ranks, everything else as tensor
    parallel splits it."""
    experts = dataclasses.replace(model, weights=tuple(w for w in model.weights if ".experts." in w.name),
                                  extra_parameters=None)
    rest = dataclasses.replace(model, weights=tuple(w for w in model.weights if ".experts." not in w.name))
    return (weights_bytes(experts, checkpoint, dtype, 1, ep=ep, pp_layers=layers)
            + weights_bytes(rest, checkpoint, dtype, tp, pp_layers=layers))


def rotary_cache_bytes(model: ServedModel, dtype: str) -> int:
    """vLLM's rotary embedding keeps a cos/sin cache of max_position x rotary_dim in the served dtype, shared by
    every layer with the same rope."""
    return model.max_positions * model.rotary_dim * dtype_bytes(dtype) * model.ropes


def _vllm_refusal(v1: bool, available: int, layout, blocks: int, cache_tokens: int, max_len: int, step_tokens: int,
                  fits: int) -> str | None:
    if available <= 0 or blocks <= 0:
        return ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                "initializing the engine.")
    if v1:
        needed = layout.request_blocks(max_len, step_tokens) * layout.block_bytes
        usable = available - layout.block_bytes   # the pool's null block
        if needed > usable:
            estimate = f"Based on the available memory, the estimated maximum model length is {fits}. " if fits else ""
            return (f"To serve at least one request with the model's max seq len ({max_len}), ({needed / GiB:.2f} "
                    f"GiB KV cache is needed, which is larger than the available KV cache memory "
                    f"({usable / GiB:.2f} GiB). {estimate}Try increasing `gpu_memory_utilization` or decreasing "
                    "`max_model_len` when initializing the engine.")
        return None
    if max_len > cache_tokens:
        return (f"The model's max seq len ({max_len}) is larger than the maximum number of tokens that can be stored "
                f"in KV cache ({cache_tokens}). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
                "when initializing the engine.")
    return None


def sglang_fraction(gpu: GPU, settings: ServeSettings) -> float:
    """SGLang's default mem_fraction_static (>= 0.5.4): what it reserves for activations and CUDA graphs, in MiB,
    512 + 1.5 x max(chunked_prefill_size, 2048) + 2 x cuda_graph_max_bs + TP x PP / 8 x 1024, off the device's
    total (at least 10 GiB reserved on GPUs above 60 GiB)."""
    if settings.mem_fraction_static is not None:
        return settings.mem_fraction_static
    total_mib = gpu.memory_bytes / MiB
    chunk = settings.chunked_prefill_size or (2048 if total_mib < 35 * 1024 else 4096 if total_mib < 60 * 1024
                                              else 8192 if total_mib < 90 * 1024 else 16384)
    graph_bs = settings.cuda_graph_max_bs or (8 if total_mib < 20 * 1024 else 80 if total_mib < 35 * 1024
                                              else 160 if total_mib < 60 * 1024 else 256)
    reserved = 512 + 1.5 * max(chunk, 2048) + 2 * graph_bs + settings.tensor_parallel \
        * settings.pipeline_parallel / 8 * 1024
    if total_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((total_mib - reserved) / total_mib, 3)


def _sglang(model: ServedModel, gpu: GPU, settings: ServeSettings, dtype: str,
            checkpoint: Checkpoint) -> ServingEstimate:
    tp = settings.tensor_parallel
    max_len = settings.max_model_len or model.max_positions
    fraction = sglang_fraction(gpu, settings)
    weights = weights_bytes(model, checkpoint, dtype, tp) + rotary_cache_bytes(model, dtype)
    non_torch = gpu.context_bytes + (COLLECTIVES_BYTES if tp > 1 else 0)
    free_before = gpu.memory_bytes - non_torch - settings.other_process_bytes
    pool = int(free_before - weights - free_before * (1 - fraction))
    kv_dtype = kv_cache.kv_dtype(settings.kv_cache_dtype, dtype)
    cell = sum(kv_cache.token_bytes(model, layer, tp, kv_dtype) for layer in model.attention)
    tokens = max(0, pool // cell)
    refusal = None
    if pool <= 0:
        refusal = ("Not enough memory. Please try to increase --mem-fraction-static (the KV pool after the weights "
                   f"is {pool / GiB:.2f} GiB).")
    resolved = {"tensor_parallel": tp, "max_model_len": max_len, "mem_fraction_static": fraction,
                "kv_cache_dtype": settings.kv_cache_dtype, "dtype": dtype, "quantization": checkpoint.method}
    return ServingEstimate(
        model=model.name, hub_id=model.hub_id, engine="sglang", engine_version=settings.release.version, gpu=gpu.name,
        gpu_memory_bytes=gpu.memory_bytes, gpus=tp * settings.data_parallel, settings=resolved, weights_bytes=weights,
        activation_bytes=0, non_torch_bytes=non_torch, cuda_graph_bytes=0,
        budget_bytes=int(free_before * fraction), kv_cache_bytes=max(0, pool), kv_blocks=tokens,
        kv_cache_tokens=tokens, max_concurrency=round(tokens / max_len, 2), max_model_len=max_len,
        max_model_len_fits=min(tokens, model.max_positions), starts=refusal is None, refusal=refusal, block_size=1,
        kv_bytes_per_token=cell, graphs_in_budget=False,
        sources={"weights_bytes": "analytic", "kv_cache_bytes": "modelled", "non_torch_bytes": "assumed",
                 "activation_bytes": "not profiled (inside 1 - mem_fraction_static)"},
        notes=[f"activations and CUDA graphs must fit in the {1 - fraction:.3f} of free memory SGLang leaves"])
