"""A GGUF model as llama.cpp loads it: every tensor's ggml type and shape, and the hyperparameters its buffers
depend on, read from the file's header with the gguf package (no weights read), or written by llama.cpp's
quantization recipe for a Hugging Face config (serving/gguf_recipe.py)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from memfit.core.errors import MemfitError

_LAYER = re.compile(r"blk\.(\d+)\.")


def type_size(ggml_type: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type, from ggml's block structs as the gguf package lists
    them (Q4_K: 256 weights in 144 bytes)."""
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type.upper()]]
    except KeyError:
        names = ", ".join(t.name for t in gguf.GGML_QUANT_SIZES)
        raise MemfitError(f"unknown ggml type {ggml_type!r}; ggml has {names}.") from None


def row_bytes(ggml_type: str, n: int) -> int:
    """Bytes of `n` consecutive values of a row (n a multiple of the type's block)."""
    block, size = type_size(ggml_type)
    return n // block * size


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: str                    # ggml's name: F32, F16, Q4_K, ...
    shape: tuple[int, ...]       # ggml order: the row (contiguous) dimension first

    @property
    def nbytes(self) -> int:
        rows = 1
        for n in self.shape[1:]:
            rows *= n
        return row_bytes(self.type, self.shape[0]) * rows

    @property
    def layer(self) -> int | None:
        """The repeating layer the tensor belongs to (blk.N.), None for the input and output tensors."""
        match = _LAYER.match(self.name)
        return int(match.group(1)) if match else None


@dataclass(frozen=True)
class VisionTower:
    """A multimodal model's image encoder (a SigLIP tower: Gemma 3's), as its Hugging Face vision_config gives it:
    what Ollama's estimate counts beside the text model (its projector)."""
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    image_size: int
    patch_size: int
    channels: int = 3


@dataclass
class GGUFModel:
    """What llama.cpp's buffers depend on (KV heads per layer, where a model varies them; which layers attend over a
    sliding window)."""
    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: list[int]         # per layer (0: a layer with no KV cache)
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    tensors: list[GGUFTensor]
    n_swa: int = 0               # a sliding window's tokens (0: none)
    swa_layers: list[bool] = field(default_factory=list)   # per layer: attends over the window (with n_swa)
    n_expert: int = 0            # a mixture of experts: the experts of each layer's FFN (0: a dense FFN)
    n_expert_used: int = 0       # the experts each token is routed to
    n_ff_exp: int = 0            # an expert's FFN width
    source: str = ""             # the file, or the recipe that wrote the tensor list
    vision: VisionTower | None = None   # the image encoder beside it (a multimodal model's), not in the tensors

    @property
    def weights_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def has(self, name: str) -> bool:
        return any(t.name == name for t in self.tensors)

    @property
    def tied_embeddings(self) -> bool:
        """No output.weight: the head reads token_embd.weight (llama.cpp loads it a second time, as the output)."""
        return not self.has("output.weight")


def _field(fields: dict, key: str, default=None):
    value = fields.get(key)
    return default if value is None else value.contents()


def _per_layer(value, n_layer: int) -> list[int]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise MemfitError(f"a per-layer value has {len(value)} entries for {n_layer} layers.")
        return [int(v) for v in value]
    return [int(value)] * n_layer


def read_gguf(path: str) -> GGUFModel:
    """The model a .gguf file holds, from its header (the gguf package maps the file; no weight is read)."""
    import gguf

    if not os.path.isfile(path):
        raise MemfitError(f"{path}: no such GGUF file.")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise MemfitError(f"{path}: not a GGUF file llama.cpp could load ({exc}).") from None
    fields = reader.fields
    arch = _field(fields, "general.architecture")
    if not arch:
        raise MemfitError(f"{path}: a GGUF file without general.architecture.")
    n_layer = int(_field(fields, f"{arch}.block_count", 0))
    n_embd = int(_field(fields, f"{arch}.embedding_length", 0))
    n_head = _per_layer(_field(fields, f"{arch}.attention.head_count", 0), n_layer)
    n_head_kv = _per_layer(_field(fields, f"{arch}.attention.head_count_kv", n_head), n_layer)
    if not n_layer or not n_embd or not max(n_head):
        raise MemfitError(f"{path}: {arch} without block_count, embedding_length or attention.head_count; memfit "
                          "models attention decoders.")
    head_dim = n_embd // max(n_head)
    tensors = [GGUFTensor(t.name, t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in reader.tensors]
    vocab = _field(fields, f"{arch}.vocab_size")
    if vocab is None:
        tokens = fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else next(
            (t.shape[1] for t in tensors if t.name == "token_embd.weight"), 0)
    n_swa = int(_field(fields, f"{arch}.attention.sliding_window", 0) or 0)
    return GGUFModel(
        name=os.path.basename(path), arch=str(arch), n_layer=n_layer, n_embd=n_embd, n_head=max(n_head),
        n_head_kv=n_head_kv, head_dim_k=int(_field(fields, f"{arch}.attention.key_length", head_dim)),
        head_dim_v=int(_field(fields, f"{arch}.attention.value_length", head_dim)),
        n_ff=int(max(_per_layer(_field(fields, f"{arch}.feed_forward_length", 0), n_layer))),
        n_vocab=int(vocab), n_ctx_train=int(_field(fields, f"{arch}.context_length", 0)), tensors=tensors,
        n_swa=n_swa, swa_layers=swa_pattern(_field(fields, f"{arch}.attention.sliding_window_pattern"), arch,
                                            n_layer) if n_swa else [],
        n_expert=int(_field(fields, f"{arch}.expert_count", 0) or 0),
        n_expert_used=int(_field(fields, f"{arch}.expert_used_count", 0) or 0),
        n_ff_exp=int(_field(fields, f"{arch}.expert_feed_forward_length", 0) or 0) or _expert_width(tensors),
        source=path)


# the sliding-window pattern an architecture's loader assumes when the file names none (load_swa_pattern's default)
SWA_PATTERNS = {"gemma3": 6, "gemma2": 2, "gpt-oss": 2}
WINDOWED = ("gemma2", "gemma3", "gpt-oss")   # the architectures whose sliding-window cache and graph memfit models


def swa_pattern(value, arch: str, n_layer: int) -> list[bool]:
    """Which layers use the sliding window: the file's per-layer list, or a period N (the last of every N layers
    attends over everything: llama_hparams::set_swa_pattern), or the architecture's default."""
    if isinstance(value, list):
        return [bool(v) for v in value][:n_layer]
    period = int(value) if value is not None else SWA_PATTERNS.get(arch, 0)
    return [period == 0 or layer % period < period - 1 for layer in range(n_layer)]


def _expert_width(tensors: list[GGUFTensor]) -> int:
    """An expert's FFN width from its up projection (n_embd x n_ff_exp x n_expert; Mixtral's files name none)."""
    return next((t.shape[1] for t in tensors if t.name.endswith("ffn_up_exps.weight")), 0)
