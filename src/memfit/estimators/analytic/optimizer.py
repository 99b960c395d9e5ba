"""Optimizer state and step memory in closed form, per torch.optim's implementations.

States (created at the first step, so present in the steady-state step):
  Adam/AdamW: exp_avg and exp_avg_sq (each the parameter's size and dtype) and a float32 `step`.
  SGD(momentum): momentum_buffer (the parameter's size).
  Adafactor: a float32 `step`; row and column second-moment factors for matrices, a full variance
  for vectors.
Step temporaries (torch/optim/adam.py, adamw.py, adafactor.py):
  single-tensor Adam/AdamW (CPU default): denom = exp_avg_sq.sqrt() / bias_correction2_sqrt, two
  parameter-sized tensors at once, for one parameter at a time;
  foreach Adam/AdamW (CUDA default): _foreach_sqrt of every exp_avg_sq at once, one copy of all
  parameters; SGD: in place; Adafactor: the parameter-sized var_estimate (and grad*grad for
  vectors), one parameter at a time, or all at once with foreach.
"""
from __future__ import annotations

from memfit.estimators.analytic.engine import Engine, Param, Sym


def create_states(e: Engine, optimizer: str) -> list[Sym]:
    states: list[Sym] = []
    for p in e.params.values():
        if not p.grad:
            continue
        if optimizer in ("adam", "adamw"):
            states += [e.new(p.numel, p.dtype, category="optimizer_states") for _ in range(2)]
            states.append(e.new(1, "f32", category="optimizer_states"))
        elif optimizer == "sgd":
            states.append(e.new(p.numel, p.dtype, category="optimizer_states"))
        elif optimizer == "adafactor":
            states.append(e.new(1, "f32", category="optimizer_states"))
            for numel in _adafactor_factors(p):
                states.append(e.new(numel, p.dtype, category="optimizer_states"))
    return states


class _Shard:
    def __init__(self, p: Param, shards: int) -> None:
        self.numel, self.dtype, self.shape = -(-p.numel // shards), p.dtype, p.shape
        self.nbytes = p.nbytes // shards


def _adafactor_factors(p: Param) -> list[int]:
    shape = p.shape
    if len(shape) < 2:
        return [p.numel]
    rows = p.numel // shape[-1]
    cols = p.numel // shape[-2]
    return [rows, cols]


def step_temporaries(e: Engine, optimizer: str, foreach: bool, shards: int = 1) -> None:
    """Allocate (and free) the step's temporaries at their peak; with ZeRO the step sees 1/shards of
    every parameter. Temporaries carry the unsharded weight (sharding.py), so a shard's temporaries
    are allocated at 1/shards of the size."""
    params = [_Shard(p, shards) for p in e.params.values() if p.grad]
    if not params or optimizer == "sgd":
        return
    if optimizer in ("adam", "adamw"):
        if foreach:
            temps = [e.new(p.numel, p.dtype) for p in params]
        else:
            largest = max(params, key=lambda p: p.nbytes)
            temps = [e.new(largest.numel, largest.dtype), e.new(largest.numel, largest.dtype)]
        del temps
        return
    # adafactor
    if foreach:
        temps = [e.new(p.numel, p.dtype) for p in params]
    else:
        largest = max(params, key=lambda p: p.nbytes * (2 if len(p.shape) < 2 else 1))
        temps = [e.new(largest.numel, largest.dtype) for _ in range(2 if len(largest.shape) < 2 else 1)]
    del temps
