"""Imports every technique module so that each registers itself."""
from memfit.techniques import (  # noqa: F401
    adapters,
    allocator,
    attention,
    checkpointing,
    compile,
    distillation,
    distributed,
    mixed_precision,
    offload,
    optimizer_in_backward,
    optimizer_states,
    pipeline,
    pruning,
    quantization,
    sequence,
)
