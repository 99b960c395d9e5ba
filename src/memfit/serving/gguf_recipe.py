"""The GGUF file llama.cpp's tools would write for a Hugging Face model: the tensors its converter
(convert_hf_to_gguf.py) names and shapes for an attention decoder, each given the ggml type llama.cpp's quantizer
(llama-quant.cpp, llama_tensor_get_type) chooses for a file type such as Q4_K_M.

The quantizer's rules, as its source states them: only 2-D and 3-D tensors whose names end in "weight" are
quantized (no norms, no router); the output head gets Q6_K (Q8_0 when the file type is Q8_0 or MXFP4_MOE, or when its
rows do not split into Q6_K's blocks), and so does a tied token embedding, which is the head; an untied embedding
keeps the file type's own; attn_v and ffn_down get more bits in the "_M" types on the first and last eighth of the
layers and every third one between (use_more_bits), and per file type as listed below; a tensor whose rows do not
split into its type's blocks falls back to a type they do (Q4_K to Q5_0, Q6_K to Q8_0, ...). Tensors are counted in
the file's order, layer by layer (memfit assumes the converter's numeric layer order).
"""
from __future__ import annotations

from memfit.core.errors import MemfitError
from memfit.serving.gguf_file import WINDOWED, GGUFModel, GGUFTensor, VisionTower, swa_pattern, type_size

# llama.cpp's file types (llama-quantize's names) memfit writes, and the type each starts every tensor from
FILE_TYPES = {
    "F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0",
    "Q5_1": "Q5_1", "Q2_K": "Q2_K", "Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS", "MXFP4_MOE": "MXFP4",
}
# a type whose rows do not split into its blocks, and the one llama.cpp uses instead (tensor_type_fallback)
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "position_embd", "token_types", "ssm_conv1d",
                  "attn_rel_b.weight")


def _category(name: str) -> str:
    """llama-quant.cpp's tensor_get_category, in its order."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    # a fused QKV and MLA's kv_b take attn_v's rules (category_is_attn_v)
    for part, category in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                           ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                           ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                           ("ffn_down", "ffn_down")):
        if part in name:
            return category
    return "other"


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _blocks_fit(ggml_type: str, columns: int) -> bool:
    return columns % type_size(ggml_type)[0] == 0


def quantize(model: GGUFModel, file_type: str) -> GGUFModel:
    """`model` (its tensors in any type) as llama.cpp's quantizer writes it in `file_type`."""
    file_type = file_type.upper()
    if file_type not in FILE_TYPES:
        raise MemfitError(f"--quant {file_type}: memfit writes llama.cpp's {', '.join(FILE_TYPES)} (the IQ1/IQ2/IQ3 "
                          "types need an importance matrix and are not modelled).")
    default = FILE_TYPES[file_type]
    quantized = type_size(default)[0] > 1
    tied = not model.has("output.weight")
    n_attn_v = sum(_category(t.name) == "attn_v" for t in model.tensors)
    counters = {"attn_v": 0, "ffn_down": 0}
    gqa = model.n_head // max(1, max(model.n_head_kv))
    is_70b = model.arch == "llama" and model.n_layer == 80 and model.n_head != max(model.n_head_kv)
    out = []
    for tensor in model.tensors:
        kind = tensor.type
        if len(tensor.shape) >= 2 and tensor.name.endswith("weight") and not any(
                part in tensor.name for part in _NOT_QUANTIZED):
            kind = default
            if quantized:
                kind = _recipe(tensor, kind, file_type, tied=tied, gqa=gqa, is_70b=is_70b, n_attn_v=n_attn_v,
                               n_layer=model.n_layer, n_expert=model.n_expert, counters=counters)
                if not _blocks_fit(kind, tensor.shape[0]):
                    kind = FALLBACK.get(kind, kind)
                    if not _blocks_fit(kind, tensor.shape[0]):
                        kind = "F16"
        out.append(GGUFTensor(tensor.name, kind, tensor.shape))
    return GGUFModel(**{**model.__dict__, "tensors": out, "name": f"{model.name} {file_type}",
                        "source": f"{model.source}, quantized as llama.cpp's recipe writes {file_type}"})


def _recipe(tensor: GGUFTensor, kind: str, file_type: str, *, tied: bool, gqa: int, is_70b: bool, n_attn_v: int,
            n_layer: int, n_expert: int, counters: dict[str, int]) -> str:
    """llama_tensor_get_type_impl for the file types memfit writes."""
    category = _category(tensor.name)
    if category == "output" or (tied and category == "token_embd"):
        if file_type == "MXFP4_MOE" or not _blocks_fit(kind, tensor.shape[0]):
            return "Q8_0"
        return kind if kind == "Q8_0" else "Q6_K"
    if file_type == "MXFP4_MOE":
        return "MXFP4" if len(tensor.shape) > 2 and tensor.shape[2] > 1 else "Q8_0"
    if category == "attn_v":
        i = counters["attn_v"]
        counters["attn_v"] += 1
        if file_type == "Q2_K":
            kind = "Q4_K" if gqa >= 4 else "Q3_K"
        elif file_type == "Q2_K_S" and gqa >= 4:
            kind = "Q4_K"
        elif file_type == "Q3_K_M":
            kind = "Q5_K" if i < 2 else "Q4_K"
        elif file_type == "Q3_K_L" or (file_type in ("IQ4_NL", "IQ4_XS") and gqa >= 4):
            kind = "Q5_K"
        elif file_type in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n_attn_v):
            kind = "Q6_K"
        elif file_type == "Q4_K_S" and i < 4:
            kind = "Q5_K"
        if is_70b and kind in ("Q3_K", "Q4_K"):
            kind = "Q5_K"
        return "Q8_0" if n_expert == 8 else kind
    if category == "attn_k":
        return "Q8_0" if n_expert == 8 else kind
    if category == "ffn_down":
        i = counters["ffn_down"] if n_expert <= 1 else (tensor.layer or 0)
        counters["ffn_down"] += 1
        n = n_layer
        if file_type == "Q2_K":
            return "Q3_K"
        if file_type == "Q2_K_S":
            return "Q4_K" if i < n // 8 else kind
        if file_type == "Q3_K_M":
            return "Q5_K" if i < n // 16 else "Q4_K"
        if file_type == "Q3_K_L":
            return "Q5_K"
        if file_type == "Q4_K_M":
            return "Q6_K" if _more_bits(i, n) else kind
        if file_type in ("IQ4_NL", "IQ4_XS") and i < n // 8:
            return "Q5_K"
        if file_type == "Q5_K_M" and _more_bits(i, n):
            return "Q6_K"
        if file_type == "Q4_K_S" and i < n // 8:
            return "Q5_K"
        return kind
    if category == "attn_output":
        if n_expert == 8:
            return "Q5_K" if file_type in ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS") else kind
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(file_type, kind)
    return kind


# Hugging Face model types whose GGUF memfit writes: llama.cpp's architecture for each
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                 "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3",
                 "gpt_oss": "gpt-oss"}


def _sliding_window(config: dict, arch: str, n_layer: int) -> dict:
    """The window and its layers, as the converter writes them: transformers' layer_types where the config has
    them, else its sliding_window_pattern (Gemma 3: the last of every 6 layers attends over everything)."""
    window = int(config.get("sliding_window") or 0)
    if not window or arch not in WINDOWED:   # llama.cpp runs Mistral's and Qwen's windows as full attention
        return {}
    types = config.get("layer_types")
    pattern = [kind == "sliding_attention" for kind in types] if types else config.get("sliding_window_pattern")
    return {"n_swa": window, "swa_layers": swa_pattern(pattern, arch, n_layer)}


def _experts(name: str, config: dict) -> tuple[int, int, int]:
    """(experts, experts per token, an expert's FFN width) of a mixture of experts; (0, 0, 0) for a dense FFN."""
    n_expert = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if not n_expert:
        return 0, 0, 0
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise MemfitError(f"{name}: dense layers between the mixture-of-experts layers are not modelled.")
    return (n_expert, int(config["num_experts_per_tok"]),
            int(config.get("moe_intermediate_size") or config["intermediate_size"]))


def vision_tower(config: dict) -> VisionTower | None:
    """A SigLIP image encoder's shape from a vision_config (Gemma 3's); None for none or another kind."""
    vision = config.get("vision_config") or {}
    if vision.get("model_type") != "siglip_vision_model":
        return None
    return VisionTower(n_layer=int(vision["num_hidden_layers"]), n_embd=int(vision["hidden_size"]),
                       n_ff=int(vision["intermediate_size"]), n_head=int(vision["num_attention_heads"]),
                       image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
                       channels=int(vision.get("num_channels", 3)))


def from_config(name: str, config: dict, source: str) -> GGUFModel:
    """The tensors llama.cpp's converter writes for a Hugging Face decoder (2-D weights in F16, 1-D in F32), named
    and shaped as llama.cpp loads them (ggml order: the row dimension first), layer by layer."""
    model_type = config.get("model_type", "")
    vision = vision_tower(config)
    config = config.get("text_config", config) if model_type not in ARCHITECTURES else config
    model_type = config.get("model_type", model_type)
    if model_type not in ARCHITECTURES:
        raise MemfitError(f"{name}: a {model_type or 'model'} model's GGUF is not modelled; memfit writes llama.cpp's "
                          f"{', '.join(sorted(ARCHITECTURES))} files (or give a .gguf file).")
    arch = ARCHITECTURES[model_type]
    embd, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or embd // heads)
    ffn, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    n_expert, n_expert_used, ffn_exp = _experts(name, config)
    tied = bool(config.get("tie_word_embeddings", False))
    tensors = [GGUFTensor("token_embd.weight", "F16", (embd, vocab))]
    rope = config.get("rope_scaling") or {}
    if arch == "llama" and rope.get("rope_type", rope.get("type")) == "llama3":
        tensors.append(GGUFTensor("rope_freqs.weight", "F32", (head_dim // 2,)))   # Llama 3.1's frequency factors
    for i in range(layers):
        blk = f"blk.{i}."
        tensors += [GGUFTensor(blk + "attn_norm.weight", "F32", (embd,)),
                    GGUFTensor(blk + "attn_q.weight", "F16", (embd, heads * head_dim)),
                    GGUFTensor(blk + "attn_k.weight", "F16", (embd, kv_heads * head_dim)),
                    GGUFTensor(blk + "attn_v.weight", "F16", (embd, kv_heads * head_dim))]
        if arch in ("qwen2", "gpt-oss"):
            tensors += [GGUFTensor(blk + f"attn_{p}.bias", "F32", (n * head_dim,))
                        for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))]
        if arch.startswith(("qwen3", "gemma3")):
            tensors += [GGUFTensor(blk + f"attn_{p}_norm.weight", "F32", (head_dim,)) for p in ("q", "k")]
        tensors.append(GGUFTensor(blk + "attn_output.weight", "F16", (heads * head_dim, embd)))
        if arch == "gpt-oss":   # the output projection's bias, each head's sink; its FFN is normed by the post-norm
            tensors += [GGUFTensor(blk + "attn_output.bias", "F32", (embd,)),
                        GGUFTensor(blk + "attn_sinks.weight", "F32", (heads,)),
                        GGUFTensor(blk + "post_attention_norm.weight", "F32", (embd,))]
        if arch in ("gemma2", "gemma3"):   # RMS norms after the attention and after the FFN
            tensors += [GGUFTensor(blk + f"{name}.weight", "F32", (embd,))
                        for name in ("post_attention_norm", "post_ffw_norm")]
        if arch != "gpt-oss":
            tensors.append(GGUFTensor(blk + "ffn_norm.weight", "F32", (embd,)))
        if n_expert:   # the router (kept in float32) and each projection's experts stacked in one 3-D tensor
            tensors += [GGUFTensor(blk + "ffn_gate_inp.weight", "F32", (embd, n_expert)),
                        GGUFTensor(blk + "ffn_gate_exps.weight", "F16", (embd, ffn_exp, n_expert)),
                        GGUFTensor(blk + "ffn_up_exps.weight", "F16", (embd, ffn_exp, n_expert)),
                        GGUFTensor(blk + "ffn_down_exps.weight", "F16", (ffn_exp, embd, n_expert))]
            if arch == "gpt-oss":   # the router's bias and each expert's
                tensors += [GGUFTensor(blk + name, "F32", shape) for name, shape in (
                    ("ffn_gate_inp.bias", (n_expert,)), ("ffn_gate_exps.bias", (ffn_exp, n_expert)),
                    ("ffn_up_exps.bias", (ffn_exp, n_expert)), ("ffn_down_exps.bias", (embd, n_expert)))]
        else:
            tensors += [GGUFTensor(blk + "ffn_gate.weight", "F16", (embd, ffn)),
                        GGUFTensor(blk + "ffn_up.weight", "F16", (embd, ffn)),
                        GGUFTensor(blk + "ffn_down.weight", "F16", (ffn, embd))]
    tensors.append(GGUFTensor("output_norm.weight", "F32", (embd,)))
    if not tied:
        tensors.append(GGUFTensor("output.weight", "F16", (embd, vocab)))
    return GGUFModel(name=name, arch=arch, n_layer=layers, n_embd=embd, n_head=heads, n_head_kv=[kv_heads] * layers,
                     head_dim_k=head_dim, head_dim_v=head_dim, n_ff=ffn, n_vocab=vocab,
                     n_ctx_train=int(config.get("max_position_embeddings", 0)), tensors=tensors,
                     n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=ffn_exp,
                     **_sliding_window(config, arch, layers), vision=vision,
                     source=f"{source}, as llama.cpp's converter writes it")
