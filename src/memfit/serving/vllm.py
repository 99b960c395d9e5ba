"""vLLM's start-up, per GPU: budget = total x gpu_memory_utilization; the KV cache gets the budget less the weights,
the profile run's activation peak, the memory outside torch and (from 0.21) the CUDA graphs' estimate; blocks = that
space over one block of every layer (kv_cache.py), the least over the pipeline stages. The eras: releases.py."""
from __future__ import annotations

import dataclasses

from memfit.core.units import GiB
from memfit.serving import kv_cache
from memfit.serving.checkpoints import Checkpoint, weights_bytes
from memfit.serving.profile_run import ProfileShape, activation_peak, capture_sizes, cuda_graph_bytes
from memfit.serving.result import COLLECTIVES_BYTES, ServingEstimate, rotary_cache_bytes
from memfit.serving.served_model import ServedModel
from memfit.serving.settings import ServeSettings
from memfit.specs.hardware import GPU

# Memory outside torch that one instance adds after its start snapshot (vLLM >= 0.6.5): the kernel modules CUDA's
# lazy loading brings in at their first use in the profile run (cuBLAS, attention, sampler and Triton kernels);
# calibrated: the median of the single-GPU rows that log it (v-16g-qwen7b-awq 0.06, v-80g-llama31 0.12,
# v-24g-qwen05-lora 0.07, v-4090-qwen2vl 0.28 GiB)
LAZY_MODULES_BYTES = int(0.1 * GiB)


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


def estimate(model: ServedModel, gpu: GPU, settings: ServeSettings, dtype: str,
             checkpoint: Checkpoint) -> ServingEstimate:
    release = settings.release
    tp, pp = settings.tensor_parallel, settings.pipeline_parallel
    autofit = settings.max_model_len == -1
    max_len = model.max_positions if autofit else settings.max_model_len or model.max_positions
    tokens, seqs = vllm_defaults(settings, gpu, max_len, model)
    util = settings.gpu_memory_utilization or release.default_utilization
    kv_dtype = kv_cache.kv_dtype(settings.kv_cache_dtype, dtype)
    block = settings.block_size or (64 if model.mla_latent and release.v1 else 16)
    notes: list[str] = []
    sources = {"weights_bytes": "analytic", "activation_bytes": "modelled", "kv_cache_bytes": "modelled"}
    global_budget = release.global_budget
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
        sources["kv_cache_bytes"] = "given (--kv-cache-memory)"
    shape = ProfileShape(tokens, min(seqs, tokens))
    stages = []   # per pipeline stage: its weights, activations, cache layout, the space left and its blocks
    for stage, layers in enumerate(_stage_layers(model, pp)):
        stage_layers = layers if pp > 1 else None
        if settings.expert_parallel and model.experts:
            weights = _expert_parallel_weights(model, checkpoint, dtype, tp, tp * settings.data_parallel, stage_layers)
        else:
            weights = weights_bytes(model, checkpoint, dtype, tp, pp_layers=stage_layers)
        weights += rotary_cache_bytes(model, dtype)
        weights -= min(weights, int(settings.cpu_offload_gb * GiB))
        activation = activation_peak(model, shape, tp, dtype, release.v1, last_stage=stage == pp - 1)
        layout = kv_cache.layout(model, tp, kv_dtype, block, model.attention[layers[0]:layers[1]],
                                 grouped=release.v1)
        available = settings.kv_cache_memory if settings.kv_cache_memory is not None else \
            budget - weights - activation - non_torch - (graphs if release.graphs_in_budget else 0)
        stages.append((layout.blocks(available), weights, activation, layout, available))
    blocks, weights, activation, layout, available = min(stages, key=lambda s: s[0])   # the engine takes the least
    step_tokens = tokens
    fits = layout.longest_fitting(blocks - (1 if release.v1 else 0), step_tokens, max(max_len, model.max_positions))
    if autofit and 0 < fits < max_len:
        notes.append(f"Auto-fit max_model_len: reduced from {max_len} to {fits} to fit in available KV cache memory")
        max_len = fits
    if release.v1:
        concurrency = layout.max_concurrency(blocks, max_len, step_tokens)
        cache_tokens = int(concurrency * max_len) if release.at_least("0.20.1") else layout.cache_tokens(blocks)
    else:
        cache_tokens = blocks * block
        concurrency = cache_tokens / max_len
    if refusal is None:
        refusal = _vllm_refusal(release.v1, available, layout, blocks, cache_tokens, max_len, step_tokens, fits)
    if not release.graphs_in_budget and graphs:
        notes.append(f"CUDA graphs ({graphs / GiB:.2f} GiB) are captured after the cache, on top of the budget "
                     f"(vLLM < 0.21): the GPU holds about {(budget + graphs) / GiB:.2f} GiB")
    if checkpoint.method:
        notes.append(f"weights: the checkpoint's {checkpoint.fmt.name if checkpoint.fmt else ''} layout, loaded as "
                     f"vLLM's {checkpoint.method}")
    resolved = {"tensor_parallel": tp, "pipeline_parallel": pp, "data_parallel": settings.data_parallel,
                "max_model_len": max_len, "gpu_memory_utilization": util, "max_num_seqs": seqs,
                "max_num_batched_tokens": tokens, "block_size": block, "kv_cache_dtype": settings.kv_cache_dtype,
                "dtype": dtype, "quantization": checkpoint.method,
                "quantize_on_load": settings.quantization, "enforce_eager": settings.enforce_eager,
                "entrypoint": settings.entrypoint}
    return ServingEstimate(
        model=model.name, hub_id=model.hub_id, engine="vllm", engine_version=release.version, gpu=gpu.name,
        gpu_memory_bytes=total,
        gpus=tp * pp * settings.data_parallel, settings=resolved, weights_bytes=weights, activation_bytes=activation,
        non_torch_bytes=non_torch, cuda_graph_bytes=graphs, budget_bytes=budget, kv_cache_bytes=available,
        kv_blocks=blocks, kv_cache_tokens=cache_tokens, max_concurrency=round(concurrency, 2), max_model_len=max_len,
        max_model_len_fits=fits, starts=refusal is None, refusal=refusal, block_size=block,
        page_bytes=layout.page_bytes, kv_bytes_per_token=layout.token_bytes,
        graphs_in_budget=release.graphs_in_budget, sources=sources, notes=notes)


def _expert_parallel_weights(model, checkpoint, dtype, tp: int, ep: int, layers) -> int:
    """Expert parallel: the experts split whole over the tensor x data parallel ranks, everything else as tensor
    parallel splits it."""
    experts = dataclasses.replace(model, weights=tuple(w for w in model.weights if ".experts." in w.name),
                                  extra_parameters=None)
    rest = dataclasses.replace(model, weights=tuple(w for w in model.weights if ".experts." not in w.name))
    return (weights_bytes(experts, checkpoint, dtype, 1, ep=ep, pp_layers=layers)
            + weights_bytes(rest, checkpoint, dtype, tp, pp_layers=layers))


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
