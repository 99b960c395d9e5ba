"""Imports every technique module so that each registers itself."""
from memfit.techniques import (  # noqa: F401
    attention,
    checkpointing,
    distributed,
    mixed_precision,
    optimizer_states,
    sequence,
)
