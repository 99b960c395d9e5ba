"""llama.cpp's compute buffer: the size ggml's graph allocator (ggml-alloc.c) reserves for the worst-case ubatch
graph, found by replaying that allocator on the graph llama.cpp builds for an attention decoder.

The allocator, as ggml-alloc.c does it: graph inputs are placed first; then, node by node, a node that may work in
place (ADD, MUL, RMS_NORM, ROPE, SOFT_MAX, ...) takes over its parent's memory when it is the parent's only
consumer, unless that parent is a view (not the allocator's own: RoPE on the reshaped Q takes new memory); any
other node takes the best-fitting free block (the smallest that is large enough; else the end of the buffer, which
grows it); a tensor is freed when its last consumer has run, and a view's source when the last consumer of its
last view has. Graph outputs (the logits, the final norm) are never freed. The buffer is the highest end any tensor
reached. Views (reshape, permute) and the weights and KV cache (their own buffers) take nothing.

The graph (llama-graph.cpp, src/models/llama.cpp): per layer RMS norm, the Q/K/V projections (bias adds in place),
RoPE, K and V written into the cache, then without flash attention KQ (n_kv x tokens x heads, float32), its
softmax in place and KQV, made contiguous; with it one FLASH_ATTN_EXT; the output projection, the residual add, the
FFN (gate, up, SwiGLU, down; a mixture of experts' as build_moe_ffn builds it: _experts) and its residual add. Qwen3
norms each head's Q and K before RoPE; a quantized cache (since PR 21038) rotates Q, K and V by a Hadamard matrix
product before they are stored, and the attention's output back. Gemma 3 scales the embeddings and Q, norms after
the attention and after its GeGLU FFN; gpt-oss adds biases and attention sinks; a sliding-window model's two caches
each have their inputs (rows, mask). In the last layer only the output rows are kept (GET_ROWS; gpt-oss selects them
after its last layer); then the final norm and the logits (n_vocab x outputs). Beside the tokens, the graph takes
an input for embeddings given instead of tokens (ggml_build_forward_select, llama.cpp PR 18550): allocated, never
read. The worst case llama.cpp reserves: a full ubatch of tokens, every one an output, against the whole cache (n_kv:
the cells of one stream).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memfit.serving.gguf_file import row_bytes, type_size

if TYPE_CHECKING:
    from memfit.serving.gguf_file import GGUFModel
    from memfit.serving.llamacpp import KVCache, LlamaCppSettings

CPU_ALIGNMENT = 32       # ggml's TENSOR_ALIGNMENT: the CPU buffer type's
GPU_ALIGNMENT = 128      # ggml-cuda's buffer type's (assumed for other GPU backends)
MASK_PAD = 32            # GGML_KQ_MASK_PAD before PR 17910: the mask's tokens padded to it (value assumed)
GRAPH_TENSORS = (".bias", "attn_q_norm.weight", "attn_k_norm.weight")   # optional weights that add graph nodes
# ggml_op_can_inplace's, those the graphs use
IN_PLACE = {"ADD", "ADD_ID", "MUL", "DIV", "SCALE", "CLAMP", "RMS_NORM", "ROPE", "SOFT_MAX", "UNARY"}


@dataclass(eq=False)
class Tensor:
    name: str
    nbytes: int
    op: str = "NONE"
    srcs: list[Tensor] = field(default_factory=list)
    view_of: Tensor | None = None     # a view takes its source's memory
    external: bool = False            # in another buffer (weights, KV cache)
    is_input: bool = False
    is_output: bool = False


class Graph:
    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.inputs: list[Tensor] = []   # in the order ggml meets them (its leafs): placed before any node

    def external(self, name: str, nbytes: int = 0) -> Tensor:
        """A tensor in another buffer (a weight, the KV cache): `nbytes`, what a copy of it would take."""
        return Tensor(name, nbytes, external=True)

    def input(self, name: str, nbytes: int) -> Tensor:
        tensor = Tensor(name, nbytes, is_input=True)
        self.inputs.append(tensor)
        return tensor

    def op(self, op: str, name: str, nbytes: int, *srcs: Tensor) -> Tensor:
        node = Tensor(name, nbytes, op, list(srcs))
        self.nodes.append(node)
        return node

    def view(self, source: Tensor, name: str = "") -> Tensor:
        node = Tensor(name or f"{source.name} (view)", source.nbytes, "VIEW", [source],
                      view_of=source.view_of or source, external=source.external)
        self.nodes.append(node)
        return node


class _Blocks:
    """ggml_dyn_tallocr: free blocks sorted by offset, the last one the endless end of the buffer."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.free: list[list[int]] = [[0, 1 << 62]]
        self.max_size = 0

    def aligned(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    def alloc(self, size: int) -> int:
        size = self.aligned(size)
        best = -1
        for i, (_, block_size) in enumerate(self.free[:-1]):   # the best fit besides the last block
            if block_size >= size and (best < 0 or block_size <= self.free[best][1]):
                best = i
        if best < 0:
            best = len(self.free) - 1
        offset = self.free[best][0]
        self.free[best][0] += size
        self.free[best][1] -= size
        if self.free[best][1] == 0:
            del self.free[best]
        self.max_size = max(self.max_size, offset + size)
        return offset

    def release(self, offset: int, size: int) -> None:
        size = self.aligned(size)
        for i, block in enumerate(self.free):
            if block[0] + block[1] == offset:              # the freed bytes follow this block
                block[1] += size
                if i + 1 < len(self.free) and block[0] + block[1] == self.free[i + 1][0]:
                    block[1] += self.free.pop(i + 1)[1]
                return
            if offset + size == block[0]:                  # they precede it
                block[0], block[1] = offset, block[1] + size
                if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == block[0]:
                    self.free[i - 1][1] += self.free.pop(i)[1]
                return
        position = next((i for i, block in enumerate(self.free) if block[0] > offset), len(self.free))
        self.free.insert(position, [offset, size])


def allocate(graph: Graph, alignment: int = CPU_ALIGNMENT) -> int:
    """The buffer ggml's graph allocator reserves for `graph`, in bytes."""
    blocks = _Blocks(alignment)
    children: dict[Tensor, int] = {}
    views: dict[Tensor, int] = {}
    address: dict[Tensor, int] = {}     # the tensors this buffer holds now, and where

    def place(node: Tensor) -> None:
        if node in address or node.external or node.view_of is not None:
            return
        if node.op in IN_PLACE:
            for parent in node.srcs:   # a view is not the allocator's own tensor: never taken over
                if parent in address and not parent.is_output and parent.nbytes == node.nbytes and \
                        children.get(parent, 0) == 1 and views.get(parent, 0) == 0:
                    address[node] = address.pop(parent)
                    return
        address[node] = blocks.alloc(node.nbytes)

    for node in graph.nodes:
        if node.view_of is not None:
            views[node.view_of] = views.get(node.view_of, 0) + 1
        for src in node.srcs:
            children[src] = children.get(src, 0) + 1
    for tensor in graph.inputs:
        place(tensor)
    for node in graph.nodes:
        for src in node.srcs:
            place(src)
        place(node)
        for parent in node.srcs:
            children[parent] -= 1
            if children[parent] or views.get(parent, 0):
                continue
            if parent.view_of is not None:
                source = parent.view_of
                views[source] -= 1
                if not views[source] and not children.get(source, 0) and source in address:
                    _free(source, address, blocks)
            elif parent in address:
                _free(parent, address, blocks)
    return blocks.max_size


def _free(tensor: Tensor, address: dict[Tensor, int], blocks: _Blocks) -> None:
    if tensor.is_output:
        return
    blocks.release(address.pop(tensor), tensor.nbytes)


def rotations(model: GGUFModel, settings: LlamaCppSettings) -> tuple[int, int]:
    """The Hadamard matrices' sizes (0: none) for K (and Q) and for V: since PR 21038 a quantized cache type whose
    head size is a multiple of 64 stores its vectors rotated; K's matrix is the largest power of two (64 or more)
    dividing the head, V's is 64 (llama_kv_cache::build_input_k_rot, build_input_v_rot)."""
    if not settings.release.has("kv_rotation"):
        return 0, 0

    def size(cache_type: str, head: int, largest: bool) -> int:
        if type_size(cache_type.upper())[0] == 1 or head % 64:
            return 0
        n = 64
        while largest and head % (2 * n) == 0:
            n *= 2
        return n

    return (size(settings.cache_type_k, model.head_dim_k, True), size(settings.cache_type_v, model.head_dim_v, False))


def cache_kinds(model: GGUFModel, kv: KVCache) -> list[str]:
    """Each layer's cache: "" (a model with one), or "swa" and "base" (a sliding-window model's two caches)."""
    if not kv.swa_cells:
        return [""] * model.n_layer
    return ["swa" if sliding else "base" for sliding in model.swa_layers]


def _attention_inputs(model: GGUFModel, tokens: int, n_kv: int, flash_attn: bool, settings: LlamaCppSettings,
                      kind: str) -> list[tuple[str, int]]:
    """One cache's inputs, in the order its first layer uses them: the rotations of a quantized cache (since PR
    21038), the cache rows K and V are written to (since set_rows; V's per element when it is stored transposed,
    without flash attention), and the attention mask over its `n_kv` cells (F16 with flash attention since PR 23764,
    F32 before and without; its tokens padded to 32 before PR 17910)."""
    release = settings.release
    rows = tokens if release.has("no_mask_pad") else -(-tokens // MASK_PAD) * MASK_PAD
    mask = ("attn_inp_kq_mask" + kind, n_kv * rows * (2 if flash_attn and release.has("f16_mask") else 4))
    rotate = [(name + kind, n * n * 4) for name, n in zip(("attn_inp_k_rot", "attn_inp_v_rot"),
                                                            rotations(model, settings)) if n]
    if not release.has("kv_set_rows"):
        return [*rotate, mask]
    v_rows = 1 if flash_attn else max(model.n_head_kv) * model.head_dim_v
    return [*rotate, ("attn_inp_k_idxs" + kind, tokens * 8), ("attn_inp_v_idxs" + kind, tokens * 8 * v_rows), mask]


def _inputs(model: GGUFModel, tokens: int, kv: KVCache, flash_attn: bool, settings: LlamaCppSettings
            ) -> list[tuple[str, int]]:
    """The graph's inputs after the tokens, in the order its nodes first use them (ggml-alloc places them so):
    positions, each cache's attention inputs as its first layer meets them, the output rows (since PR 6017)."""
    out = [("inp_pos", tokens * 4)]
    for kind in dict.fromkeys(cache_kinds(model, kv)):
        n_kv = kv.swa_cells if kind == "swa" else kv.cells
        out += _attention_inputs(model, tokens, n_kv, flash_attn, settings, kind)
    return out + ([("out_ids", tokens * 4)] if settings.release.has("output_per_sequence") else [])


def decoder_graph(model: GGUFModel, tokens: int, *, kv: KVCache, flash_attn: bool, settings: LlamaCppSettings
                  ) -> Graph:
    """The worst-case graph llama.cpp reserves for an attention decoder (llama, qwen2, mistral, qwen3, Gemma 3):
    `tokens` in the ubatch, every one an output, against every cell of each cache, as the settings' release builds
    it."""
    graph = Graph()
    release = settings.release
    outputs = tokens
    f32 = 4
    embd, heads, head_dim, ffn = model.n_embd, model.n_head, model.head_dim_k, model.n_ff
    gemma, oss = model.arch in ("gemma2", "gemma3"), model.arch == "gpt-oss"
    kinds = cache_kinds(model, kv)
    inp_tokens = graph.input("inp_tokens", tokens * 4)
    if release.has("embd_input"):
        graph.input("inp_embd", embd * tokens * f32)   # embeddings a batch may give instead of tokens: unread
    inputs = {name: graph.input(name, size) for name, size in _inputs(model, tokens, kv, flash_attn, settings)}
    inp_pos, out_ids = inputs["inp_pos"], inputs.get("out_ids")
    x = graph.op("GET_ROWS", "embd", embd * tokens * f32, graph.external("token_embd.weight"), inp_tokens)
    if gemma:   # the embeddings scaled by sqrt(n_embd), in place
        x = graph.op("SCALE", "inp_scaled", x.nbytes, x)
    masks = {}
    for kind in dict.fromkeys(kinds):
        mask, n_kv = inputs["attn_inp_kq_mask" + kind], kv.swa_cells if kind == "swa" else kv.cells
        if flash_attn and mask.nbytes == n_kv * tokens * 4:   # an F32 mask: flash attention reads it cast to F16
            mask = graph.op("CPY", "kq_mask_f16", n_kv * tokens * 2, mask)
        masks[kind] = mask
    names = {t.name for t in model.tensors}

    def projection(layer: int, name: str, width: int, src: Tensor, rows: int) -> Tensor:
        out = graph.op("MUL_MAT", name, width * rows * f32, graph.external(f"blk.{layer}.{name}.weight"), src)
        if f"blk.{layer}.{name}.bias" in names:
            out = graph.op("ADD", f"{name}_b", out.nbytes, out, graph.external(f"blk.{layer}.{name}.bias"))
        return out

    def norm(layer: int, name: str, cur: Tensor) -> Tensor:
        """build_norm: RMS_NORM (in place where it may), times the layer's weight (in place)."""
        cur = graph.op("RMS_NORM", "norm", cur.nbytes, cur)
        return graph.op("MUL", name, cur.nbytes, cur, graph.external(f"blk.{layer}.{name}.weight"))

    def rope(layer: int, part: str, cur: Tensor) -> Tensor:
        """RoPE on the heads (a view of the projection: new memory), after the RMS norm of each head where the model
        has one (Qwen3, Gemma 3: the norm takes new memory, its weight and RoPE then work in place); Gemma 3 scales
        Q after (in place)."""
        cur = graph.view(cur)
        if f"blk.{layer}.attn_{part}_norm.weight" in names:
            cur = norm(layer, f"attn_{part}_norm", cur)
        cur = graph.op("ROPE", f"{part.upper()}cur", cur.nbytes, cur, inp_pos)
        return graph.op("SCALE", "Qscaled", cur.nbytes, cur) if gemma and part == "q" else cur

    def rotated(cur: Tensor, rotation: Tensor | None) -> Tensor:
        """llama_mul_mat_hadamard: the rows rotated by a matrix product (new memory), reshaped back."""
        if rotation is None:
            return cur
        return graph.view(graph.op("MUL_MAT", "hadamard", cur.nbytes, rotation, graph.view(cur)))

    for layer in range(model.n_layer):
        kind = kinds[layer]
        kv_heads, n_kv = model.n_head_kv[layer], kv.swa_cells if kind == "swa" else kv.cells
        k_rot, v_rot = inputs.get("attn_inp_k_rot" + kind), inputs.get("attn_inp_v_rot" + kind)
        k_idxs, v_idxs = inputs.get("attn_inp_k_idxs" + kind), inputs.get("attn_inp_v_idxs" + kind)
        attn_in = norm(layer, "attn_norm", x)
        q = rotated(rope(layer, "q", projection(layer, "attn_q", heads * head_dim, attn_in, tokens)), k_rot)

        built = {}   # the two-cache attention expands K before V (build_attn for llm_graph_input_attn_kv_iswa)
        for part in ("k", "v") if kind else ("v", "k"):
            width, rotation = (kv_heads * head_dim, k_rot) if part == "k" else (kv_heads * model.head_dim_v, v_rot)
            cur = projection(layer, f"attn_{part}", width, attn_in, tokens)
            built[part] = rotated(rope(layer, "k", cur) if part == "k" else cur, rotation)
        k, v = built["k"], built["v"]
        cache_k = graph.external(f"cache_k_l{layer}", n_kv * row_bytes(settings.cache_type_k.upper(),
                                                                     kv_heads * head_dim))
        cache_v = graph.external(f"cache_v_l{layer}", n_kv * row_bytes(settings.cache_type_v.upper(),
                                                                     kv_heads * model.head_dim_v))
        for cache, cur, rows in ((cache_k, k, k_idxs), (cache_v, v, v_idxs)):   # written into the cache (a view)
            written = graph.op("SET_ROWS" if rows else "CPY", "cache_write", 0, graph.view(cache), graph.view(cur),
                               *([rows] if rows else []))
            written.external = True
        q_view = graph.view(q)
        if flash_attn:
            attn = graph.op("FLASH_ATTN_EXT", "fattn", model.head_dim_v * heads * tokens * f32, q_view,
                            graph.view(cache_k), graph.view(cache_v), masks[kind])
            attn = graph.view(attn)
        else:
            kq = graph.op("MUL_MAT", "kq", n_kv * tokens * heads * f32, graph.view(cache_k), q_view)
            kq = graph.op("SOFT_MAX", "kq_soft_max", kq.nbytes, kq, masks[kind])
            kqv = graph.op("MUL_MAT", "kqv", model.head_dim_v * tokens * heads * f32, graph.view(cache_v), kq)
            attn = graph.op("CONT", "kqv_out", kqv.nbytes, graph.view(kqv))
        out = projection(layer, "attn_output", embd, rotated(attn, v_rot), tokens)
        if layer == model.n_layer - 1 and out_ids and not oss:   # only the output rows go on (since PR 6017)
            out = graph.op("GET_ROWS", "out_rows", embd * outputs * f32, out, out_ids)
            x = graph.op("GET_ROWS", "inp_rows", embd * outputs * f32, x, out_ids)
            tokens = outputs
        if gemma:
            out = norm(layer, "post_attention_norm", out)
        ffn_inp = graph.op("ADD", "ffn_inp", out.nbytes, out, x)
        ffn_in = norm(layer, "post_attention_norm" if oss else "ffn_norm", ffn_inp)
        if model.n_expert:
            down = _experts(graph, model, layer, ffn_in, tokens)
        else:
            gate = projection(layer, "ffn_gate", ffn, ffn_in, tokens)
            up = projection(layer, "ffn_up", ffn, ffn_in, tokens)
            act = graph.op("GLU", "ffn_geglu" if gemma else "ffn_swiglu", up.nbytes, gate, up)
            down = projection(layer, "ffn_down", embd, act, tokens)
        if gemma:
            down = norm(layer, "post_ffw_norm", down)
        x = graph.op("ADD", "l_out", down.nbytes, down, ffn_inp)
    if oss and out_ids:   # gpt-oss keeps every row through its last layer (for its next-token head), then selects
        x = graph.op("GET_ROWS", "out_rows", embd * outputs * f32, x, out_ids)
    result = graph.op("RMS_NORM", "norm", x.nbytes, x)
    result = graph.op("MUL", "result_norm", result.nbytes, result, graph.external("output_norm.weight"))
    result.is_output = True
    logits = graph.op("MUL_MAT", "result_output", model.n_vocab * outputs * f32, graph.external("output.weight"),
                      result)
    logits.is_output = True
    return graph


def _experts(graph: Graph, model: GGUFModel, layer: int, x: Tensor, tokens: int) -> Tensor:
    """llama.cpp's build_moe_ffn: the router's logits (plus its bias, in place: gpt-oss), the top experts (ARGSORT,
    viewed to the first n_expert_used) and their weights: Mixtral and Qwen3-MoE take the softmax of all the logits
    (in place) and normalize the chosen ones (summed, clamped, divided); gpt-oss takes the softmax of the chosen
    logits alone (new memory). llama.cpp expands these before the experts. Then each chosen expert's gate and up
    (MUL_MAT_ID: n_ff_exp x experts used x tokens; gpt-oss adds their biases in place, ADD_ID), the gated activation
    (GLU: SwiGLU, gpt-oss's clamped one), down (and its bias), weighted in place, and the experts' outputs, views of
    one tensor, added up (the first ADD allocates, the rest add in place)."""
    f32, used, embd, ffn = 4, model.n_expert_used, model.n_embd, model.n_ff_exp
    names = {t.name for t in model.tensors}

    def weight(name: str) -> Tensor:
        return graph.external(f"blk.{layer}.{name}.weight")

    def biased(cur: Tensor, name: str, chosen: Tensor | None = None) -> Tensor:
        if f"blk.{layer}.{name}.bias" not in names:
            return cur
        bias = graph.external(f"blk.{layer}.{name}.bias")
        return graph.op("ADD_ID" if chosen else "ADD", f"{name}_biased", cur.nbytes, cur, bias,
                        *([chosen] if chosen else []))

    logits = graph.op("MUL_MAT", "ffn_moe_logits", model.n_expert * tokens * f32, weight("ffn_gate_inp"), x)
    logits = biased(logits, "ffn_gate_inp")
    softmax_after = model.arch == "gpt-oss"   # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT
    probs = logits if softmax_after else graph.op("SOFT_MAX", "ffn_moe_probs", logits.nbytes, logits)
    probs_3d = graph.view(probs)
    chosen = graph.view(graph.op("ARGSORT", "ffn_moe_argsort", model.n_expert * tokens * 4, probs), "ffn_moe_topk")
    weights = graph.view(graph.op("GET_ROWS", "ffn_moe_weights", used * tokens * f32, probs_3d, chosen))
    if softmax_after:
        weights = graph.view(graph.op("SOFT_MAX", "ffn_moe_weights_softmax", weights.nbytes, weights))
    else:
        total = graph.op("SUM_ROWS", "ffn_moe_weights_sum", tokens * f32, weights)
        total = graph.op("CLAMP", "ffn_moe_weights_sum_clamped", total.nbytes, total)
        weights = graph.view(graph.op("DIV", "ffn_moe_weights_norm", weights.nbytes, weights, total))
    x_3d = graph.view(x)
    gate = graph.op("MUL_MAT_ID", "ffn_moe_gate", ffn * used * tokens * f32, weight("ffn_gate_exps"), x_3d, chosen)
    gate = biased(gate, "ffn_gate_exps", chosen)
    up = graph.op("MUL_MAT_ID", "ffn_moe_up", gate.nbytes, weight("ffn_up_exps"), x_3d, chosen)
    up = biased(up, "ffn_up_exps", chosen)
    act = graph.op("GLU", "ffn_moe_swiglu", up.nbytes, gate, up)
    experts = graph.op("MUL_MAT_ID", "ffn_moe_down", embd * used * tokens * f32, weight("ffn_down_exps"), act, chosen)
    experts = biased(experts, "ffn_down_exps", chosen)
    experts = graph.op("MUL", "ffn_moe_weighted", experts.nbytes, experts, weights)
    each = [graph.view(experts, f"ffn_moe_expert_{i}") for i in range(used)]
    if used == 1:   # a view is not contiguous: copied out
        return graph.op("CONT", "ffn_moe_out", embd * tokens * f32, each[0])
    out = each[0]
    for view in each[1:]:
        out = graph.op("ADD", "ffn_moe_out", embd * tokens * f32, out, view)
    return out


def graph_key(model: GGUFModel, settings: LlamaCppSettings, *, n_ctx: int, kv: KVCache, flash_attn: bool) -> tuple:
    """What the worst-case graphs depend on: the model's shapes (not its tensors' types) and the settings that shape
    them."""
    shapes = (model.n_layer, model.n_embd, model.n_head, tuple(model.n_head_kv), model.head_dim_k, model.head_dim_v,
              model.n_ff, model.n_vocab, model.n_expert, model.n_expert_used, model.n_ff_exp,
              tuple(sorted(t.name for t in model.tensors if t.name.endswith(GRAPH_TENSORS))), model.arch,
              tuple(cache_kinds(model, kv)))
    return (shapes, settings.n_ubatch_at(n_ctx), kv.cells, kv.swa_cells, flash_attn, settings.release,
            rotations(model, settings))


def compute_buffer_bytes(model: GGUFModel, settings: LlamaCppSettings, *, n_ctx: int, kv: KVCache, flash_attn: bool
                         ) -> int:
    """The compute buffer llama.cpp reserves on the CPU running every layer: the larger of its prompt graph (a full
    ubatch) and its one-token graph. It depends on the model's shapes, not on its tensors' types: a planner asking
    for many quantizations replays each graph once."""
    key = graph_key(model, settings, n_ctx=n_ctx, kv=kv, flash_attn=flash_attn)
    if key not in _REPLAYED:
        _REPLAYED[key] = max(allocate(decoder_graph(model, tokens, kv=kv, flash_attn=flash_attn, settings=settings),
                                      CPU_ALIGNMENT) for tokens in (settings.n_ubatch_at(n_ctx), 1))
    return _REPLAYED[key]


_REPLAYED: dict[tuple, int] = {}   # compute buffers by the graph's shapes and settings (and split: by placement)
