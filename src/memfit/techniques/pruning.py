"""Pruning: weights removed for real (structured), or zeroed (unstructured, which saves nothing while
the weights stay dense).

  prune-structured[:ratio=0.5,part=both|heads|mlp]
          Llama-style decoders: whole attention-head groups (a key/value head with the query heads that
          share it, so grouped-query attention keeps its grouping) and MLP channels (a row of gate and up
          with the matching column of down); BERT: attention heads (query, key and value rows with the
          output projection's columns) and intermediate channels — removed from every block with
          torch-pruning's layer surgery (prune_linear_out_channels / prune_linear_in_channels), the lowest
          L2 norm first. Parameters,
          gradients, optimizer states, activations and the KV cache all shrink; the residual width stays.
          A fine-tune recovers part of the accuracy (benchmarks/technique_table.py measures both).
  prune-unstructured[:sparsity=0.5]
          the smallest-magnitude weights of every linear but the LM head set to zero (torch.nn.utils.prune,
          L1, each layer to the same sparsity), the mask folded in: the zeros stay in the same dense
          tensors, so it saves no memory at all (measured) — the "50-80 % smaller" of pruning papers needs
          sparse storage or structured removal (prune-structured).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from memfit.core.errors import MemfitError, require_choice
from memfit.steps.setup import StepSetup
from memfit.steps.stand_ins import stand_in
from memfit.techniques.base import Technique, register
from memfit.techniques.contracts import PlanQuery
from memfit.techniques.quantization import refuse_conv1d

PARTS = ("both", "heads", "mlp")


def _check_ratio(value: float, what: str) -> None:
    if not 0 < value < 1:
        raise MemfitError(f"{what} must be between 0 and 1 (exclusive), got {value}.")


def kept_count(total: int, ratio: float) -> int:
    """How many of `total` units are kept when `ratio` of them are pruned (at least one)."""
    return max(1, round(total * (1 - ratio)))


@register
@dataclass(frozen=True, kw_only=True)
class PruneStructured(Technique):
    name = "prune-structured"
    examples = (("prune-structured", {}),)
    risk = "lossy"
    stage = "prune"
    summary = "torch-pruning: attention-head groups and MLP channels removed for real (Llama-style decoders)"
    time_factor = 0.6      # fewer FLOPs in every block (assumed)
    search_axis = "weights"
    ratio: float = 0.5
    part: str = "both"

    def __post_init__(self) -> None:
        _check_ratio(self.ratio, "-t prune-structured: ratio")
        require_choice(self.part, PARTS, "-t prune-structured: part")

    @classmethod
    def search_values(cls, request: PlanQuery, workload):
        return [f"{cls.name}:ratio=0.25"]   # a quarter: the ratio whose accuracy cost is measured (accuracy.json)

    def analytic_spec(self, spec, workload):
        """The blocks' shape after pruning (the residual width stays): decoders lose whole key/value groups, BERT
        heads; the MLPs channels."""
        changes = {}
        if self.part in ("both", "heads") and hasattr(spec, "kv_heads"):
            kv = kept_count(spec.kv_heads, self.ratio)
            changes |= {"kv_heads": kv, "heads": kv * (spec.heads // spec.kv_heads)}
        elif self.part in ("both", "heads"):
            changes["heads"] = kept_count(spec.heads, self.ratio)
        if self.part in ("both", "mlp"):
            changes["intermediate"] = kept_count(spec.intermediate, self.ratio)
        return dataclasses.replace(spec, **changes)

    def check(self, workload) -> None:
        if not workload.source.is_hf or workload.source.model_type not in MODEL_TYPES:
            raise MemfitError(f"-t prune-structured removes heads and channels of {', '.join(MODEL_TYPES)} models, "
                              f"not {workload.source.model_type}.")

    def apply_(self, setup: StepSetup) -> None:
        try:
            import torch_pruning as tp
        except ImportError:
            raise MemfitError("-t prune-structured needs torch-pruning: pip install 'memfit[pruning]'.") from None
        # Llama's and BERT's blocks, known by their parts (reached by attribute, as the libraries name them)
        decoders: list[Any] = [m for m in setup.model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]
        encoders: list[Any] = [m for m in setup.model.modules()
                               if hasattr(m, "attention") and hasattr(m, "intermediate")]
        if not decoders and not encoders:
            raise MemfitError("-t prune-structured: no Llama-style (self_attn + mlp) or BERT-style (attention + "
                              "intermediate) blocks found.")
        heads, mlp = self.part in ("both", "heads"), self.part in ("both", "mlp")
        with torch.no_grad():
            for block in decoders:
                if heads:
                    _prune_head_groups(tp, block.self_attn, self.ratio)
                if mlp:
                    _prune_channels(tp, (block.mlp.gate_proj, block.mlp.up_proj), block.mlp.down_proj, self.ratio)
            for block in encoders:
                if heads:
                    _prune_bert_heads(tp, block.attention, self.ratio)
                if mlp:
                    _prune_channels(tp, (block.intermediate.dense,), block.output.dense, self.ratio)
        config = getattr(setup.model, "config", None)
        if config is not None and decoders:   # what the model is now (generation sizes its cache from it)
            attn = decoders[0].self_attn
            config.num_key_value_heads = attn.k_proj.out_features // attn.head_dim
            config.num_attention_heads = attn.q_proj.out_features // attn.head_dim
            config.intermediate_size = decoders[0].mlp.down_proj.in_features


MODEL_TYPES = ("llama", "mistral", "qwen2", "bert")


def _lowest(scores: torch.Tensor, keep: int) -> list[int]:
    """Indices of the units to remove: all but the `keep` highest scores (a trace's stand-in picks by position:
    fake scores have no values, and the shapes are the same)."""
    by_position = stand_in("prune-order", [scores])
    if by_position is not None:
        return by_position(scores, keep)
    return sorted(scores.argsort(descending=True)[keep:].tolist())


def _prune_head_groups(tp, attn, ratio: float) -> None:
    head_dim = attn.head_dim
    kv_heads = attn.k_proj.out_features // head_dim
    group = attn.q_proj.out_features // attn.k_proj.out_features
    keep = kept_count(kv_heads, ratio)
    if keep == kv_heads:
        return
    # a group's score: the L2 norm of all its weights (its query heads, its key and value head, its o columns)
    q = attn.q_proj.weight.float().pow(2).view(kv_heads, group * head_dim, -1).sum((1, 2))
    kv = sum(p.weight.float().pow(2).view(kv_heads, head_dim, -1).sum((1, 2)) for p in (attn.k_proj, attn.v_proj))
    o = attn.o_proj.weight.float().pow(2).view(-1, kv_heads, group * head_dim).sum((0, 2))
    drop = _lowest(q + kv + o, keep)
    kv_rows = [g * head_dim + i for g in drop for i in range(head_dim)]
    q_rows = [g * group * head_dim + i for g in drop for i in range(group * head_dim)]
    tp.prune_linear_out_channels(attn.q_proj, q_rows)
    tp.prune_linear_out_channels(attn.k_proj, kv_rows)
    tp.prune_linear_out_channels(attn.v_proj, kv_rows)
    tp.prune_linear_in_channels(attn.o_proj, q_rows)


def _prune_bert_heads(tp, attention, ratio: float) -> None:
    self_attn, out = attention.self, attention.output.dense
    head_dim, heads = self_attn.attention_head_size, self_attn.num_attention_heads
    keep = kept_count(heads, ratio)
    if keep == heads:
        return
    score = sum(p.weight.float().pow(2).view(heads, -1).sum(1) for p in (self_attn.query, self_attn.key,
                                                                           self_attn.value))
    score = score + out.weight.float().pow(2).view(-1, heads, head_dim).sum((0, 2))
    rows = [h * head_dim + i for h in _lowest(score, keep) for i in range(head_dim)]
    for linear in (self_attn.query, self_attn.key, self_attn.value):
        tp.prune_linear_out_channels(linear, rows)
    tp.prune_linear_in_channels(out, rows)
    self_attn.num_attention_heads, self_attn.all_head_size = keep, keep * head_dim


def _prune_channels(tp, producers: tuple, consumer, ratio: float) -> None:
    """Remove the weakest channels of a feed-forward: rows of the `producers`, columns of the `consumer`."""
    channels = consumer.in_features
    keep = kept_count(channels, ratio)
    score = sum(p.weight.float().pow(2).sum(1) for p in producers) + consumer.weight.float().pow(2).sum(0)
    drop = _lowest(score, keep)
    for producer in producers:
        tp.prune_linear_out_channels(producer, drop)
    tp.prune_linear_in_channels(consumer, drop)


@register
@dataclass(frozen=True, kw_only=True)
class PruneUnstructured(Technique):
    name = "prune-unstructured"
    examples = (("prune-unstructured", {}),)
    risk = "lossy"
    stage = "prune"
    summary = "magnitude pruning (torch.nn.utils.prune, L1): zeros in dense weights, which save no memory"
    sparsity: float = 0.5

    def __post_init__(self) -> None:
        _check_ratio(self.sparsity, "-t prune-unstructured: sparsity")

    def check(self, workload) -> None:
        refuse_conv1d(self.name, workload)

    def apply_(self, setup: StepSetup) -> None:
        from torch.nn.utils import prune

        linears = [m for name, m in setup.model.named_modules() if isinstance(m, torch.nn.Linear)
                   and name.rsplit(".", 1)[-1] not in ("lm_head", "classifier", "decoder")]   # the output layer stays
        if not linears:
            raise MemfitError("-t prune-unstructured: the model has no nn.Linear to prune (besides the LM head).")
        for linear in linears:
            prune.l1_unstructured(linear, "weight", amount=self.sparsity)
            prune.remove(linear, "weight")     # the zeros stay, in the same dense tensor
