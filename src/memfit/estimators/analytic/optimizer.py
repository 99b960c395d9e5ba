"""Optimizer state and step memory in closed form, per torch.optim's implementations.

States (created at the first step, so present in the steady-state step):
  Adam/AdamW: exp_avg and exp_avg_sq (each the parameter's size and dtype) and a float32 `step`.
  SGD(momentum): momentum_buffer (the parameter's size).
Step temporaries (torch/optim/adam.py, adamw.py):
  single-tensor Adam/AdamW (CPU default): denom = exp_avg_sq.sqrt() / bias_correction2_sqrt, two
  parameter-sized tensors at once, for one parameter at a time;
  foreach Adam/AdamW (CUDA default): _foreach_sqrt of every exp_avg_sq at once, one copy of all
  parameters; fused Adam/AdamW (`_fused_adamw_`, CUDA and CPU kernels): in place, none; SGD: in place.
An optimizer that is a technique (8-bit and 4-bit AdamW, Adafactor) declares its own layout and step
(`analytic_states`, `analytic_step_temporaries` in its module).
"""
from __future__ import annotations

from collections import Counter

from memfit.core.dtypes import BYTES
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.symbols import Param, Sym
from memfit.techniques import REGISTRY
from memfit.techniques.resolve import ResolvedWorkload


def _trainable(e: Engine) -> list[Param]:
    return [p for p in e.params.values() if p.grad]


def create_states(e: Engine, workload: ResolvedWorkload) -> list[Sym]:
    """The optimizer's states for the trainable parameters, kept through the step."""
    params = [Shard(p, 1, e.policy.master_dtype) for p in _trainable(e)]
    optimizer = workload.optimizer
    if optimizer in REGISTRY:
        technique = REGISTRY[optimizer]()
        layout = technique.analytic_states(params)
        if e.policy.backend == "cuda":   # unified memory, outside the allocator; a CPU has none (ordinary tensors)
            paged = Counter(technique.analytic_paged_states(params))
            e.paged_bytes += sum(numel * BYTES[dtype] * count for (numel, dtype), count in paged.items())
            layout = [state for state in layout if not _take(paged, state)]
    elif optimizer in ("adam", "adamw"):
        layout = [(n, dt) for p in params for n, dt in ((p.numel, p.dtype), (p.numel, p.dtype), (1, "float32"))]
    else:   # sgd: the momentum buffer
        layout = [(p.numel, p.dtype) for p in params]
    return [e.new(numel, dtype, category="optimizer_states") for numel, dtype in layout]


def _take(counts: Counter, item) -> bool:
    """Take one `item` from `counts` if any is left."""
    if counts[item]:
        counts[item] -= 1
        return True
    return False


class Shard:
    """A parameter's share on one rank, in its stored dtype or its master copy's: what a (sharded) optimizer sees
    of it."""

    def __init__(self, p: Param, shards: int, master_dtype: str | None = None) -> None:
        self.numel, self.dtype, self.shape = -(-p.numel // shards), master_dtype or p.state_dtype, p.shape
        self.nbytes = p.nbytes // shards if master_dtype is None else self.numel * BYTES[master_dtype]


def step_temporaries(e: Engine, workload: ResolvedWorkload, impl: str, shards: int = 1) -> None:
    """Allocate (and free) the step's temporaries at their peak, run by `impl` (foreach, fused or for-loop);
    with ZeRO the step sees 1/shards of every parameter. Temporaries carry the unsharded weight
    (sharding.py), so a shard's temporaries are allocated at 1/shards of the size."""
    _temporaries(e, workload, [Shard(p, shards, e.policy.master_dtype) for p in _trainable(e)], impl)


def step_in_backward(e: Engine, workload: ResolvedWorkload, impl: str) -> None:
    """An optimizer per parameter, stepped as each gradient is complete: that parameter's step temporaries, then
    its gradient goes (the policy's grads_leave)."""
    e.gradient_ready = lambda param: _temporaries(e, workload, [Shard(param, 1)], impl)


def _temporaries(e: Engine, workload: ResolvedWorkload, params: list[Shard], impl: str) -> None:
    optimizer = workload.optimizer
    if optimizer in REGISTRY:
        layout = REGISTRY[optimizer]().analytic_step_temporaries(params, impl)
    elif optimizer in ("adam", "adamw") and params and impl != "fused":
        if impl == "foreach":
            layout = [(p.numel, p.dtype) for p in params]
        else:
            largest = max(params, key=lambda p: p.nbytes)
            layout = [(largest.numel, largest.dtype)] * 2
    else:   # sgd and fused Adam/AdamW step in place
        layout = []
    temps = [e.new(numel, dtype) for numel, dtype in layout]
    del temps
