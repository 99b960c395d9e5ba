"""TGI's start-up: one warm-up prefill of max_batch_prefill_tokens, then the KV cache from the memory still free,
by release (its wiggle room and block size)."""
from __future__ import annotations

from memfit.core.dtypes import dtype_bytes
from memfit.serving import kv_cache
from memfit.serving.checkpoints import Checkpoint, reserved_weights_bytes
from memfit.serving.profile_run import forward_peak
from memfit.serving.result import COLLECTIVES_BYTES, ServingEstimate, rotary_cache_bytes
from memfit.serving.served_model import ServedModel
from memfit.serving.settings import ServeSettings
from memfit.specs.hardware import GPU

# the share of the free memory the cache takes (TGI_WIGGLE_ROOM's default from 2.3), by release: none before 1.4.1
TGI_WIGGLE = (("3.3.0", 0.90), ("3.1.0", 0.93), ("3.0.0", 0.95), ("2.4.0", 0.90), ("1.4.1", 0.95), ("0", 1.0))
TGI_BLOCK = (("2.3.0", 1), ("0", 16))   # tokens per block: flashinfer's 1 from 2.3 (its default), paged's 16 before


def tgi_defaults(release, settings: ServeSettings, max_len: int) -> int:
    """max_batch_prefill_tokens: 4096 (1.x); from 2.0 max_input_tokens + 50, max_input_tokens being
    min(max_position_embeddings, 4096) - 1 (3.x: the same default when the GPU's memory is not probed)."""
    if settings.max_batch_prefill_tokens:
        return settings.max_batch_prefill_tokens
    if not release.at_least("2.0.0"):
        return 4096
    return min(max_len, 4096) - 1 + 50


def tgi_warmup_logits(model: ServedModel, tokens: int, tp: int, dtype: str) -> int:
    """The warm-up's requests ask for every prompt token's log-probabilities (prefill_logprobs, the router's
    warm-up batch), so the head computes logits for all `tokens` rows: each rank's slice of the vocabulary, and at
    tensor parallel > 1 the gathered slices and their concatenation (TensorParallelHead), beside the last hidden
    states. log_softmax writes the prefill log-probabilities beside the logits (two arrays; the hidden states are
    freed by then at tensor parallel 1). At tensor parallel > 1 the gathered logits are a transposed view, so
    log_softmax copies it and writes a third array: three times the full logits."""
    width = dtype_bytes(dtype)
    logits = tokens * model.vocab * width
    if tp == 1:
        return max(tokens * model.hidden * width + logits, 2 * logits)
    return tokens * model.hidden * width + 3 * logits


def estimate(model: ServedModel, gpu: GPU, settings: ServeSettings, dtype: str,
             checkpoint: Checkpoint) -> ServingEstimate:
    """TGI: the warm-up runs one prefill of max_batch_prefill_tokens; of the memory then free (the warm-up's
    activations still cached by the allocator), less (1 - cuda_memory_fraction) of the total, the KV cache takes the
    wiggle room's share (1.x-2.x), or the free memory less (1 - fraction x wiggle room) of the total (3.x)."""
    release = settings.release
    tp = settings.tensor_parallel
    max_len = settings.max_model_len or min(model.max_positions, 4096)
    prefill = tgi_defaults(release, settings, max_len)
    weights = reserved_weights_bytes(model, checkpoint, dtype, tp) + rotary_cache_bytes(model, dtype)
    activation = max(forward_peak(model, prefill, tp, dtype), tgi_warmup_logits(model, prefill, tp, dtype))
    non_torch = gpu.context_bytes + (COLLECTIVES_BYTES if tp > 1 else 0)
    total = gpu.memory_bytes
    free = total - non_torch - settings.other_process_bytes - weights - activation
    fraction = settings.cuda_memory_fraction
    wiggle = next(w for version, w in TGI_WIGGLE if release.at_least(version))
    if release.at_least("3.0.0"):
        available = int(free - (1 - fraction * wiggle) * total)
    else:
        available = int((free - (1 - fraction) * total) * wiggle)
    kv_dtype = kv_cache.kv_dtype(settings.kv_cache_dtype, dtype)
    block = settings.block_size or next(b for version, b in TGI_BLOCK if release.at_least(version))
    layout = kv_cache.layout(model, tp, kv_dtype, block, grouped=False)
    cell = layout.token_bytes
    blocks = layout.blocks(available)
    tokens = blocks * block
    refusal = None
    if blocks == 0:
        refusal = "Not enough memory to handle the warm-up prefill: lower --max-batch-prefill-tokens."
    elif tokens < max_len:
        refusal = (f"`max_total_tokens` ({max_len}) is larger than the memory allows ({tokens} tokens in the KV "
                   "cache): lower --max-total-tokens.")
    resolved = {"tensor_parallel": tp, "max_model_len": max_len, "max_batch_prefill_tokens": prefill,
                "cuda_memory_fraction": fraction, "kv_cache_dtype": settings.kv_cache_dtype, "dtype": dtype,
                "quantization": checkpoint.method,
                "quantize_on_load": settings.quantization}
    return ServingEstimate(
        model=model.name, hub_id=model.hub_id, engine="tgi", engine_version=release.version, gpu=gpu.name,
        gpu_memory_bytes=total, gpus=tp * settings.data_parallel, settings=resolved, weights_bytes=weights,
        activation_bytes=activation, non_torch_bytes=non_torch, cuda_graph_bytes=0,
        budget_bytes=int(total * fraction), kv_cache_bytes=max(0, available), kv_blocks=blocks, kv_cache_tokens=tokens,
        max_concurrency=round(tokens / max_len, 2), max_model_len=max_len,
        max_model_len_fits=min(tokens, model.max_positions),
        starts=refusal is None, refusal=refusal, block_size=block, page_bytes=layout.page_bytes,
        kv_bytes_per_token=cell, graphs_in_budget=False,
        sources={"weights_bytes": "analytic", "activation_bytes": "modelled (the warm-up prefill)",
                 "kv_cache_bytes": "modelled", "non_torch_bytes": "assumed",
                 "cuda_graph_bytes": "not counted (captured after the cache, in the wiggle room)"},
        notes=[f"warm-up: one prefill of {prefill} tokens, its logits kept for every token"])
