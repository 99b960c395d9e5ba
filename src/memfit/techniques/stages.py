"""The canonical order techniques apply in, one stage each, with the reason it comes where it does: every
technique declares its stage (checked when it registers, base.py), and rules.py orders a workload's techniques by it.
"""
from __future__ import annotations

# The canonical order (torchtitan's: quantize -> LoRA -> checkpoint -> compile -> shard), one step
# per stage, each with the reason it comes where it does.
ORDER: tuple[tuple[str, str], ...] = (
    ("memory", "allocator settings come before the first device allocation they should govern"),
    ("precision", "weights take their final dtype first: every later step wraps or copies the real weights"),
    ("sequence", "the batch's shape is fixed before anything is sized from it"),
    ("loss", "the loss head is replaced before blocks are wrapped, so checkpointing wraps the model's own blocks"),
    ("student", "the model to train is settled first: distill swaps in a student, which every step below changes"),
    ("prune", "heads and channels are removed before the rest is quantized (pruning scores full-precision weights)"),
    ("quantize", "weights are quantized before adapters sit beside them (QLoRA trains adapters on a quantized "
                 "base)"),
    ("adapters", "adapters go into the final layers before blocks are wrapped, so checkpointing recomputes "
                 "them with their block (torchtitan's order: quantize, LoRA, checkpoint, shard)"),
    ("compile", "each block's own forward is compiled once the model is final, and an activation checkpoint then "
                "wraps the compiled block (its recompute re-runs the compiled graph)"),
    ("activations", "what backward keeps of the activations is settled once the model is final: blocks are wrapped "
                    "for checkpointing before they are sharded (torchtitan's order)"),
    ("offload", "what lives in host RAM is settled before sharding: FSDP2 takes its CPU offload policy when it "
                "shards the blocks"),
    ("split", "tensor parallel splits each block's linears, and pipeline parallel cuts the model into stages, before "
              "they are sharded: on a 2-D mesh FSDP2 then shards what each rank holds over the data-parallel axis "
              "(torchtitan's order: PP and TP, then FSDP)"),
    ("shard", "blocks are sharded (or the model replicated) after checkpointing wraps them, so each block's "
              "all-gather surrounds its recompute too"),
    ("optimizer", "the optimizer is built last, over the parameters as the steps above left them"),
)
STAGES = tuple(stage for stage, _ in ORDER)
