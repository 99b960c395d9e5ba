"""`memfit.plan(model, batch, gpu=...)`: a plan for a live transformers model of a Python session.

The planner sizes thousands of configurations with the analytic estimator, which models an architecture from its
transformer config; a live model brings its own (`model.config`). It is written to a config.json in the system's
temporary folder (the user's own) and planned like any config file (the plan names that file), with the batch's
size and sequence length (the first tensor's first two dimensions; for a vision model, its image side). The live
object itself is not used: the plan's runs build the architecture again from the config. A custom nn.Module
without a transformer config is refused with the ways out (plan it by its factory, traced; or `memfit.estimate`);
so is a PEFT wrapper, whose config is its base model's.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

from torch import nn

from memfit.core.errors import MemfitError
from memfit.planner.request import PlanRequest
from memfit.specs.hardware import get_gpu
from memfit.specs.live import batch_shape, describe_batch


def live_request(model: nn.Module, batch, *, gpu, **fields) -> PlanRequest:
    """The PlanRequest for `model` (with a transformers `config`) and its `batch`; `fields` are PlanRequest's."""
    config: Any = getattr(model, "config", None)   # a transformers PretrainedConfig, checked below
    if not hasattr(config, "to_dict"):
        raise MemfitError(f"memfit.plan of a live model plans its transformer config; {type(model).__name__} has none "
                          "(no `model.config`): plan the module by its factory (PlanRequest(model='package.module:"
                          "function', inputs=...), planned with the traced estimator), or try techniques on it with "
                          "memfit.estimate(model, batch, techniques=[...]).")
    if gpu is None:
        raise MemfitError("memfit.plan(model, batch, gpu=...): name the GPU to plan for (memfit gpus lists them).")
    if hasattr(model, "peft_config"):
        raise MemfitError("a PEFT-wrapped model's config is its base model's: plan model.get_base_model() (with "
                          "allow='lossy' the planner tries adapters itself).")
    description = describe_batch(batch)
    batch_size, seq_len = batch_shape(description)
    if hasattr(config, "image_size"):   # a vision model's sequence length is its image side, in pixels
        first = description if description[0] == "tensor" else None
        seq_len = first[1][-1] if first is not None else config.image_size
    if fields.get("task", "train") == "train":
        fields.setdefault("global_batch", batch_size)
    else:
        fields.setdefault("batch_size", batch_size)
    fields.setdefault("seq_len", seq_len)
    return PlanRequest(model=write_config(config.to_dict()), gpu=get_gpu(gpu) if isinstance(gpu, str) else gpu,
                       **fields)


def write_config(config: dict) -> str:
    """`config` as a config.json in the temporary folder, named by its content; its path."""
    text = json.dumps(config, indent=1, sort_keys=True, default=str)
    folder = os.path.join(tempfile.gettempdir(), f"memfit-live-configs-{os.getuid()}")   # this user's own
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, hashlib.sha1(text.encode()).hexdigest()[:16] + ".json")
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".part", delete=False) as fh:
        fh.write(text)
    os.replace(fh.name, path)   # whole or not at all, whoever else writes the same config
    return path
