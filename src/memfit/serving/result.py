"""A serving estimate: what an engine sets aside on each GPU and whether it starts, every figure with its source
label (analytic, modelled, calibrated, assumed, given); and the accounting the engines share."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memfit.core.dtypes import dtype_bytes
from memfit.core.units import GiB
from memfit.serving.served_model import ServedModel

if TYPE_CHECKING:
    from memfit.serving.speed import ServingSpeed

# NCCL's and the custom all-reduce's buffers per GPU at tensor parallel > 1; calibrated on v-l40s-qwen3-235b (0.21
# GiB at TP 4, less the single-GPU figure)
COLLECTIVES_BYTES = int(0.11 * GiB)


# the benchmark client's figures a load adds (speed.py defines them as vLLM's benchmark does)
SPEED_KEYS = ("request_throughput", "output_tokens_per_s", "total_tokens_per_s", "mean_ttft_ms", "mean_tpot_ms",
              "mean_itl_ms", "mean_e2el_ms")
# the figures each engine derives from the others by its own arithmetic (their sources are the inputs')
DERIVED = ("budget_bytes", "kv_blocks", "kv_cache_tokens", "max_concurrency", "max_model_len_fits", "starts")


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
    page_bytes: int                 # one block of one layer on one GPU (vLLM's page_size_bytes)
    kv_bytes_per_token: int
    graphs_in_budget: bool
    sources: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    speed: ServingSpeed | None = None     # with a load: how fast it serves it (speed.py)

    def __post_init__(self) -> None:
        for key in DERIVED:
            self.sources.setdefault(key, "rule (the engine's own arithmetic on the figures above)")
        for key in ("activation_bytes", "cuda_graph_bytes", "non_torch_bytes"):
            self.sources.setdefault(key, "modelled")

    def to_json(self) -> dict:
        """The estimate; with a load, the benchmark's figures beside it (SPEED_KEYS) and the run under "speed"."""
        out = {"schema": "memfit.serve/1",
               **{f.name: dataclasses.asdict(self)[f.name] for f in dataclasses.fields(self) if f.name != "speed"}}
        if self.speed is not None:
            run = self.speed.to_json()
            out.update({key: run[key] for key in SPEED_KEYS})
            out["speed"] = run
            out["sources"] = {**self.sources, **self.speed.sources}
        return out


def rotary_cache_bytes(model: ServedModel, dtype: str) -> int:
    """vLLM's rotary embedding keeps a cos/sin cache of max_position x rotary_dim in the served dtype, shared by
    every layer with the same rope."""
    return model.max_positions * model.rotary_dim * dtype_bytes(dtype) * model.ropes
