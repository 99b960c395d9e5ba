"""Ollama's own memory estimate, which chose how many layers its llama.cpp runner put on the GPUs (llm/memory.go's
EstimateGPULayers with fs/ggml's GraphSize, Ollama's repository), replayed by release.

Ollama has sized a load in three ways:
- up to 0.12.10 (and for the models its llama.cpp runner loads, not its own engine, from 0.12.0): this estimate, a
  formula per architecture for the graph, the KV cache at f16 (or the OLLAMA_KV_CACHE_TYPE it was given), one layer
  and a minimum per GPU held in reserve; the "offload to cuda" line of its log prints it (memory.required.*,
  memory.weights.*, memory.graph.*). It is what chooses num_gpu when the Modelfile does not;
- from 0.12.11 (0.12.0 for its own engine's models): a layout, layer by layer, that packs the GPUs evenly on as few
  of them as hold the most layers: for its llama.cpp runner on memory synthesized from the same GraphSize
  (serving/ollama_layout.py), for its own engine on the allocations a trial load measures (memfit has no figures
  of its own engine's);
- from 0.30: llama-server with llama.cpp's --fit (the context it is given, -np its slots, no -ngl unless num_gpu is
  set): serving/llamacpp_fit.py replays that fit.

The estimate, as memory.go has it (the changes by release in ollama_releases.CHANGES, each with its commit):
1. the KV cache: num_ctx x slots cells per layer at 2 bytes (q8_0: 1, q4_0: 0.5, only with flash attention), each
   layer's share added to its size; the graph: the architecture's formula for a full and a partial offload (none
   known: the partial one GQA x KV / 6), a partial one on several GPUs, a full one on Metal;
2. a GPU takes part if its free memory holds its minimum (457 MiB CUDA and ROCm, 512 MiB Metal), the larger graph
   and two layers; it starts with its minimum and one layer (blk.0's) in reserve;
3. the layers, first to last (last to first from 0.7.0), each to the GPU `layer mod GPUs left` while its
   allocation, the larger graph and the layer stay under its free memory (a GPU that refuses one is dropped), then
   the output layer (output_norm and the head, or the tied embedding) where it fits;
4. each GPU with a layer adds the graph (the full offload's when every layer and the output are placed);
   required.partial is what the GPUs hold, required.full that plus what was left off them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memfit.core.errors import MemfitError
from memfit.serving.gguf_file import GGUFModel
from memfit.serving.ollama_releases import NEWEST_ESTIMATE, OllamaRelease, default_num_ctx, default_parallel

MiB, GiB = 1 << 20, 1 << 30
LIBRARIES = {"nvidia": "cuda", "amd": "rocm"}   # a catalog GPU's vendor: the library Ollama's log names
# discover/gpu.go's and gpu_darwin.go's MinimumMemory: held on each GPU besides the layers
MINIMUM_MEMORY = {"cuda": 457 * MiB, "rocm": 457 * MiB, "metal": 512 * MiB}
KV_BYTES = {"f16": 2.0, "q8_0": 1.0, "q4_0": 0.5}   # kvCacheBytesPerElement
GEMMA3_GLOBAL_EVERY = 6   # GraphSize: every sixth Gemma 3 layer attends over the whole context
GPT_OSS_WINDOW = 4096     # GraphSize's window for gpt-oss's even layers

@dataclass
class OllamaGPU:
    free: int                 # the free memory Ollama found (its log's memory.available)
    library: str = "cuda"     # cuda, rocm or metal

    @property
    def minimum(self) -> int:
        return MINIMUM_MEMORY[self.library]


def ollama_gpus(free: list[int], vendor: str | None = None) -> list[OllamaGPU]:
    """GPUs with `free` bytes each of a catalog vendor (None: NVIDIA's), as Ollama names their library."""
    library = LIBRARIES.get(vendor or "nvidia")
    if library is None:
        raise MemfitError(f"Ollama's estimate knows CUDA, ROCm and Metal GPUs, not {vendor}'s.")
    return [OllamaGPU(f, library) for f in free]


@dataclass
class OllamaEstimate:
    """EstimateGPULayers' result, its log's fields in bytes."""
    release: OllamaRelease
    library: str
    requested: int            # num_gpu (-1: Ollama chooses)
    model_layers: int         # layers.model: the blocks and the output layer
    layers: int               # layers.offload: what Ollama sets num_gpu to (0: the CPU alone)
    split: list[int]          # layers per GPU
    available: list[int]
    required_full: int
    required_partial: int
    kv: int
    allocations: list[int]
    weights_total: int
    weights_repeating: int
    weights_nonrepeating: int
    graph_full: int
    graph_partial: int
    projector_weights: int = 0
    projector_graph: int = 0
    notes: list[str] = field(default_factory=list)

    def fields(self) -> dict[str, str]:
        """The log line's fields as Ollama prints them (format.HumanBytes2)."""
        listed = lambda sizes: "[" + " ".join(human_bytes(b) for b in sizes) + "]"   # noqa: E731
        return {"layers.requested": str(self.requested), "layers.model": str(self.model_layers),
                "layers.offload": str(self.layers), "layers.split": ",".join(map(str, self.split))
                if len(self.split) > 1 else "",
                "memory.available": listed(self.available), "memory.required.full": human_bytes(self.required_full),
                "memory.required.partial": human_bytes(self.required_partial),
                "memory.required.kv": human_bytes(self.kv), "memory.required.allocations": listed(self.allocations),
                "memory.weights.total": human_bytes(self.weights_total),
                "memory.weights.repeating": human_bytes(self.weights_repeating),
                "memory.weights.nonrepeating": human_bytes(self.weights_nonrepeating),
                "memory.graph.full": human_bytes(self.graph_full),
                "memory.graph.partial": human_bytes(self.graph_partial)} | ({
                    "projector.weights": human_bytes(self.projector_weights),
                    "projector.graph": human_bytes(self.projector_graph)} if self.projector_weights else {})

    def log_line(self) -> str:
        return f"offload to {self.library} " + " ".join(f'{k}="{v}"' if " " in v or not v else f"{k}={v}"
                                                         for k, v in self.fields().items())


def human_bytes(b: int) -> str:
    """format.HumanBytes2."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b} B"


def layer_groups(model: GGUFModel) -> dict[str, int]:
    """Tensors().Layers(): each tensor's bytes under its group, blk.N for a block's, else its name's first part."""
    groups: dict[str, int] = {}
    for tensor in model.tensors:
        parts = tensor.name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("blk", "mm") and len(parts) > 2 else parts[0]
        groups[key] = groups.get(key, 0) + tensor.nbytes
    return groups


def projector(model: GGUFModel, release: OllamaRelease) -> tuple[int, int]:
    """VisionGraphSize: a multimodal model's image encoder as Ollama's file holds it (the v.* tensors: matrices in
    F16, vectors in F32, as its converter writes them; the mm.* projection is not counted) and its graph (Gemma 3's
    formula: 4 x (image_size^2 x channels + n_embd x patch_size + patches^2 x heads)); (0, 0) without one."""
    vision = model.vision
    if vision is None or model.arch != "gemma3" or not release.has("gemma3_projector"):
        return 0, 0
    embd, ff, patches = vision.n_embd, vision.n_ff, (vision.image_size // vision.patch_size) ** 2
    matrices = vision.n_layer * (4 * embd * embd + 2 * embd * ff) + vision.channels * vision.patch_size ** 2 * embd \
        + patches * embd   # attention, MLP, patch and position embeddings
    vectors = vision.n_layer * (4 * embd + 4 * embd + ff + embd) + embd + 2 * embd   # biases and norms
    graph = 4 * (vision.image_size ** 2 * vision.channels + embd * vision.patch_size
                 + patches * patches * vision.n_head)
    return 2 * matrices + 4 * vectors, graph


def kv_per_layer(model: GGUFModel, release: OllamaRelease, context: int, batch: int, slots: int,
                 kv_type: str) -> list[int]:
    """GraphSize's KV cache, per layer (releases before 0.6.3: the total split evenly, as they added it)."""
    head_k, head_v, per = model.head_dim_k, model.head_dim_v, KV_BYTES.get(kv_type, 2.0)
    heads_kv = max(model.n_head_kv)
    if not release.has("kv_per_layer"):
        total = int(float(context * model.n_layer * (head_k + head_v) * heads_kv) * per)
        return [total // model.n_layer] * model.n_layer
    kv = [int(float(context * (head_k + head_v) * heads_kv) * per)] * model.n_layer
    if model.arch == "gemma3":
        window = slots * model.n_swa + batch
        kv = [kv[i] if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else int(float(window * (head_k + head_v) * heads_kv) * per)
              for i in range(model.n_layer)]
    if model.arch in ("gptoss", "gpt-oss") and release.has("gpt_oss"):
        row = int(float((head_k + head_v) * heads_kv) * per)
        kv = [row * (slots * GPT_OSS_WINDOW + batch) if i % 2 == 0 else row * context for i in range(model.n_layer)]
    return kv


def graph_sizes(model: GGUFModel, release: OllamaRelease, context: int, batch: int, kv_total: int
                ) -> tuple[int, int]:
    """GraphSize's (partial offload, full offload) graph for an architecture it has a formula for, else (0, 0)."""
    arch, embd, vocab, heads = model.arch, model.n_embd, model.n_vocab, model.n_head
    heads_kv, head_k = max(model.n_head_kv), model.head_dim_k
    embd_heads = embd // heads
    blk0 = {t.name[len("blk.0."):]: t for t in model.tensors if t.name.startswith("blk.0.")}
    if arch in ("llama", "llama4", "mistral"):
        full = 4 * batch * (1 + 4 * embd + context * (1 + heads))
        if release.has("graph_logits"):
            full = max(full, 4 * batch * (embd + vocab))
        partial = 4 * batch * embd + max(
            4 * batch * (1 + embd + max(context, embd)) + embd * embd * 9 // 16
            + 4 * context * (batch * heads + embd_heads * heads_kv),
            4 * batch * (embd + vocab) + embd * vocab * 105 // 128)
        if "ffn_gate_exps.weight" in blk0:   # a mixture in one tensor (Mixtral 8x22B's files)
            ff = model.n_ff
            partial = max(3 * blk0["ffn_gate_exps.weight"].nbytes
                          + 4 * batch * (2 * ff + heads_kv + embd + context + embd_heads * heads_kv),
                          4 * (context * batch * heads + context * embd_heads * heads_kv + batch * 1024
                               + embd_heads * heads_kv * batch))
        return partial, full
    if arch in ("gemma", "gemma2", "gemma3"):
        full = max(4 * batch * (embd + vocab),
                   4 * batch * (2 + context + context * heads + 2 * embd + 2 * head_k * heads))
        partial = max(4 * embd * batch + embd * vocab * 105 // 128 + 4 * vocab * batch,
                      4 * batch * (2 * embd + 1 + 2 * head_k * heads + context + context * heads)
                      + 4 * head_k * context * 8 + embd * head_k * heads * 9 // 16)
        return partial, full
    if arch == "qwen2":
        full = max(4 * batch * (embd + vocab), 4 * batch * (1 + 2 * embd + context + context * heads))
        partial = max(4 * batch * (embd + vocab) + embd * vocab * 105 // 128,
                      4 * (batch * (1 + 2 * embd + context * (1 + heads)) + embd * (1 + context)))
        return partial, full
    if arch == "command-r":
        full = max(4 * batch * (embd + vocab), 4 * batch * (2 + 4 * embd + context * (1 + heads)))
        partial = max(4 * batch * (embd + vocab) + embd * vocab * 105 // 128,
                      4 * batch * (1 + 2 * embd + context * (1 + heads)) + 4 * embd * context + embd * embd * 9 // 16)
        return partial, full
    if arch == "phi2":
        full = max(4 * batch * (embd + vocab), 4 * batch * (1 + 4 * embd + context + context * heads))
        partial = max(4 * batch * (2 * embd + vocab) + embd * vocab * 105 // 128,
                      4 * batch * (2 + 3 * embd + context + context * heads))
        return partial, full
    if arch in ("gptoss", "gpt-oss") and release.has("gpt_oss"):
        full = 4 * heads // max(min(model.n_head_kv), 1) * kv_total // 6
        return full, full
    return 0, 0


def estimate_ollama(model: GGUFModel, gpus: list[OllamaGPU], *, release: OllamaRelease = NEWEST_ESTIMATE,
                    num_ctx: int = 2048, parallel: int = 1, num_batch: int = 512, num_gpu: int = -1,
                    kv_type: str = "f16", overhead: int = 0) -> OllamaEstimate:
    """EstimateGPULayers for `model` on `gpus` (one library), num_ctx per slot, OLLAMA_GPU_OVERHEAD `overhead`;
    kv_type other than f16 only where flash attention is on (OLLAMA_FLASH_ATTENTION), as Ollama takes it."""
    if not gpus:
        raise MemfitError("Ollama's estimate needs a GPU (its free memory).")
    if release.sizing != "estimate":
        raise MemfitError(f"Ollama {release.name} sizes a load by "
                          + ("llama.cpp's --fit" if release.sizing == "fit" else "its layout (layout_ollama)")
                          + ", not by its estimate.")
    library = gpus[0].library
    projector_weights, projector_graph = projector(model, release)
    if projector_weights and release.has("projector_with_output"):
        num_ctx = max(num_ctx, 2048)   # multimodal models need at least 2048 (per slot, as the caller gives it)
    context, batch = num_ctx * parallel, min(num_ctx * parallel, num_batch)
    groups = layer_groups(model)
    n_layer = model.n_layer
    kv = kv_per_layer(model, release, context, batch, parallel, kv_type)
    kv_total = sum(kv)
    partial, full = graph_sizes(model, release, context, batch, kv_total)
    notes = []
    if not partial:
        heads_kv = max(min(model.n_head_kv) if release.has("kv_per_layer") else max(model.n_head_kv), 1)
        partial = model.n_head // heads_kv * kv_total // 6
        notes.append(f"Ollama has no graph formula for {model.arch}: its fallback, GQA x KV / 6")
    full = full or partial
    if library == "metal":
        partial = full
    elif len(gpus) > 1:
        full = partial
    graph = max(partial, full)
    if release.has("largest_layer_reserve"):
        reserve = max(groups.values())
    else:
        reserve = groups.get("blk.0", 0)
    reserve += kv[0]
    output = groups.get("output_norm", 0) + groups.get("output", groups.get("token_embd", 0))
    # the projector: with the output layer from 0.7.1 (its own engine's), before on the first GPU with room
    zero_overhead = 0 if release.has("projector_with_output") else projector_weights + projector_graph
    last_layer = output + (projector_weights + projector_graph if release.has("projector_with_output") else 0)

    allocations = [0] * len(gpus)
    counts = [0] * len(gpus)
    with_space: list[int] = []
    for i, gpu in enumerate(gpus):
        zero = zero_overhead if not with_space else 0
        if gpu.free < overhead + zero + graph + gpu.minimum + 2 * reserve:
            continue   # too little memory for any layer
        with_space.append(i)
        allocations[i] += gpu.minimum + reserve
    overflow = 0
    if with_space:
        allocations[with_space[0]] += zero_overhead
    elif release.has("output_always_counted"):
        overflow += zero_overhead

    def on_a_gpu(size: int, index: int, *, drop: bool) -> bool:
        """A layer of `size` onto the GPU `index` mod the GPUs left, or the next one with room; a GPU without room
        is dropped for the layers after (`drop`)."""
        for j in range(len(with_space), 0, -1):
            g = with_space[index % j]
            if gpus[g].free > overhead + allocations[g] + graph + size:
                allocations[g] += size
                counts[g] += 1
                return True
            if drop:
                del with_space[index % j]
        return False

    placed, weights = 0, 0
    layer_size = reserve
    order = range(n_layer - 1, -1, -1) if release.has("last_layer_first") else range(n_layer)
    for i in order:
        if f"blk.{i}" in groups:
            layer_size = groups[f"blk.{i}"] + kv[i]
            weights += groups[f"blk.{i}"] if release.has("weights_without_kv") else layer_size
        elif not release.has("weights_without_kv"):
            weights += layer_size
        if 0 <= num_gpu <= placed:
            if release.has("last_layer_first"):
                overflow += layer_size
            continue
        placed += on_a_gpu(layer_size, i, drop=True)
        if release.has("last_layer_first") and not with_space:
            overflow += layer_size
    fully = placed >= n_layer
    if not fully and not release.has("last_layer_first"):
        overflow += (n_layer - placed) * layer_size
    if last_layer:
        if num_gpu < 0 or placed < num_gpu:
            placed += on_a_gpu(last_layer, placed, drop=False)
            if placed < n_layer + 1:
                fully = False
                overflow += last_layer
        elif release.has("output_always_counted") and placed < n_layer + 1:
            fully = False
            overflow += last_layer
    for i in range(len(gpus)):
        if counts[i] > 0:
            allocations[i] += full if fully else partial
    vram = sum(allocations) if placed else 0   # no layer placed: Ollama reports no GPU memory (the CPU runs it)
    total = sum(allocations) + overflow
    with_output = release.has("weights_total_with_output")
    return OllamaEstimate(
        release=release, library=library, requested=num_gpu, model_layers=n_layer + 1, layers=placed,
        split=counts if placed else [0] * len(gpus), available=[g.free for g in gpus], required_full=total,
        required_partial=vram, kv=kv_total,
        allocations=allocations, weights_total=weights + output if with_output else weights,
        weights_repeating=weights if release.has("weights_without_kv") else weights - output,
        weights_nonrepeating=output, graph_full=full, graph_partial=partial, projector_weights=projector_weights,
        projector_graph=projector_graph, notes=notes)


def schedule_ollama(model: GGUFModel, gpus: list[OllamaGPU], *, release: OllamaRelease = NEWEST_ESTIMATE,
                    num_ctx: int | None = None, parallel: int | None = None, num_gpu: int = -1,
                    num_batch: int = 512, kv_type: str = "f16") -> tuple[OllamaEstimate, int, list[int]]:
    """The first load of a model as Ollama's scheduler makes it (server/sched.go): with OLLAMA_NUM_PARALLEL unset,
    its default slots and then 1; the largest GPU alone where the whole model fits, else every GPU where it fits,
    else a partial load on every GPU (one slot unless set). Returns the estimate its runner logs and loads by, the
    slots and the GPUs (indices into `gpus`). num_ctx is per slot (default: the release's), capped by the training
    context as Ollama caps it."""
    if num_ctx is None:
        num_ctx = default_num_ctx(release, sum(g.free for g in gpus))
    tries = [parallel] if parallel else [default_parallel(release), 1]

    def estimate(chosen: list[int], slots: int) -> OllamaEstimate:
        ctx = min(num_ctx, model.n_ctx_train) if model.n_ctx_train else num_ctx
        return estimate_ollama(model, [gpus[i] for i in chosen], release=release, num_ctx=ctx, parallel=slots,
                               num_batch=num_batch, num_gpu=num_gpu, kv_type=kv_type)

    def fits(result: OllamaEstimate) -> bool:   # PredictServerFit
        wanted = model.n_layer + 1 if num_gpu < 0 else num_gpu
        return result.layers > 0 and result.layers >= wanted

    by_free = sorted(range(len(gpus)), key=lambda i: -gpus[i].free)
    for slots in tries if len(gpus) > 1 else []:
        for i in by_free:
            if fits(result := estimate([i], slots)):
                return result, slots, [i]
    for slots in tries:
        if fits(result := estimate(by_free, slots)):
            return result, slots, by_free
    slots = parallel or 1
    everyone = list(range(len(gpus)))
    return estimate(everyone, slots), slots, everyone
