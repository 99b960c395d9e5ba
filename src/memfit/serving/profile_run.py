"""What an engine's profile run and CUDA graphs hold beyond the weights, analytic (from the model's widths; no trace).

The profile run is one forward over `tokens` flattened tokens spread over `requests` requests, then the sampler on
one row of logits per request. The engines' model code keeps, at the MLP of a dense layer (its peak): the residual
stream and the normed input (2 x hidden), the fused gate-up projection (2 x inner), its activation (inner) and the
down projection's output (hidden), per token; a mixture's fused kernel keeps per token and chosen expert its gate-up
and activation (fused_moe's intermediate caches) and the weighted outputs before they are summed. Attention runs
from a paged kernel without a score matrix (V1's profile skips it: no cache exists yet).

The sampler: the head's logits in the served dtype, their float32 copy, and the top-k/top-p sort the profile forces
(top_k = vocab - 1, top_p < 1): sorted values and their int64 indices (V1: 18 bytes per logit, modelled from its ops).
V0's sampler (<= 0.7) also held the sort's double buffers and the log-probabilities: 38 bytes per logit, calibrated
on rows v-turing-phi15 and v-80g-llama31 of published_serving.md (phi-1.5 and Llama-3.1-8B at 256 rows).
"""
from __future__ import annotations

from dataclasses import dataclass

from memfit.core.dtypes import dtype_bytes
from memfit.core.units import MiB
from memfit.serving.served_model import ServedModel

V1_SAMPLER_BYTES = 2 + 4 + 4 + 8      # per logit: served-dtype logits, float32 copy, sorted values, int64 indices
V0_SAMPLER_BYTES = 38                 # calibrated (module docstring)
# one CUDA graph's device memory beyond the pool, per captured piece (V1 captures each size piecewise: one piece
# per layer and one more); calibrated on row v-16g-qwen7b-awq (0.48 GiB for 51 sizes of a 28-layer model)
GRAPH_PIECE_BYTES = int(0.28 * MiB)


@dataclass(frozen=True)
class ProfileShape:
    tokens: int       # max_num_batched_tokens
    requests: int     # rows the sampler runs on: min(max_num_seqs, tokens)


def forward_peak(model: ServedModel, tokens: int, tp: int, dtype: str) -> int:
    """The largest set of live activations one forward over `tokens` tokens holds on one of `tp` ranks."""
    h, width = model.hidden, dtype_bytes(dtype)
    inner = -(-model.intermediate // tp)
    dense = tokens * (3 * h + 3 * inner) * width
    attention_width = -(-model.heads // tp) * model.head_dim
    kv_width = max(1, model.kv_heads // tp) * model.head_dim
    attention = tokens * (3 * h + 2 * attention_width + 2 * kv_width) * width
    peak = max(attention, dense if _has_dense_layers(model) else 0)
    if model.experts:
        expert = -(-model.expert_intermediate // tp)
        routed = tokens * model.top_k
        moe = (tokens * 3 * h + routed * (3 * expert + h)) * width + tokens * model.experts * 4   # + float32 router
        peak = max(peak, moe)
    return peak


def _has_dense_layers(model: ServedModel) -> bool:
    return not model.experts or model.moe_layers < model.layers


def sampler_peak(model: ServedModel, shape: ProfileShape, dtype: str, v1: bool) -> int:
    """The sampler's peak on `shape.requests` rows of the full vocabulary (the head's output is gathered whole on
    each rank), with the last hidden states still alive."""
    per_logit = V1_SAMPLER_BYTES if v1 else V0_SAMPLER_BYTES
    return shape.requests * model.vocab * per_logit + shape.tokens * model.hidden * dtype_bytes(dtype)


def activation_peak(model: ServedModel, shape: ProfileShape, tp: int, dtype: str, v1: bool,
                    last_stage: bool = True) -> int:
    """The profile run's peak beyond the weights on one rank (the sampler runs on the last pipeline stage)."""
    forward = forward_peak(model, shape.tokens, tp, dtype)
    return max(forward, sampler_peak(model, shape, dtype, v1) if last_stage else 0)


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, v1: bool) -> list[int]:
    """The batch sizes CUDA graphs are captured for: 1, 2, 4, then every 8 to 248 and every 16 from 256 up to
    min(2 x max_num_seqs, 512) (V1; V0: every 8 up to max_num_seqs), none above max_num_batched_tokens."""
    if v1:
        largest = min(2 * max_num_seqs, 512)
        sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, largest + 1, 16))
    else:
        largest = min(max_num_seqs, 256)
        sizes = [1, 2, 4] + list(range(8, largest + 1, 8))
    return [s for s in sizes if s <= min(largest, max_num_batched_tokens)]


def cuda_graph_bytes(model: ServedModel, sizes: list[int], tp: int, dtype: str, v1: bool) -> int:
    """The graphs' memory: the shared pool (one decode forward at the largest size) and each captured graph's own
    (per piece: V1 captures every layer's piece separately; V0 one graph per size)."""
    if not sizes:
        return 0
    pool = forward_peak(model, max(sizes), tp, dtype)
    pieces = model.layers + 1 if v1 else 1
    return pool + len(sizes) * pieces * GRAPH_PIECE_BYTES
