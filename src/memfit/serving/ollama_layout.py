"""Ollama's layout (0.12.11 to 0.2x, f560bd077): the layers its llama.cpp runner puts on each GPU, replayed from
llm/server.go (llamaServer.Load, buildLayout, assignLayers, findBestFit, greedyFit) on the memory it synthesizes from
GraphSize (serving/ollama.py): each layer's weights and KV, the output layer's weights, blk.0 and its KV held back on
every GPU, each GPU used keeping the larger graph; as few GPUs as hold the most layers, spread evenly by a bisection
on the share of each GPU's free memory they may fill."""
from __future__ import annotations

from dataclasses import dataclass

from memfit.core.errors import MemfitError
from memfit.serving.gguf_file import GGUFModel
from memfit.serving.ollama import OllamaGPU, graph_sizes, human_bytes, kv_per_layer, layer_groups
from memfit.serving.ollama_releases import OllamaRelease


@dataclass
class OllamaLayout:
    """The layout Ollama's llama runner loads by from 0.12.11 (llm/server.go: llamaServer.Load, buildLayout,
    assignLayers, findBestFit, greedyFit), on the memory it synthesizes from GraphSize: the layers (n_layer + 1
    slots, the last the output layer) each GPU takes, and its log's "model weights", "kv cache" and "compute graph"
    lines per device."""
    release: OllamaRelease
    library: str
    gpu_layers: list[tuple[int, list[int]]]   # (GPU index into the list given, its layer slots), as Ollama lists them
    layer_weights: list[int]                   # per slot: its weights (the output layer's last)
    layer_cache: list[int]                     # per slot: its KV cache
    graph: int                                 # the compute graph each GPU with layers is given

    @property
    def layers(self) -> int:
        return sum(len(slots) for _, slots in self.gpu_layers)

    def per_gpu(self, gpus: int) -> list[int]:
        """Each GPU's layer count, in the order given."""
        counts = [0] * gpus
        for g, slots in self.gpu_layers:
            counts[g] += len(slots)
        return counts

    def log_lines(self) -> list[str]:
        name = {"cuda": "CUDA", "rocm": "ROCm", "metal": "Metal"}[self.library]
        on_gpu = {g: slots for g, slots in self.gpu_layers if slots}
        graphs = sorted({g for g, _ in self.gpu_layers})   # every GPU listed gets the graph, even one with no layer
        held = {slot for slots in on_gpu.values() for slot in slots}
        lines = []
        for label, per_slot in (("model weights", self.layer_weights), ("kv cache", self.layer_cache)):
            for g, slots in sorted(on_gpu.items()):
                lines.append(f'msg="{label}" device={name}{g} size="{human_bytes(sum(per_slot[i] for i in slots))}"')
            cpu = sum(b for i, b in enumerate(per_slot) if i not in held)
            if cpu:
                lines.append(f'msg="{label}" device=CPU size="{human_bytes(cpu)}"')
        for g in graphs:
            lines.append(f'msg="compute graph" device={name}{g} size="{human_bytes(self.graph)}"')
        total = sum(self.layer_weights) + sum(self.layer_cache) + self.graph * len(graphs)
        lines.append(f'msg="total memory" size="{human_bytes(total)}"')
        return lines


def _f32(x: float) -> float:
    import numpy as np

    return float(np.float32(x))


def _greedy_fit(layers: list[int], free: list[int], capacity: float, requested: int) -> list[tuple[int, list[int]]]:
    """greedyFit: the last layers to the last GPU (the least free), spilling to the one before; each GPU's room its
    free memory x capacity (float32, as Go computes it)."""
    device = len(free) - 1
    result: list[tuple[int, list[int]]] = [(device, [])]
    room = int(_f32(_f32(free[device]) * capacity))
    for i in range(len(layers) - 1, -1, -1):
        if requested >= 0 and len(layers) - 1 - i >= requested:
            break
        while True:
            if layers[i] <= room:
                result[0][1].insert(0, i)
                room -= layers[i]
                break
            device -= 1
            if device < 0:
                return result
            result.insert(0, (device, []))
            room = int(_f32(_f32(free[device]) * capacity))
    return result


def _placed(assignment: list[tuple[int, list[int]]]) -> int:
    return sum(len(slots) for _, slots in assignment)


def _best_fit(layers: list[int], free: list[int], requested: int, force: bool) -> list[tuple[int, list[int]]]:
    """findBestFit (every GPU discrete: one performance group): the least capacity factor, by bisection in float32,
    that still places as many layers as the whole of each GPU would, which spreads them evenly."""
    high, low = _f32(1000.0 if requested >= 0 and force else 1.0), _f32(0.0)
    best = _greedy_fit(layers, free, high, requested)
    most = _placed(best)
    while _f32(high - low) > 1e-6:
        mid = _f32(_f32(low + high) / 2)
        assignment = _greedy_fit(layers, free, mid, requested)
        if _placed(assignment) == most:
            high, best = mid, assignment
        else:
            low = mid
    return best


def _assign_layers(layers: list[int], free: list[int], requested: int, last_used: int
                   ) -> list[tuple[int, list[int]]]:
    """assignLayers (requireFull off: the first model loaded): as few GPUs as hold the most layers; failing all of
    them, once more without the output layer."""
    assignment: list[tuple[int, list[int]]] = []
    for _ in range(2):
        requested = min(len(layers), requested)
        for i in range(last_used, len(free)):
            assignment = _best_fit(layers, free[:i + 1], requested, force=i == len(free) - 1)
            if _placed(assignment) in (len(layers), requested):
                break
        if _placed(assignment) == len(layers):
            return assignment
        layers = layers[:-1]
    return assignment


def layout_ollama(model: GGUFModel, gpus: list[OllamaGPU], *, release: OllamaRelease, num_ctx: int = 4096,
                  parallel: int = 1, num_batch: int = 512, num_gpu: int = -1, kv_type: str = "f16",
                  overhead: int = 0) -> OllamaLayout:
    """llamaServer.Load's layout for `model` on `gpus`: the memory synthesized from GraphSize (each layer's weights
    and KV, the output layer's weights, blk.0 and its KV held back on every GPU), then layouts built until the GPUs
    used stop growing, each GPU used reserving the larger graph."""
    if release.sizing != "layout":
        raise MemfitError(f"Ollama {release.name} does not lay out its llama runner's layers this way (0.12.11 to "
                          "0.2x do).")
    context, batch = num_ctx * parallel, min(num_batch, num_ctx)
    groups = layer_groups(model)
    kv = kv_per_layer(model, release, context, batch, parallel, kv_type)
    partial, full = graph_sizes(model, release, context, batch, sum(kv))
    if not partial:
        partial = model.n_head // max(min(model.n_head_kv), 1) * sum(kv) // 6
    full = full or partial
    if gpus and gpus[0].library == "metal":
        partial = full
    weights = [groups.get(f"blk.{i}", 0) for i in range(model.n_layer)]
    weights.append(groups.get("output_norm", 0) + groups.get("output", groups.get("token_embd", 0)))
    cache = kv + [0]
    slots = [w + c for w, c in zip(weights, cache)]
    buffer = groups.get("blk.0", 0) + kv[0]
    free = [max(g.free - buffer, 0) for g in gpus]
    order = sorted(range(len(gpus)), key=lambda i: -free[i])   # buildLayout: the most free first
    graphs = [0] * len(gpus)
    assignment: list[tuple[int, list[int]]] = []
    while True:
        previous = assignment
        last_used = max((k for k, g in enumerate(order) if graphs[g]), default=0)
        room = [max(free[g] - (gpus[g].minimum + overhead + graphs[g]), 0) for g in order]
        assignment = [(order[k], slots_) for k, slots_ in _assign_layers(slots, room, num_gpu, last_used)]
        if len(assignment) <= len(previous):
            break
        for g, _ in assignment:
            graphs[g] = max(partial, full)
    graph = full if _placed(assignment) >= len(slots) else partial
    return OllamaLayout(release=release, library=gpus[0].library if gpus else "cuda", gpu_layers=assignment,
                        layer_weights=weights, layer_cache=cache, graph=graph)
