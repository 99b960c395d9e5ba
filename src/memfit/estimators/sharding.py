"""Per-rank model states under data parallelism and ZeRO (Rajbhandari et al., 2020).

Bytes on one rank = sum over categories of weight[c] * bytes[c] / divisor, in integers, so that a
sharded timeline can be re-peaked exactly. Stage 1 shards optimizer states (and the optimizer
step's temporaries, key "optimizer_temporaries"), stage 2 also gradients, stage 3 also parameters,
each over the data-parallel ranks (`world_size`, or on a 2-D mesh the groups a split layout leaves); a layout
that shards like ZeRO-3 declares it (`zero_stage`). Data parallel (stages 0 and 1 with the PyTorch engine) adds
its gradient buckets in the analytic engine itself; a trace of a layout over ranks runs it for real.
"""
from __future__ import annotations

from memfit.core.categories import CATEGORIES
from memfit.techniques.resolve import ResolvedWorkload


def effective_zero_stage(workload: ResolvedWorkload) -> int:
    """The ZeRO stage the model states are sharded at: the layout's own (a layout that shards like ZeRO-3), else
    --zero."""
    layout = workload.layout
    return layout.zero_stage if layout is not None and layout.zero_stage is not None else workload.zero_stage


def ranks_to_estimate(workload: ResolvedWorkload, method: str) -> tuple[list[int], str | None]:
    """The ranks whose steps differ (a technique says which, and why they bound the rest), else rank 0 alone."""
    for technique in workload.technique_configs:
        declared = technique.analytic_ranks(workload.world_size, method)
        if declared is not None:
            return declared
    return [0], None


def state_weights(workload: ResolvedWorkload, *, traced: bool = False) -> tuple[dict[str, int], int, list[str]]:
    """`traced`: a trace of a layout over ranks (ddp, fsdp2, tensor-parallel) runs rank 0's real step, so it
    needs no weights."""
    n = workload.data_parallel_size   # on a 2-D mesh the states shard over the data-parallel axis only
    weights = {name: n for name in CATEGORIES}
    notes: list[str] = []
    ones = {name: 1 for name in CATEGORIES}
    if (workload.world_size == 1 or workload.task != "train" or (workload.layout and traced)
            or workload.engine == "deepspeed"):   # the analytic estimator shards DeepSpeed's states itself
        return ones, 1, notes
    stage = effective_zero_stage(workload)
    if stage == 0:   # a replica (DDP: the engine adds its buckets) or a split layout: the engine runs one rank's part
        return ones, 1, notes
    weights["optimizer_states"] = 1
    weights["optimizer_temporaries"] = 1   # the step runs on this rank's shard
    if stage >= 2:
        weights["gradients"] = 1
    if workload.with_trait("host-optimizer") and workload.with_trait("offloads-shards"):
        # the shards, their gradients and the step live on the host
        for name in ("parameters", "gradients", "optimizer_states", "optimizer_temporaries"):
            weights[name] = 0
        return weights, n, notes
    if stage >= 3:
        weights["parameters"] = 1
        if workload.layout is None:   # --zero 3 alone; a sharding layout's gathers are the engine's own (blocks.py)
            notes.append("ZeRO-3 all-gather buffers of the layer being computed are not included (analytic); "
                         "a sharding layout (FSDP2) gathers each block in the estimate")
    return weights, n, notes


def per_rank(vector: dict[str, int], divisor: int) -> dict[str, int]:
    """A weighted vector (see state_weights) back to bytes on one rank."""
    return {name: -(-vector[name] // divisor) for name in vector}


def zero_paper_table(num_parameters: int, world_size: int, k: int = 12) -> list[dict]:
    """Model states per device for ZeRO stages 0-3 with the paper's accounting: 2-byte parameters and
    gradients, K bytes of optimizer state per parameter (fp32 master weights + Adam m and v)."""
    psi, nd = num_parameters, world_size
    stages = [(2 * psi, 2 * psi, k * psi), (2 * psi, 2 * psi, k * psi / nd),
              (2 * psi, 2 * psi / nd, k * psi / nd), (2 * psi / nd, 2 * psi / nd, k * psi / nd)]
    return [{"stage": stage, "parameters": int(p), "gradients": int(g), "optimizer_states": int(o),
             "total": int(p + g + o)} for stage, (p, g, o) in enumerate(stages)]
