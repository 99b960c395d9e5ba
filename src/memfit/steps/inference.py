"""Inference: a prefill of the prompt, then greedy decode steps with the model's KV cache.

Decoders: prefill over `seq_len` tokens (logits of the last position only, as `generate` does),
then `new_tokens` one-token forwards reusing the cache. Encoder-decoders: the encoder over
`seq_len` tokens and the first decoder token, then `new_tokens` decoder steps. Encoders, vision
models and custom modules: one forward.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from memfit.steps.hooks import NullHooks, StepHooks, tensors_in
from memfit.steps.train import call_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def run_inference(model: nn.Module, batch: dict | tuple, *, head: str, new_tokens: int,
                  hooks: StepHooks | None = None, autocast=None) -> None:
    """`autocast`: a context manager for mixed precision (None: run in the weights' dtype)."""
    hooks = hooks or NullHooks()
    with torch.no_grad(), (autocast or contextlib.nullcontext()):
        if head == "causal-lm":
            _decoder(model, cast(dict, batch), new_tokens, hooks)   # a language model's batch: keyword arguments
        elif head == "seq2seq-lm":
            _encoder_decoder(cast("PreTrainedModel", model), cast(dict, batch), new_tokens, hooks)
        else:
            hooks.phase("forward")
            call_model(model, batch)


def _decoder(model: nn.Module, batch: dict, new_tokens: int, hooks: StepHooks) -> None:
    hooks.phase("prefill")
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(**batch, use_cache=True, **extra)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    del out
    hooks.mark("kv_cache", tensors_in(cache))
    for _ in range(new_tokens):
        hooks.phase("decode")
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        del out
        hooks.mark("kv_cache", tensors_in(cache))


def _encoder_decoder(model: PreTrainedModel, batch: dict, new_tokens: int, hooks: StepHooks) -> None:
    hooks.phase("prefill")
    encoder_outputs = model.get_encoder()(input_ids=batch["input_ids"])
    start = model.config.decoder_start_token_id or 0
    token = torch.full((batch["input_ids"].shape[0], 1), start, dtype=torch.long, device=batch["input_ids"].device)
    cache = None
    for step in range(new_tokens + 1):
        if step:
            hooks.phase("decode")
        out = model(encoder_outputs=encoder_outputs, decoder_input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        del out
        hooks.mark("kv_cache", tensors_in(cache))
