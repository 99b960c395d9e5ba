"""Per-rank model states under data parallelism and ZeRO (Rajbhandari et al., 2020).

Bytes on one rank = sum over categories of weight[c] * bytes[c] / divisor, in integers, so that a
sharded timeline can be re-peaked exactly. Stage 1 shards optimizer states (and the optimizer
step's temporaries, key "optimizer_temporaries"), stage 2 also gradients, stage 3 also parameters,
each over `world_size` ranks. DDP (stages 0 and 1 with the PyTorch engine: the `ddp` technique) adds
its gradient buckets in the analytic engine itself; a trace of a distributed technique runs it for real.
"""
from __future__ import annotations

from memfit.core.categories import CATEGORIES
from memfit.techniques.resolve import ResolvedWorkload


def state_weights(workload: ResolvedWorkload, *, traced: bool = False) -> tuple[dict[str, int], int, list[str]]:
    """`traced`: a trace of a distributed technique (ddp, fsdp2, tensor-parallel) runs rank 0's real step,
    so it needs no weights."""
    n = workload.world_size
    weights = {name: n for name in CATEGORIES}
    notes: list[str] = []
    fsdp2 = workload.technique("fsdp2") is not None
    if (n == 1 or workload.task != "train" or (workload.layout and traced)
            or workload.engine == "deepspeed"):   # the analytic estimator shards DeepSpeed's states itself
        return {name: 1 for name in CATEGORIES}, 1, notes
    stage = 3 if fsdp2 else workload.zero_stage
    ddp = workload.technique("ddp") is not None   # the engine adds DDP's buckets itself
    if (ddp and stage == 0) or workload.technique("tensor-parallel") or workload.technique("pipeline-parallel"):
        # the engine runs one rank's part
        return {name: 1 for name in CATEGORIES}, 1, notes
    if stage >= 1:
        weights["optimizer_states"] = 1
        weights["optimizer_temporaries"] = 1   # the step runs on this rank's shard
    if stage >= 2:
        weights["gradients"] = 1
    if fsdp2 and workload.technique("cpu-offload"):   # the shards, their gradients and the step live on the host
        for name in ("parameters", "gradients", "optimizer_states", "optimizer_temporaries"):
            weights[name] = 0
        return weights, n, notes
    if stage >= 3:
        weights["parameters"] = 1
        notes.append("ZeRO-3/FSDP all-gather buffers of the layer being computed are not included (analytic); "
                     "--method traced runs FSDP2 itself")
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
