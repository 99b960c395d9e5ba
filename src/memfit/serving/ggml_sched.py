"""Each device's part of a graph split between devices: which nodes ggml's scheduler (ggml-backend.cpp,
ggml_backend_sched_split_graph) runs on it, and the compute buffer that part reserves there.

The scheduler's passes, as far as an attention decoder's graph needs them:
1. a node that writes into a pre-allocated tensor (the KV cache) runs on that tensor's device; a node that reads a
   weight runs on the weight's device (RoPE excepted), unless the weight is the CPU's, the op works on 32 rows or more
   and the first GPU offloads such ops (CUDA's offload_op; an RPC device has none; --no-op-offload: none); graph
   inputs are the CPU's;
2. the rest take the device of the nearest assigned node before them, then after them, GPUs first (views skipped);
3. a split ends where the device changes, or where a node reads another device's weight once the split has inputs;
   each split copies in what it reads from another device (once per device), at its start; a copy is freed after its
   last use, and is its source's last use there. Several GPUs holding every layer pipeline the graph: every copy,
   and every graph input, is then held four times and never freed.
Each part's buffer is ggml's allocator replayed on it (ggml_graph.allocate). Checked against llama.cpp's own dry runs
on RPC devices here (benchmarks/llamacpp_fit_run.py), which offload no op: the op-offload rule is ggml-cuda's, as its
source states it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from memfit.serving.ggml_graph import (
    CPU_ALIGNMENT,
    GPU_ALIGNMENT,
    Graph,
    Tensor,
    allocate,
    decoder_graph,
    graph_key,
)

if TYPE_CHECKING:
    from memfit.serving.gguf_file import GGUFModel
    from memfit.serving.llamacpp import KVCache, LlamaCppSettings

OFFLOAD_BATCH = 32   # ggml-cuda's min batch size for offloading an op on host weights


def home(tensor: Tensor) -> str:
    """The name of the tensor in another buffer (a weight or a cache) that `tensor` is or views."""
    return (tensor.view_of or tensor).name


def _device_of_node(node: Tensor, device_of: Callable[[str], str], op_offload: str | None, tokens: int,
                    attention_on_cpu: bool) -> str | None:
    """Pass 1: the device a node must run on, if any."""
    if node.external:   # written into the cache (a view of it)
        return device_of(home(node.srcs[0]))
    if attention_on_cpu and node.name == "kqv_out":   # --no-kv-offload: llama.cpp sets its backend to the CPU
        return "CPU"
    for src in node.srcs:
        if node.op == "ROPE" or not src.external or home(src).startswith("cache_"):
            continue
        device = device_of(home(src))
        if device == "CPU" and op_offload and node.op != "GET_ROWS" and tokens >= OFFLOAD_BATCH:
            return op_offload   # ggml-cuda's offload_op: any op on a batch of 32 rows or more, but a lookup
        return device
    return None


def assign(graph: Graph, device_of: Callable[[str], str], *, op_offload: str | None, tokens: int,
           attention_on_cpu: bool = False) -> dict[Tensor, str]:
    """Each node's device (views: their source's). `attention_on_cpu`: the attention's output (without flash
    attention) set to the CPU, as llama.cpp does with --no-kv-offload."""
    assigned: dict[Tensor, str] = {tensor: "CPU" for tensor in graph.inputs}
    for node in graph.nodes:
        device = _device_of_node(node, device_of, op_offload, tokens, attention_on_cpu)
        if device is not None:
            assigned[node] = device
    computing = [node for node in graph.nodes if node.view_of is None]   # views are skipped
    for gpus_only in (True, False):   # expand the GPUs' nodes down and up, then any device's
        for order in (computing, computing[::-1]):
            current = None
            for node in order:
                if node in assigned:
                    current = None if gpus_only and assigned[node] == "CPU" else assigned[node]
                elif current is not None:
                    assigned[node] = current
    for node in graph.nodes:   # views: their source's device
        if node not in assigned:
            assigned[node] = assigned.get(node.view_of or node.srcs[0], "CPU") if node.srcs else "CPU"
    return assigned


def _split_graph(graph: Graph, assigned: dict[Tensor, str], where: Callable[[Tensor], str]
                 ) -> list[tuple[str, list[Tensor], list[Tensor]]]:
    """ggml's pass 5: the splits in order, each (its device, the nodes in its range, the tensors it copies in). A
    split ends where the device changes, or where a node reads a weight of another device once the split has inputs
    (so that the copied weights' memory is reused); views are skipped. A tensor is copied to a device once."""
    splits: list[tuple[str, list[Tensor], list[Tensor]]] = []
    copied: set[tuple[Tensor, str]] = set()
    for node in graph.nodes:
        if node.view_of is None:
            device = assigned[node]
            foreign = any(src.external and not home(src).startswith("cache_") and where(src) != device
                          for src in node.srcs)
            if not splits or device != splits[-1][0] or (foreign and splits[-1][2]):
                splits.append((device, [], []))
            for src in node.srcs:
                if where(src) != device and (src, device) not in copied:
                    copied.add((src, device))
                    splits[-1][2].append(src)
        elif not splits:
            splits.append((assigned[node], [], []))
        splits[-1][1].append(node)
    return splits


def device_parts(graph: Graph, assigned: dict[Tensor, str], devices: list[str], device_of: Callable[[str], str],
                 n_copies: int = 1) -> dict[str, Graph]:
    """Each device's part of `graph`: the nodes it runs, each of its splits' copies of what it reads from other
    devices (a weight or a cache view another device holds, too) placed at the split's start; where another device's
    split copies one of this device's tensors, the copy is that tensor's last use here. With pipeline parallelism
    (`n_copies` > 1) every copy, and every graph input, is held `n_copies` times and never freed. The parts are
    built from clones: `graph` is left as it was."""
    def where(tensor: Tensor) -> str:
        return device_of(home(tensor)) if tensor.external else assigned.get(tensor, "CPU")

    parts = {device: Graph() for device in devices}
    mine: dict[str, dict[Tensor, Tensor]] = {device: {} for device in devices}   # the device's clone of each node
    for tensor in graph.inputs:
        device = assigned[tensor]
        if device in parts:
            held = [Tensor(tensor.name if c == 0 else f"{tensor.name} #{c}", tensor.nbytes, is_input=True,
                           is_output=n_copies > 1) for c in range(n_copies)]
            mine[device][tensor] = held[0]
            parts[device].inputs += held
    copies: dict[tuple[str, Tensor], Tensor] = {}

    def clone(node: Tensor) -> Tensor:
        """The node in its device's part (once), reading that device's copies of what others made."""
        device, clones = assigned[node], mine[assigned[node]]
        if node not in clones:
            srcs = [copies[device, src] if where(src) != device else clones.get(src, src) for src in node.srcs]
            view_of = clones.get(node.view_of, node.view_of) if node.view_of is not None else None
            clones[node] = Tensor(node.name, node.nbytes, node.op, srcs, view_of, node.external, node.is_input,
                                  node.is_output)
            parts[device].nodes.append(clones[node])
        return clones[node]

    for owner, nodes, inputs in _split_graph(graph, assigned, where):
        for src in inputs:
            if owner in parts:
                held = [Tensor(f"{src.name} (copy {c})", src.nbytes, is_input=True, is_output=n_copies > 1)
                        for c in range(n_copies)]
                copies[owner, src] = held[0]
                parts[owner].nodes.extend(held)
            source = where(src)   # the copy reads the tensor where it is: its last use there, perhaps
            if source != owner and source in parts and not src.external:
                made = mine[source].get(src) or (clone(src) if src.view_of is not None else src)
                parts[source].nodes.append(Tensor(f"{src.name} (copied)", 0, "NONE", [made]))
        for node in nodes:
            if assigned[node] in parts:
                clone(node)
    return parts


def split_compute_bytes(model: GGUFModel, settings: LlamaCppSettings, *, n_ctx: int, kv: KVCache,
                        flash_attn: bool, device_of: Callable[[str], str], weight_bytes: Callable[[str], int],
                        devices: list[str], op_offload: str | None, n_copies: int = 1, placement: tuple = ()
                        ) -> dict[str, int]:
    """The compute buffer each of `devices` reserves for its part of the worst-case graphs (a full ubatch, one
    token), each weight and cache on the device `device_of` names (`weight_bytes`: a weight's copy on a GPU;
    `n_copies`: pipeline parallelism's). `placement`: what else the result depends on (where each weight and cache
    is, the copied weights' sizes): with it, a repeated question is answered once."""
    key = (graph_key(model, settings, n_ctx=n_ctx, kv=kv, flash_attn=flash_attn), settings.cache_type_k,
           settings.cache_type_v, settings.no_kv_offload, tuple(devices), op_offload, n_copies, placement)
    if placement and key in _SPLIT:
        return dict(_SPLIT[key])
    device_of = functools.lru_cache(maxsize=None)(device_of)
    sizes = dict.fromkeys(devices, 0)
    for tokens in (settings.n_ubatch_at(n_ctx), 1):
        graph = decoder_graph(model, tokens, kv=kv, flash_attn=flash_attn, settings=settings)
        for node in graph.nodes:
            for src in node.srcs:
                if src.external and not src.nbytes and not home(src).startswith("cache_"):
                    src.nbytes = weight_bytes(home(src))
        assigned = assign(graph, device_of, op_offload=op_offload, tokens=tokens,
                          attention_on_cpu=settings.no_kv_offload and not flash_attn)
        for device, part in device_parts(graph, assigned, devices, device_of, n_copies).items():
            sizes[device] = max(sizes[device], allocate(part, CPU_ALIGNMENT if device == "CPU" else GPU_ALIGNMENT))
    if placement:
        _SPLIT[key] = dict(sizes)
    return sizes


_SPLIT: dict[tuple, dict[str, int]] = {}   # each device's compute buffer by the graph, settings and placement
