"""Memory techniques: one module per family, each a frozen config registered by name (base.py) that declares
everything memfit needs to know about it; ordered and checked under the rules they declare (rules.py); a
workload's techniques resolved (resolve.py) and applied to a step or a user's own loop (compose.py).

    import memfit
    from memfit.techniques import Checkpointing
    setup = memfit.apply_(model, optimizer, [Checkpointing(every=2), "bf16-mixed", "adamw8bit"])

Importing this package registers every technique (catalog.py).
"""
from memfit.techniques import catalog  # noqa: F401  (registers every technique)
from memfit.techniques.adapters import Lora, Qlora
from memfit.techniques.allocator import ExpandableSegments, ReleaseCache
from memfit.techniques.attention import Sdpa, SlidingWindow
from memfit.techniques.base import REGISTRY, Technique, parse_technique, register
from memfit.techniques.checkpointing import Checkpointing
from memfit.techniques.compile import Compile
from memfit.techniques.distillation import Distill
from memfit.techniques.distributed import Ddp, Fsdp2, TensorParallel
from memfit.techniques.mixed_precision import Bf16Master, Bf16Mixed, Fp16Mixed, PureBf16, PureFp16
from memfit.techniques.offload import CpuOffload, NvmeOffload, ParkFrozen, StreamLayers
from memfit.techniques.optimizer_in_backward import OptimizerInBackward
from memfit.techniques.optimizer_states import Adafactor, AdamW4bit, AdamW8bit, PagedAdamW, PagedAdamW8bit
from memfit.techniques.pipeline import PipelineParallel
from memfit.techniques.pruning import PruneStructured, PruneUnstructured
from memfit.techniques.quantization import Bnb4bit, Int4WeightOnly, Int8Dynamic, Int8WeightOnly, Qat, convert_qat_
from memfit.techniques.sequence import ChunkedCrossEntropy, SequenceChunks, Truncate

__all__ = [
    "REGISTRY", "Adafactor", "AdamW4bit", "AdamW8bit", "Bf16Master", "Bf16Mixed", "Bnb4bit", "Checkpointing",
    "ChunkedCrossEntropy", "Compile", "CpuOffload", "Ddp", "Distill", "ExpandableSegments", "Fp16Mixed", "Fsdp2",
    "Int4WeightOnly", "Int8Dynamic", "Int8WeightOnly", "Lora", "NvmeOffload", "OptimizerInBackward", "PagedAdamW",
    "PagedAdamW8bit", "ParkFrozen", "PipelineParallel", "PruneStructured", "PruneUnstructured", "PureBf16", "PureFp16",
    "Qat", "Qlora", "ReleaseCache", "Sdpa", "SequenceChunks", "SlidingWindow", "StreamLayers", "Technique",
    "TensorParallel", "Truncate", "convert_qat_", "parse_technique", "register",
]
