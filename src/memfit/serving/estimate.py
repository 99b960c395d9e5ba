"""What a serving engine sets aside on each GPU at start-up, and whether it starts: `estimate_serving`, one module per
engine (vllm.py, sglang.py, tgi.py) behind the checks every engine makes before it loads anything."""
from __future__ import annotations

from memfit.core.errors import MemfitError
from memfit.serving import sglang, tgi, vllm
from memfit.serving.checkpoints import checkpoint_of
from memfit.serving.load import Load
from memfit.serving.result import ServingEstimate
from memfit.serving.served_model import ServedModel
from memfit.serving.settings import ServeSettings
from memfit.serving.speed import serving_speed
from memfit.specs.hardware import GPU

__all__ = ["ServingEstimate", "estimate_serving", "served_dtype"]
ENGINE_MODULES = {"vllm": vllm, "sglang": sglang, "tgi": tgi}


def estimate_serving(model: ServedModel, gpu: GPU, settings: ServeSettings,
                     load: Load | None = None) -> ServingEstimate:
    """The engine's start-up on `gpu` (each of tensor x pipeline parallel GPUs of one replica; data-parallel replicas
    are alike), or a one-line MemfitError for a setting the engine rejects before loading; with a `load`, how fast
    one replica serves it (speed.py)."""
    _check_parallel(model, settings)
    if settings.speculative_config:
        raise MemfitError("speculative decoding (--speculative-config) is not modelled: its draft (an EAGLE layer, "
                          "an MTP head or a whole draft model) adds weights and KV cache the engine sizes with the "
                          "target, and its speed depends on how many draft tokens are accepted; estimate without it.")
    dtype = served_dtype(model, settings, gpu)
    checkpoint = checkpoint_of(model, settings.quantization, gpu.compute_capability)
    estimate = ENGINE_MODULES[settings.engine].estimate(model, gpu, settings, dtype, checkpoint)
    if model.note:
        estimate.notes.insert(0, model.note)
    if load is not None:
        estimate.speed = serving_speed(model, gpu, settings, dtype, checkpoint, estimate, load)
    return estimate


def served_dtype(model: ServedModel, settings: ServeSettings, gpu: GPU) -> str:
    """--dtype auto: the checkpoint's dtype; float32 checkpoints are served in bfloat16, and bfloat16 becomes
    float16 on GPUs without it (compute capability < 8.0), as the engines do."""
    dtype = {"half": "float16"}.get(settings.dtype, settings.dtype)
    if dtype == "auto":
        dtype = "bfloat16" if model.dtype == "float32" else model.dtype
    if dtype == "bfloat16" and tuple(gpu.compute_capability) < (8, 0):
        dtype = "float16"
    return dtype


def _check_parallel(model: ServedModel, settings: ServeSettings) -> None:
    tp, pp = settings.tensor_parallel, settings.pipeline_parallel
    if model.heads % tp:
        raise MemfitError(f"Total number of attention heads ({model.heads}) must be divisible by tensor parallel "
                          f"size ({tp}): --tensor-parallel must divide {model.heads}.")
    if pp > model.layers:
        raise MemfitError(f"--pipeline-parallel {pp} is more stages than the model's {model.layers} layers.")
    limit = model.max_positions
    if settings.max_model_len is not None and settings.max_model_len > limit and not settings.allow_long_max_model_len:
        raise MemfitError(f"User-specified max_model_len ({settings.max_model_len}) is greater than the derived "
                          f"max_model_len (max_position_embeddings={limit} in the model's config): the engine "
                          "refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (positions beyond the model's are "
                          f"untrained); give --max-model-len <= {limit}, or --allow-long-max-model-len.")
