"""SGLang's start-up: the KV pool is the memory free after the weights less the memory free before them times
(1 - mem_fraction_static); activations and CUDA graphs must fit in what that fraction leaves."""
from __future__ import annotations

from memfit.core.units import GiB, MiB
from memfit.serving import kv_cache
from memfit.serving.checkpoints import Checkpoint, reserved_weights_bytes
from memfit.serving.result import COLLECTIVES_BYTES, ServingEstimate, rotary_cache_bytes
from memfit.serving.served_model import ServedModel
from memfit.serving.settings import ServeSettings
from memfit.specs.hardware import GPU

SGLANG_TP_FRACTIONS = ((16, 0.79), (8, 0.81), (4, 0.85), (2, 0.87), (1, 0.88))   # 0.4.0-0.4.8, by TP size


def sglang_fraction(gpu: GPU, settings: ServeSettings) -> float:
    """SGLang's default mem_fraction_static, by release (server_args.py): a table by tensor-parallel size up to
    0.4.8; then (memory - reserved) / memory, reserving (MiB, P = TP x PP) (2.8 + P/10) x 1024 below 35 GiB,
    (9.5 + P/2) x 1024 below 90, (12 + P/2) x 1024 below 160, else 32 x 1024 (0.4.9-0.5.3); from 0.5.4
    512 + 1.5 x max(chunked_prefill_size, 2048) + 2 x cuda_graph_max_bs + P / 8 x 1024, at least 10 GiB above
    60 GiB. (SGLang reads nvidia-smi's total, a little above the CUDA total memfit has.)"""
    if settings.mem_fraction_static is not None:
        return settings.mem_fraction_static
    release, parallel = settings.release, settings.tensor_parallel * settings.pipeline_parallel
    if not release.at_least("0.4.9"):
        return next(f for tp, f in SGLANG_TP_FRACTIONS if settings.tensor_parallel >= tp)
    total_mib = gpu.memory_bytes / MiB
    if not release.at_least("0.5.4"):
        reserved = 1024 * (2.8 + parallel / 10 if total_mib < 35 * 1024 else 9.5 + parallel / 2
                           if total_mib < 90 * 1024 else 12 + parallel / 2 if total_mib < 160 * 1024 else 32)
        return round((total_mib - reserved) / total_mib, 3)
    chunk = sglang_chunk(gpu, settings)
    graph_bs = settings.cuda_graph_max_bs or (8 if total_mib < 20 * 1024 else 80 if total_mib < 35 * 1024
                                              else 160 if total_mib < 60 * 1024 else 256)
    reserved = 512 + 1.5 * max(chunk, 2048) + 2 * graph_bs + parallel / 8 * 1024
    if total_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((total_mib - reserved) / total_mib, 3)


def sglang_chunk(gpu: GPU, settings: ServeSettings) -> int:
    """--chunked-prefill-size's default by the GPU's memory (server_args.py; 8192 before 0.4.9 on any GPU)."""
    if settings.chunked_prefill_size:
        return settings.chunked_prefill_size
    if not settings.release.at_least("0.4.9"):
        return 8192
    total_mib = gpu.memory_bytes / MiB
    return 2048 if total_mib < 35 * 1024 else 4096 if total_mib < 60 * 1024 else 8192 if total_mib < 90 * 1024 \
        else 16384


def sglang_max_running(tokens: int, context: int, settings: ServeSettings) -> int:
    """max_running_requests: --max-running-requests if given, else the pool's tokens over the context x 512, within
    2048 and 4096 (model_runner.py)."""
    return settings.max_num_seqs or min(max(int(tokens / context * 512), 2048), 4096)


def estimate(model: ServedModel, gpu: GPU, settings: ServeSettings, dtype: str,
            checkpoint: Checkpoint) -> ServingEstimate:
    tp = settings.tensor_parallel
    max_len = settings.max_model_len or model.max_positions
    fraction = sglang_fraction(gpu, settings)
    # SGLang's rope keeps its cos/sin cache in float32 (the fused rope kernel reads it so)
    weights = reserved_weights_bytes(model, checkpoint, dtype, tp) + rotary_cache_bytes(model, "float32")
    non_torch = gpu.context_bytes + (COLLECTIVES_BYTES if tp > 1 else 0)
    free_before = gpu.memory_bytes - non_torch - settings.other_process_bytes
    pool = int(free_before - weights - free_before * (1 - fraction))
    kv_dtype = kv_cache.kv_dtype(settings.kv_cache_dtype, dtype)
    layout = kv_cache.layout(model, tp, kv_dtype, 1, grouped=False)   # SGLang's pool: one token a page
    cell = layout.token_bytes
    tokens = layout.blocks(pool)
    refusal = None
    if pool <= 0:
        refusal = ("Not enough memory. Please try to increase --mem-fraction-static (the KV pool after the weights "
                   f"is {pool / GiB:.2f} GiB).")
    resolved = {"tensor_parallel": tp, "max_model_len": max_len, "mem_fraction_static": fraction,
                "kv_cache_dtype": settings.kv_cache_dtype, "dtype": dtype, "quantization": checkpoint.method,
                "quantize_on_load": settings.quantization}
    return ServingEstimate(
        model=model.name, hub_id=model.hub_id, engine="sglang", engine_version=settings.release.version, gpu=gpu.name,
        gpu_memory_bytes=gpu.memory_bytes, gpus=tp * settings.data_parallel, settings=resolved, weights_bytes=weights,
        activation_bytes=0, non_torch_bytes=non_torch, cuda_graph_bytes=0,
        budget_bytes=int(free_before * fraction), kv_cache_bytes=max(0, pool), kv_blocks=tokens,
        kv_cache_tokens=tokens, max_concurrency=round(tokens / max_len, 2), max_model_len=max_len,
        max_model_len_fits=min(tokens, model.max_positions), starts=refusal is None, refusal=refusal, block_size=1,
        page_bytes=layout.page_bytes, kv_bytes_per_token=cell, graphs_in_budget=False,
        sources={"weights_bytes": "analytic (as the caching allocator reserves them: SGLang's load-time mem usage)",
                 "kv_cache_bytes": "modelled", "non_torch_bytes": "assumed",
                 "activation_bytes": "not profiled (inside 1 - mem_fraction_static)",
                 "cuda_graph_bytes": "not counted (inside 1 - mem_fraction_static)"},
        notes=[f"activations and CUDA graphs must fit in the {1 - fraction:.3f} of free memory SGLang leaves"])
