"""Optimizer state and step memory in closed form, per torch.optim's implementations.

States (created at the first step, so present in the steady-state step):
  Adam/AdamW: exp_avg and exp_avg_sq (each the parameter's size and dtype) and a float32 `step`.
  SGD(momentum): momentum_buffer (the parameter's size).
  Adafactor: a float32 `step`; row and column second-moment factors for matrices, a full variance
  for vectors.
  AdamW8bit (bitsandbytes): per tensor of 4,096 elements or more, m and v as uint8 codes plus one
  float32 absmax per block of 256, and two 256-entry float32 quantization maps shared by all;
  smaller tensors keep float32 m and v. On CUDA one fused kernel per tensor (no temporaries); on
  CPU (bitsandbytes/backends/cpu/ops.py) m and v are dequantized to float32 and the update runs in
  float32 ops: 5 float32 copies of the tensor at once (m, v, scaled gradient, sqrt(v), denominator),
  plus a float32 copy of a half parameter, one tensor at a time.
  AdamW4bit (torchao): per tensor of 4,096 elements or more (and a multiple of 128), m and v as
  packed 4-bit codes (half a byte each), one float32 scale per block of 128 and a 16-entry float32
  map each; other tensors keep m and v in the parameter's dtype; a float32 `step`. No step
  temporaries (the compiled step fuses per tensor).
Step temporaries (torch/optim/adam.py, adamw.py, adafactor.py):
  single-tensor Adam/AdamW (CPU default): denom = exp_avg_sq.sqrt() / bias_correction2_sqrt, two
  parameter-sized tensors at once, for one parameter at a time;
  foreach Adam/AdamW (CUDA default): _foreach_sqrt of every exp_avg_sq at once, one copy of all
  parameters; SGD: in place; Adafactor: the parameter-sized var_estimate (and grad*grad for
  vectors), one parameter at a time, or all at once with foreach.
"""
from __future__ import annotations

from memfit.estimators.analytic.engine import Engine, Param, Sym

BNB_MIN_8BIT_SIZE, BNB_BLOCK, BNB_QMAP = 4096, 256, 256
AO_MIN_SIZE, AO_BLOCK, AO_QMAP = 4096, 128, 16


def _quantized_states(e: Engine, p: Param, optimizer: str) -> list[Sym]:
    new = e.new
    if optimizer == "adamw8bit":
        if p.numel < BNB_MIN_8BIT_SIZE:
            return [new(p.numel, "float32", category="optimizer_states") for _ in range(2)]
        blocks = -(-p.numel // BNB_BLOCK)
        return [new(n, dt, category="optimizer_states") for _ in range(2) for n, dt in ((p.numel, "uint8"), (blocks, "float32"))]
    states = [new(1, "float32", category="optimizer_states")]
    if p.numel >= AO_MIN_SIZE and p.numel % AO_BLOCK == 0:
        layout = ((p.numel // 2, "uint8"), (p.numel // AO_BLOCK, "float32"), (AO_QMAP, "float32"))
        return states + [new(n, dt, category="optimizer_states") for _ in range(2) for n, dt in layout]
    return states + [new(p.numel, p.dtype, category="optimizer_states") for _ in range(2)]


def create_states(e: Engine, optimizer: str) -> list[Sym]:
    states: list[Sym] = []
    if optimizer == "adamw8bit" and any(p.grad and p.numel >= BNB_MIN_8BIT_SIZE for p in e.params.values()):
        states += [e.new(BNB_QMAP, "float32", category="optimizer_states") for _ in range(2)]
    for p in e.params.values():
        if not p.grad:
            continue
        if optimizer in ("adam", "adamw"):
            states += [e.new(p.numel, p.dtype, category="optimizer_states") for _ in range(2)]
            states.append(e.new(1, "float32", category="optimizer_states"))
        elif optimizer == "sgd":
            states.append(e.new(p.numel, p.dtype, category="optimizer_states"))
        elif optimizer in ("adamw8bit", "adamw4bit"):
            states += _quantized_states(e, p, optimizer)
        elif optimizer == "adafactor":
            states.append(e.new(1, "float32", category="optimizer_states"))
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
    if optimizer == "adamw8bit" and not foreach:   # the CPU kernel (foreach marks a CUDA target)
        quantized = [p for p in params if p.numel >= BNB_MIN_8BIT_SIZE]
        if quantized:
            largest = max(quantized, key=lambda p: p.numel)
            copies = 5 + (largest.dtype != "float32")
            temps = [e.new(largest.numel, "float32") for _ in range(copies)]
            del temps
        return
    if not params or optimizer in ("sgd", "adamw8bit", "adamw4bit"):
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
