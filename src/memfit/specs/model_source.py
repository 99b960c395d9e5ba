"""Where a model comes from, how to build it (meta, fake or real) and how to feed it.

The sources: a bundled catalog name (or its Hugging Face hub id), another hub id (its config.json fetched, hub.py), a
Hugging Face `config.json` (or a folder holding one), a `package.module:function` or `path/file.py:function` factory
that returns an `nn.Module` (then an inputs factory is needed; user_code.py), or a live model of this Python session
(live.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, cast

import torch
from torch import nn

from memfit.core.errors import MemfitError, closest
from memfit.specs.blocks import alike_lists
from memfit.specs.live import batch_like, is_live, lookup, meta_copy
from memfit.specs.model_configs import catalog, find_config
from memfit.specs.model_shape import ModelShape
from memfit.specs.user_code import cache_key, call_user, import_callable

# The head a Hugging Face class carries decides the inputs and the loss.
HEADS = ("causal-lm", "masked-lm", "seq2seq-lm", "image-classification", "base")
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def _head_of(class_name: str, config: Any) -> str:
    if class_name.endswith("ForCausalLM") or class_name.endswith("LMHeadModel"):
        return "causal-lm"
    if class_name.endswith("ForMaskedLM"):
        return "masked-lm"
    if class_name.endswith("ForConditionalGeneration") and getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    if class_name.endswith("ForImageClassification"):
        return "image-classification"
    return "base"


# transformers' attn_implementation values memfit models beyond eager -> the class attribute that says a model
# class has it
ATTENTION_SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                           "flex_attention": "_supports_flex_attn"}
# Fused kernels outside SDPA, modelled as SDPA's flash kernel: FlashAttention-2 and flex attention keep the same
# tensors for backward (q, k, v, the output and a float32 logsumexp). memfit builds such a model with SDPA and, on a
# GPU target, runs it as flash (a CPU runs its own flash kernel, `_scaled_dot_product_flash_attention_for_cpu`,
# which keeps the same tensors).
FUSED_OUTSIDE_SDPA = ("flash_attention_2", "flex_attention")

@dataclass(frozen=True)
class ModelSource:
    """A resolved model source. `hf_config` is a plain dict (model_type + fields) for HF sources."""

    name: str
    kind: str                                   # "catalog" | "hf-config" | "factory" | "live"
    hf_config: dict | None = None
    factory: str | None = None
    inputs_factory: str | None = None
    reference: str | None = None
    published_num_parameters: int | None = None
    overrides: dict = field(default_factory=dict)   # config fields changed by memfit (e.g. longer positions)
    note: str | None = None                     # what memfit took the model the user named to be

    # ---- what kind of model -------------------------------------------------------------
    @property
    def is_hf(self) -> bool:
        return self.hf_config is not None

    @property
    def _hf_config(self) -> dict:
        """`hf_config`, read where only a Hugging Face source gets (is_hf)."""
        assert self.hf_config is not None
        return self.hf_config

    @property
    def model_type(self) -> str:
        return self._hf_config["model_type"] if self.is_hf else "custom"

    def config(self, num_layers: int | None = None):
        """The transformers config object, optionally with fewer layers (for extrapolation)."""
        from transformers import AutoConfig

        fields = {k: v for k, v in self._hf_config.items() if k not in ("model_type", "architectures")}
        fields.update(self.overrides)
        if fields.get("attn_implementation") in FUSED_OUTSIDE_SDPA:
            fields["attn_implementation"] = "sdpa"
        if num_layers is not None:
            key = _layer_key(self._hf_config)
            depth = fields.get(key) if key else None
            fields[key] = num_layers
            if "num_decoder_layers" in fields:
                fields["num_decoder_layers"] = num_layers
            fields.pop("layer_types", None)   # transformers fills it in again for the depth
            for name, value in list(fields.items()):   # every other per-layer list (Longformer's attention_window)
                if isinstance(value, list) and depth and len(value) == depth:
                    fields[name] = value[:num_layers]
        try:
            config = AutoConfig.for_model(self.model_type, **fields)
        except (ValueError, KeyError, TypeError) as exc:
            raise MemfitError(f"model config {self.name!r} is not a valid {self.model_type!r} config: {exc}") from None
        config.use_cache = False
        return config

    @property
    def config_fields(self) -> dict:
        """The Hugging Face config's fields as the model is built: the techniques' overrides applied (the one place
        they are); {} for a custom module."""
        return {**self._hf_config, **self.overrides} if self.is_hf else {}

    @cached_property
    def shape(self) -> ModelShape:
        """The model's shape (heads, widths, layers, experts, windows, causality), read from its config once."""
        return ModelShape.from_config(self.config(), causal=self.head == "causal-lm")

    @property
    def eager_attention(self) -> bool:
        """The model as built runs transformers' eager attention (its config asks for it), not SDPA."""
        return self.config_fields.get("attn_implementation") == "eager"

    @property
    def attention_kernel(self) -> str | None:
        """"flash" when the config asks for FlashAttention-2 or flex attention (run as SDPA's flash kernel on a GPU),
        else None: SDPA's kernel is PyTorch's own choice."""
        return "flash" if self.config_fields.get("attn_implementation") in FUSED_OUTSIDE_SDPA else None

    def check_attention(self) -> None:
        """The config's `attn_implementation` is one memfit models and its transformers class has."""
        wanted = self._hf_config.get("attn_implementation")
        if wanted in (None, "eager"):
            return
        flag = ATTENTION_SUPPORT_FLAGS.get(wanted)
        if flag is None:
            modelled = ", ".join(["eager", *ATTENTION_SUPPORT_FLAGS])
            raise MemfitError(f"{self.name!r} asks for attn_implementation {wanted!r}; memfit models {modelled} "
                              "attention (set one of them in its config.json).")
        import transformers

        cls = getattr(transformers, self.hf_class_name, None)
        if cls is not None and not getattr(cls, flag, True):
            raise MemfitError(f"{self.name!r} asks for attn_implementation {wanted!r}, which {cls.__name__} does not "
                              f"support in transformers {transformers.__version__}; use 'eager'.")

    @property
    def hf_class_name(self) -> str:
        archs = self._hf_config.get("architectures") or []
        if archs:
            return archs[0]
        return _default_class_name(self.config())

    @property
    def head(self) -> str:
        if not self.is_hf:
            return "base"
        name = self.hf_class_name   # the config object (milliseconds to build) only where the name is ambiguous
        return _head_of(name, self.config() if name.endswith("ForConditionalGeneration") else None)

    @property
    def num_layers(self) -> int | None:
        if self.kind == "live":   # a custom module: its repeated blocks (block_stacks), counted on a meta build
            return block_stacks(_build_custom(self.kind, self.factory, "meta", torch.float32))[0] or None
        if not self.is_hf:
            return _custom_depth(cache_key(self.factory))
        key = _layer_key(self._hf_config)
        return self._hf_config.get(key) if key else None

    @property
    def layer_period(self) -> int:
        """Layers repeat with this period (2 for models alternating local and global attention)."""
        if not self.is_hf:
            return 1
        types = getattr(self.config(), "layer_types", None)
        if not types:
            return 1
        for period in range(1, len(types) + 1):
            if all(types[i] == types[i % period] for i in range(len(types))):
                return period
        return len(types)

    @property
    def max_seq_len(self) -> int | None:
        if not self.is_hf:
            return None
        if self.head == "image-classification" or self.model_type == "t5":
            return None   # images are sized in pixels; T5's relative positions have no hard limit
        cfg = self._hf_config
        for key in ("max_position_embeddings", "n_positions"):
            if cfg.get(key):
                return int(cfg[key])
        return None

    @property
    def image_size(self) -> int | None:
        return self._hf_config.get("image_size") if self.is_hf else None

    # ---- building -----------------------------------------------------------------------
    def build(self, *, device: str | torch.device, dtype: torch.dtype, num_layers: int | None = None) -> nn.Module:
        """Build the model on `device` ('meta' costs nothing) with parameters in `dtype`."""
        if self.is_hf:
            import transformers

            cls = getattr(transformers, self.hf_class_name, None)
            if cls is None:
                raise MemfitError(f"transformers has no class {self.hf_class_name!r} (from {self.name!r}).")
            config = self.config(num_layers)
            with torch.device(device):
                model = cls._from_config(config, dtype=dtype)
            return model
        model = _build_custom(self.kind, self.factory, device, dtype)
        if num_layers is not None:   # the first blocks only: the estimators extrapolate in depth from a few
            for stack in block_stacks(model)[1]:
                del stack[num_layers:]
        return model

    # ---- inputs -------------------------------------------------------------------------
    def make_batch(self, *, batch_size: int, seq_len: int, task: str, dtype: torch.dtype,
                   device: str | torch.device = "cpu") -> dict[str, Any] | tuple | torch.Tensor:
        """Model inputs for one step: keyword tensors for HF models, the user's inputs otherwise."""
        if self.kind == "live":
            with torch.device(device):
                return batch_like(lookup(self.inputs_factory))
        if not self.is_hf:
            fn = import_callable(self.inputs_factory, "inputs factory")
            with torch.device(device):
                batch = call_user(fn, self.inputs_factory, "inputs factory", batch_size, seq_len)
            if isinstance(batch, torch.Tensor):
                return batch
            if isinstance(batch, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in batch):
                return tuple(batch)
            if isinstance(batch, dict) and all(isinstance(k, str) for k in batch):
                return dict(batch)
            raise MemfitError(
                f"inputs factory {self.inputs_factory!r} must return a tensor, a tuple of tensors or a dict of "
                f"keyword tensors; it returned {type(batch).__name__}."
            )
        gen: dict[str, Any] = dict(device=device)
        head = self.head
        if head == "image-classification":
            size = seq_len
            channels = self._hf_config.get("num_channels", 3)
            batch = {"pixel_values": torch.randn(batch_size, channels, size, size, dtype=dtype, **gen)}
            if size != self.image_size:
                batch["interpolate_pos_encoding"] = True
            if task == "train":
                batch["labels"] = torch.randint(0, self.config().num_labels, (batch_size,), **gen)
            return batch
        vocab = self._hf_config["vocab_size"]
        ids = torch.randint(0, vocab, (batch_size, seq_len), **gen)
        batch = {"input_ids": ids}
        if task == "train" and head in ("causal-lm", "masked-lm", "seq2seq-lm"):
            batch["labels"] = ids.clone()
        return batch


def _build_custom(kind: str, factory: str | None, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    if kind == "live":   # a meta copy of the user's object: nothing model-sized, the object untouched
        model = meta_copy(lookup(factory))
        return model.to(dtype=dtype) if dtype != torch.float32 else model
    fn = import_callable(factory, "model factory")
    with torch.device(device):
        model = call_user(fn, factory, "model factory")
    if not isinstance(model, nn.Module):
        raise MemfitError(f"model factory {factory!r} returned {type(model).__name__}, not a torch.nn.Module.")
    return model.to(device=device, dtype=dtype) if dtype != torch.float32 else model.to(device)


def block_stacks(model: nn.Module) -> tuple[int, list[nn.ModuleList]]:
    """A custom module's repeated blocks: the outermost nn.ModuleLists of alike blocks (`_signature`), at least two
    long, of the longest length L — (L, every such list, so that parallel lists such as `self.attn[i]`,
    `self.mlp[i]` are cut together); (0, []) when there are none. Lists inside a block (experts, heads) are not
    counted."""
    lists = alike_lists(model, key=_signature)
    if not lists:
        return 0, []
    depth = max(len(stack) for stack in lists)
    return depth, [stack for stack in lists if len(stack) == depth]


def _signature(block: nn.Module) -> tuple:
    """What makes two blocks alike: their type and every parameter's and buffer's name, shape and dtype (stages of
    growing width are not repeats)."""
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return type(block), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors)


@lru_cache(maxsize=64)
def _custom_depth(factory: str) -> int | None:
    return block_stacks(_build_custom("factory", factory, "meta", torch.float32))[0] or None


def _layer_key(hf_config: dict) -> str | None:
    for key in _LAYER_COUNT_KEYS:
        if key in hf_config:
            return key
    return None


def _default_class_name(config) -> str:
    import transformers
    from transformers.models.auto import modeling_auto as auto

    for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                    auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
                    auto.MODEL_MAPPING_NAMES):
        # a class name, or a tuple of class names (the first is the one used)
        name = cast("str | tuple[str, ...] | None", mapping.get(config.model_type))
        if isinstance(name, (tuple, list)):
            name = name[0]
        if name and hasattr(transformers, name):
            return name
    raise MemfitError(f"no transformers model class is known for model_type {config.model_type!r}.")


def resolve_source(spec: str, inputs: str | None = None) -> ModelSource:
    """Turn what the user typed into a ModelSource, or raise a one-line MemfitError."""
    spec = spec.strip()
    found = find_config(spec)
    if found is not None and found.kind == "catalog":
        doc = found.doc
        return ModelSource(name=found.name, kind="catalog", hf_config=found.hf_config, reference=doc.get("reference"),
                           published_num_parameters=doc.get("published_num_parameters"), note=found.note)
    if found is not None:
        source = ModelSource(name=found.name, kind="hf-config", hf_config=found.hf_config)
        source.config()  # validate now, not mid-run
        source.check_attention()
        return source
    if is_live(spec):
        lookup(spec)
        return ModelSource(name=spec, kind="live", factory=spec, inputs_factory=inputs)
    if ":" in spec:
        if not inputs:
            raise MemfitError(
                f"memfit cannot guess the inputs of custom module {spec!r}; pass --inputs package.module:function "
                "(or path/file.py:function) returning the batch for (batch_size, seq_len)."
            )
        import_callable(spec, "model factory")
        import_callable(inputs, "inputs factory")
        return ModelSource(name=spec, kind="factory", factory=spec, inputs_factory=inputs)
    raise MemfitError(f"unknown model {spec!r}; `memfit models` lists the catalog.{closest(spec, catalog())}")
