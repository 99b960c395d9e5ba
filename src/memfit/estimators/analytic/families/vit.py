"""ViT for image classification: patch convolution, class token and position embeddings, pre-LN
layers with SDPA, GELU MLP, final LayerNorm, a linear classifier on the class token, cross-entropy."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from memfit.estimators.analytic import ops
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.families.common import asks_for_eager, dense, eager_attention
from memfit.estimators.analytic.symbols import Sym, View

FAMILIES = ("vit",)


@dataclass(frozen=True)
class ViTSpec:
    causal: ClassVar[bool] = False   # an encoder over image patches (the step-time model's attention FLOPs)
    hidden: int
    layers: int
    heads: int
    intermediate: int
    image: int
    patch: int
    channels: int
    labels: int
    hidden_dropout: float
    attn_dropout: float
    eager: bool = False            # eager attention (scores materialised) instead of SDPA
    period: int = 1

    @classmethod
    def from_config(cls, cfg) -> ViTSpec:
        return cls(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                   intermediate=cfg.intermediate_size, image=cfg.image_size, patch=cfg.patch_size,
                   channels=cfg.num_channels, labels=cfg.num_labels, hidden_dropout=cfg.hidden_dropout_prob,
                   attn_dropout=cfg.attention_probs_dropout_prob,
                   eager=asks_for_eager(cfg))

    def tokens(self, image: int) -> int:
        return (image // self.patch) ** 2 + 1


def declare_params(e: Engine, d: ViTSpec, num_layers: int) -> None:
    h, inter = d.hidden, d.intermediate
    e.param("cls", (1, 1, h))
    e.param("pos", (1, d.tokens(d.image), h))
    e.param("patch.w", (h, d.channels, d.patch, d.patch))
    e.param("patch.b", (h,))
    for i in range(num_layers):
        p = f"layers.{i}."
        for name, shape in (("ln1.w", (h,)), ("ln1.b", (h,)), ("q.w", (h, h)), ("q.b", (h,)), ("k.w", (h, h)),
                            ("k.b", (h,)), ("v.w", (h, h)), ("v.b", (h,)), ("o.w", (h, h)), ("o.b", (h,)),
                            ("ln2.w", (h,)), ("ln2.b", (h,)), ("fc1.w", (inter, h)), ("fc1.b", (inter,)),
                            ("fc2.w", (h, inter)), ("fc2.b", (h,))):
            e.param(p + name, shape)
    e.param("ln.w", (h,))
    e.param("ln.b", (h,))
    e.param("classifier.w", (d.labels, h))
    e.param("classifier.b", (d.labels,))


def declare_buffers(e: Engine, d: ViTSpec) -> list[Sym]:
    return []


def embeddings(e: Engine, d: ViTSpec, pixels: Sym, batch: int, image: int) -> Sym:
    patches = (image // d.patch) ** 2
    x = ops.patch_conv(e, pixels, e.params["patch.w"], e.params["patch.b"], batch=batch, channels=d.channels,
                       image=image, patch=d.patch, out_channels=d.hidden)
    x = ops.cat(e, [View(e.params["cls"], batch * d.hidden), x])
    position: Sym = e.params["pos"]
    if image != d.image:   # interpolate_pos_encoding: bicubic resize of the patch positions
        position = ops.cat(e, [View(position, d.hidden), ops.copy(e, View(position, patches * d.hidden))])
    x = ops.add(e, x, position)
    return ops.dropout(e, x, d.hidden_dropout)


def attention(e: Engine, x: Sym, d: ViTSpec, i: int, batch: int, tokens: int) -> Sym:
    p = f"layers.{i}."
    q, k, v = (dense(e, x, p + n, d.hidden) for n in ("q", "k", "v"))
    shape: dict[str, Any] = dict(batch=batch, heads=d.heads, q_len=tokens, kv_len=tokens, head_dim=d.hidden // d.heads,
                 dropout_p=d.attn_dropout if e.policy.train else 0.0)
    if d.eager:   # softmax in float32, cast back to the query's dtype
        out = eager_attention(e, q, k, v, **shape, softmax_dtype="float32", weights_dtype=q.dtype)[0]
    else:
        out = ops.sdpa(e, q, k, v, **shape)
    del q, k, v
    return dense(e, out, p + "o", d.hidden)


def layer(e: Engine, x: Sym, d: ViTSpec, i: int, batch: int, tokens: int) -> Sym:
    p = f"layers.{i}."
    residual = x
    h = ops.layer_norm(e, x, e.params[p + "ln1.w"], e.params[p + "ln1.b"], d.hidden)
    h = attention(e, h, d, i, batch, tokens)
    h = ops.dropout(e, h, d.hidden_dropout)
    h = ops.add(e, h, residual)
    residual = h
    h = ops.layer_norm(e, h, e.params[p + "ln2.w"], e.params[p + "ln2.b"], d.hidden)
    h = mlp(e, h, d, i)   # the LayerNorm output lives until the MLP returns
    h = ops.dropout(e, h, d.hidden_dropout)
    return ops.add(e, h, residual)


def mlp(e: Engine, x: Sym, d: ViTSpec, i: int) -> Sym:
    p = f"layers.{i}."
    h = dense(e, x, p + "fc1", d.intermediate)
    h = ops.unary_saving_input(e, h)   # erf GELU
    return dense(e, h, p + "fc2", d.hidden)


def forward(e: Engine, d: ViTSpec, num_layers: int, *, batch: int, image: int, labels: bool) -> Sym:
    pixels = e.input(batch * d.channels * image * image, e.policy.param_dtype)
    tokens = d.tokens(image)
    e.segment = "pre"
    embedding_output = embeddings(e, d, pixels, batch, image)   # ViTModel keeps it until it returns
    x = embedding_output
    for i in range(num_layers):
        e.segment = (0, i)
        x = e.block(i, partial(layer, e, d=d, i=i, batch=batch, tokens=tokens), x)
    e.segment = "post"
    sequence_output = ops.layer_norm(e, x, e.params["ln.w"], e.params["ln.b"], d.hidden)
    del x, embedding_output
    logits = dense(e, View(sequence_output, batch * d.hidden), "classifier", d.labels)
    if not labels:
        return logits
    e.input(batch, "int64")
    loss = ops.cross_entropy(e, logits, batch=batch, seq=1, shift=False, upcast=False)
    del logits, sequence_output
    return loss


def train(e: Engine, d: ViTSpec, num_layers: int, batch: int, seq: int) -> Sym:
    return forward(e, d, num_layers, batch=batch, image=seq, labels=True)


def inference(e: Engine, d: ViTSpec, num_layers: int, batch: int, seq: int, new_tokens: int) -> None:
    e.set_phase("forward")
    logits = forward(e, d, num_layers, batch=batch, image=seq, labels=False)
    del logits
