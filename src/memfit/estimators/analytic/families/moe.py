"""Mixture-of-experts MLPs (Mixtral, Qwen3-MoE): the router's softmax and top-k, then transformers' grouped_mm
experts, or, with int8 expert weights (torchao has no grouped matmul for them), its eager loop over the experts."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import cast

from memfit.estimators.analytic import ops
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.symbols import Param, Sym, View


@dataclass(frozen=True)
class Router:
    """How a mixture's top-k router and experts differ from Mixtral's (softmax of the logits cast to float32, the
    top-k weights divided by their sum, kept in float32; the router declared before the experts, whose gate and up
    projections are stored (experts, 2 x inner, hidden) without biases, SwiGLU between them)."""

    softmax_dtype: bool = False     # softmax(logits, dtype=float32): no separate cast of the logits (Qwen3-MoE)
    normalizes: bool = True         # top-k weights divided by their sum (Qwen3-MoE: norm_topk_prob)
    casts_back: bool = False        # the weights cast to the logits' dtype (Qwen3-MoE)
    declared_last: bool = False     # its weight comes after the experts' in the layer's parameters (Qwen3-MoE)
    top_k_first: bool = False       # top-k of the logits (with a bias), then softmax over those k (gpt-oss)
    grouped_sigmoid: bool = False   # float32 logits, sigmoid, a correction bias, the best groups' experts only, the
    #                                 weights gathered, renormalised and scaled; a float32 weight (DeepSeek-V3)
    clamped_gate: bool = False      # experts stored (experts, hidden, 2 x inner) with biases, interleaved gate and
    #                                 up clamped, gate * sigmoid(alpha * gate) * (up + 1) (gpt-oss)

    @classmethod
    def of(cls, cfg) -> Router:
        if cfg.model_type == "qwen3_moe":
            return cls(softmax_dtype=True, normalizes=bool(cfg.norm_topk_prob), casts_back=True, declared_last=True)
        if cfg.model_type == "gpt_oss":
            return cls(top_k_first=True, clamped_gate=True)
        if cfg.model_type == "deepseek_v3":
            return cls(grouped_sigmoid=True, normalizes=bool(cfg.norm_topk_prob), declared_last=True)
        return cls()


ParamDeclaration = tuple[str, tuple[int, ...], str | None]   # name, shape, a dtype the model keeps (or None)


def expert_params(d) -> list[ParamDeclaration]:
    """A mixture layer's parameters in the model's order: (name, shape, a dtype the model keeps or None)."""
    h, inter, n = d.hidden, d.intermediate, d.experts
    if d.router.clamped_gate:   # gpt-oss: router weight and bias, then each projection with its bias
        return [("router", (n, h), None), ("router.bias", (n,), None), ("experts.gate_up", (n, h, 2 * inter), None),
                ("experts.gate_up.bias", (n, 2 * inter), None), ("experts.down", (n, inter, h), None),
                ("experts.down.bias", (n, h), None)]
    stored: list[ParamDeclaration] = [("experts.gate_up", (n, 2 * inter, h), None),
                                      ("experts.down", (n, h, inter), None)]
    router: list[ParamDeclaration] = [("router", (n, h), "float32" if d.router.grouped_sigmoid else None)]
    shared = inter * d.shared_experts
    always = [("shared.gate", (shared, h), None), ("shared.up", (shared, h), None),
              ("shared.down", (h, shared), None)] if shared else []
    return (stored + router if d.router.declared_last else router + stored) + always


def experts(e: Engine, x: Sym, d, layer: int, tokens: int) -> Sym:
    """Mixtral: the router's softmax and top-k, then transformers' grouped_mm experts (local variables live until
    the function returns, as in `grouped_mm_experts_forward`), or its eager loop when the experts are int8; then
    the shared experts (DeepSeek-V3) over the same input, added."""
    router = _grouped_sigmoid_router if d.router.grouped_sigmoid else _router
    router_logits, weights, top_index = router(e, x, d, layer, tokens)
    quantized = e.params[f"layers.{layer}.experts.gate_up"].quant is not None
    out = (_eager_experts if quantized else _grouped_experts)(e, x, weights, d, layer, tokens)
    del router_logits, weights, top_index
    if d.shared_experts:
        out = ops.add(e, out, _shared_experts(e, x, d, f"layers.{layer}.shared."))
    return out


def _shared_experts(e: Engine, x: Sym, d, p: str) -> Sym:
    inter = d.intermediate * d.shared_experts
    gate = ops.linear(e, x, e.params[p + "gate"], inter)
    act = ops.unary_saving_input(e, gate)
    del gate
    up = ops.linear(e, x, e.params[p + "up"], inter)
    hidden = ops.mul(e, act, up)
    del act, up
    return ops.linear(e, hidden, e.params[p + "down"], d.hidden)


def _grouped_sigmoid_router(e: Engine, x: Sym, d, layer: int, tokens: int):
    """DeepseekV3TopkRouter: logits of the float32 input, sigmoid, + the correction bias, each group's best two
    summed, the best groups kept (a mask built, expanded and inverted), top-k of the masked scores, the weights
    gathered from the sigmoid, renormalised in place and scaled."""
    n, k, groups = d.experts, d.top_k, d.router_groups
    x32 = ops.cast(e, x, "float32")
    logits = ops.linear(e, x32, e.params[f"layers.{layer}.router"], n)   # the weight is kept float32
    del x32
    scores = ops.unary_saving_output(e, logits, "sigmoid")
    choice = e.new(tokens * n, ops.promote(scores.dtype, "float32"))           # scores + e_score_correction_bias
    pairs, pair_index = e.new(tokens * groups * 2, choice.dtype), e.new(tokens * groups * 2, "int64")
    group_scores = e.new(tokens * groups, choice.dtype)                         # .topk(2)[0].sum(-1)
    del pairs, pair_index
    best, best_index = e.new(tokens * d.router_top_groups, choice.dtype), e.new(tokens * d.router_top_groups, "int64")
    group_mask = e.new(tokens * groups, choice.dtype)                           # zeros_like, scatter_
    del best
    score_mask = e.new(tokens * n, choice.dtype)                                # expand(...).reshape copies
    as_bool = e.new(tokens * n, "bool")
    inverted = e.new(tokens * n, "bool")
    del as_bool
    masked = e.new(tokens * n, choice.dtype)                                    # masked_fill
    del inverted, choice
    top, top_index = e.new(tokens * k, masked.dtype), e.new(tokens * k, "int64")
    del top, masked
    weights = e.record(e.new(tokens * k, scores.dtype), [scores], [top_index])   # scores.gather(1, index)
    if d.router.normalizes:
        denom = ops.shift(e, ops.reduce_last(e, weights, k))
        weights = ops.mul(e, weights, denom)                                    # /= (autograd: a new version)
        del denom
    weights = ops.scalar_op(e, weights)                                         # * routed_scaling_factor
    del group_scores, best_index, group_mask, score_mask, scores
    return logits, weights, top_index





def _router(e: Engine, x: Sym, d, layer: int, tokens: int):
    k, how, p = d.top_k, d.router, f"layers.{layer}."
    router_logits = ops.linear(e, x, e.params[p + "router"], d.experts, e.params.get(p + "router.bias"))
    if how.top_k_first:   # topk of the logits (saving the indices), softmax over the k kept
        top_values, top_index = e.new(tokens * k, router_logits.dtype), e.new(tokens * k, "int64")
        top_values = e.record(top_values, [router_logits], [top_index])
        weights = ops.softmax(e, top_values, "softmax", dtype=top_values.dtype)
        del top_values
        return router_logits, weights, top_index
    if how.softmax_dtype:
        probs = ops.softmax(e, router_logits, "softmax", dtype="float32")
    else:
        probs = ops.softmax(e, ops.cast(e, router_logits, "float32"), "softmax")
    top_values, top_index = e.new(tokens * k, probs.dtype), e.new(tokens * k, "int64")
    top_values = e.record(top_values, [probs], [top_index])          # topk saves the indices
    denom = ops.reduce_last(e, top_values, k) if how.normalizes else None
    # top_values /= sum (autograd: a new version)
    weights = ops.mul(e, top_values, denom) if denom is not None else top_values
    if how.casts_back:
        weights = ops.cast(e, weights, router_logits.dtype)
    del probs, denom, top_values
    return router_logits, weights, top_index


def _grouped_experts(e: Engine, x: Sym, weights: Sym, d, layer: int, tokens: int) -> Sym:
    p = f"layers.{layer}."
    k, h, inter = d.top_k, d.hidden, d.intermediate
    sorted_ids, perm = e.new(tokens * k, "int64"), e.new(tokens * k, "int64")      # torch.sort
    perm_tok = e.new(tokens * k, "int64")                                       # perm // k
    gathered = e.record(e.new(tokens * k * h, x.dtype), [x], [perm_tok])       # hidden_states[perm // k]
    del perm_tok
    sample_w = e.record(e.new(tokens * k, weights.dtype), [weights], [perm])   # sample_weights[perm]
    histc_input = e.new(tokens * k, "float32") if e.policy.backend == "cpu" else e.new(tokens * k, "int32")
    counts, offsets = e.new(d.experts, "float32"), e.new(d.experts, "int32")
    w_gate_up, w_down = e.params[p + "experts.gate_up"], e.params[p + "experts.down"]
    biases = _gathered_bias(e, e.params.get(p + "experts.gate_up.bias"), sorted_ids, 2 * inter)
    # each operand saved when the other needs a gradient (frozen experts under LoRA keep no inputs)
    proj = e.record(e.op_output(tokens * k * 2 * inter, w_gate_up.dtype, "mm"), [gathered, w_gate_up],
                    ops._saves(gathered, w_gate_up))
    if biases is not None:
        proj = ops.add_(e, proj, biases)
    if d.router.clamped_gate:
        proj = _clamped_gate(e, proj)
    else:
        act = ops.unary_saving_input(e, View(proj, proj.numel // 2))
        proj = ops.mul(e, act, View(proj, proj.numel // 2))
        del act
    biases = _gathered_bias(e, e.params.get(p + "experts.down.bias"), sorted_ids, h)   # replaces the first
    proj = e.record(e.op_output(tokens * k * h, w_down.dtype, "mm"), [proj, w_down], ops._saves(proj, w_down))
    if biases is not None:
        proj = ops.add_(e, proj, biases)
    weighted = ops.mul(e, proj, sample_w)
    inv_perm = e.new(tokens * k, "int64")
    positions = e.new(tokens * k, "int64")                                      # inv_perm[perm] = arange(...)
    del positions
    weighted = e.record(e.new(weighted.numel, weighted.dtype), [weighted], [inv_perm])
    summed = e.record(e.new(tokens * h, weighted.dtype), [weighted], [])
    del sorted_ids, perm, gathered, sample_w, histc_input, counts, offsets, proj, weighted, inv_perm, biases
    return ops.cast(e, summed, x.dtype)


def _gathered_bias(e: Engine, bias: Param | None, expert_ids: Sym, width: int) -> Sym | None:
    """`bias[expert_ids_g]`: each routed token's expert's bias (backward scatters into the bias by the ids)."""
    if bias is None:
        return None
    return e.record(e.new(expert_ids.numel * width, bias.dtype), [bias], [expert_ids])


def _clamped_gate(e: Engine, proj: Sym) -> Sym:
    """gpt-oss's _apply_gate: gate = proj[..., ::2].clamp(max=limit), up = proj[..., 1::2].clamp(-limit, limit),
    glu = gate * sigmoid(gate * alpha), (up + 1) * glu."""
    half = proj.numel // 2
    gate = ops.unary_saving_input(e, View(proj, half))      # clamp keeps its input for backward's mask
    up = ops.unary_saving_input(e, View(proj, half))
    scaled = ops.scalar_op(e, gate)
    sig = ops.unary_saving_output(e, scaled, "sigmoid")
    del scaled
    glu = ops.mul(e, gate, sig)
    del sig
    out = ops.mul(e, ops.shift(e, up), glu)
    del gate, up, glu   # local variables of _apply_gate until it returns
    return out


def _eager_experts(e: Engine, x: Sym, weights: Sym, d, layer: int, tokens: int) -> Sym:
    """transformers' eager experts loop (inference): a one-hot mask of the routing, the experts hit, then per
    expert its (slot, token) pairs, its tokens gathered, its two linears (torchao's int8 kernel for int8 experts),
    the routing weight applied (float32) and added into the output in place. Each variable keeps its tensor until
    the next expert's replaces it, as in the loop. No routing is known before the run: every expert counts as hit
    by every token, as the fake trace takes it (estimators/fake_patches.py): an upper bound."""
    p = f"layers.{layer}."
    k, h, inter, hit = d.top_k, d.hidden, d.intermediate, d.experts + 1    # one_hot adds a sentinel expert
    slots = tokens * k    # the routing mask's (slot, token) pairs
    # one expert's weight, as `experts.gate_up_proj[expert_idx]` selects it: what the linear kernels read (a stand-in
    # with the attributes of a Param they read)
    w_gate_up, w_down = (cast(Param, SimpleNamespace(numel=w.numel // d.experts, shape=w.shape[1:], quant=w.quant,
                                                     lora=None))
                         for w in (e.params[p + "experts.gate_up"], e.params[p + "experts.down"]))
    out = e.new(tokens * h, x.dtype)                                     # zeros_like
    mask = e.new(slots * hit, "int64")                                   # one_hot(top_k_index, E + 1)
    counts = e.new(hit, "int64")                                         # mask.sum((-1, -2)) > 0
    hit_mask = e.new(hit, "bool")
    del counts
    hit_index = e.new(hit, "int64")                                      # .nonzero()
    del hit_mask
    pairs = state = gate_up = hidden = None
    for _ in range(hit):
        chosen = e.new(1, "bool")                                        # expert_idx == num_experts
        del chosen
        pairs = e.new(2 * tokens, "int64")                               # torch.where(expert_mask[expert_idx])
        state = e.new(tokens * h, x.dtype)                               # hidden_states[token_idx]
        gate_up = ops.linear(e, state, w_gate_up, 2 * inter)
        act = e.new(tokens * inter, x.dtype)
        hidden = e.new(tokens * inter, x.dtype)                          # act_fn(gate) * up
        del act
        hidden = ops.linear(e, hidden, w_down, h)
        routing = e.new(tokens, weights.dtype)                           # top_k_weights[token_idx, top_k_pos]
        hidden = e.new(tokens * h, ops.promote(x.dtype, weights.dtype))
        del routing
        added = ops.cast(e, hidden, out.dtype)                           # .to(out.dtype), then index_add_
        del added
    del mask, hit_index, pairs, state, gate_up, hidden
    return out
