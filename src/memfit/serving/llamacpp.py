"""What llama.cpp allocates when it loads a GGUF model with given settings: each buffer its load log prints, on the
device llama.cpp puts it (llama.cpp's names: --ctx-size, --n-gpu-layers, --n-ubatch, --cache-type-k, ...).

Rules, as llama.cpp's sources (llama-model.cpp, llama-context.cpp, llama-kv-cache.cpp; the release llama-cpp-python
0.3.36 vendors) state them and its load logs here show them (benchmarks/llamacpp_cpu_run.py):
- weights: the token embedding stays on the CPU; with -ngl N the last N of the n_layer + 1 slots (the extra one
  the output head) go to the GPUs, each taking the next run of them in proportion to its --tensor-split share. A
  tied embedding is loaded a second time as the head, on the head's device. --n-cpu-moe N keeps the experts
  (ffn_*_exps) of the first N layers on the CPU; --override-tensor puts the weights a pattern names where it says.
- KV cache: n_ctx rounded up as the release pads it (to 256 now; llamacpp_releases.py); split over --parallel
  streams unless unified (each stream n_ctx / streams, rounded up); per layer cells x (n_head_kv x head_dim_k in
  type_k's bytes + the same for V), on the layer's device unless --no-kv-offload.
- output buffer: n_vocab floats per sequence slot (the logits of the last token of each), in host memory.
- the CPU's repacked weights: an x86 CPU with AVX2 copies the Q4_0, Q4_K, IQ4_NL and MXFP4 weights it multiplies
  (with AVX-512 the Q2_K ones too) into its own layout (the CPU_REPACK buffer, as large as they are; their mapped
  pages stay as page cache, which the process's resident size shows until the system needs the memory).
- compute buffer: ggml's graph allocator replayed on the worst-case ubatch graph (serving/ggml_graph.py); with
  several devices, on each device's part of it as ggml's scheduler splits it (serving/ggml_sched.py).
- sliding-window layers (Gemma 2 and 3, gpt-oss): their own cache of each slot's window plus a ubatch (swa_cells).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from memfit.core.errors import MemfitError
from memfit.serving.ggml_graph import compute_buffer_bytes
from memfit.serving.ggml_sched import split_compute_bytes
from memfit.serving.gguf_file import WINDOWED, GGUFModel, GGUFTensor, read_gguf, row_bytes, type_size
from memfit.serving.gguf_recipe import FILE_TYPES, from_config, quantize
from memfit.serving.llamacpp_releases import Release

# llama.cpp architectures whose graph memfit replays (mistral's and Mixtral's are llama's)
GRAPHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "gpt-oss")
# the ggml types llama.cpp's --cache-type-k/-v take (common/arg.cpp), by ggml's names; the flags take them lowercase
CACHE_TYPES = tuple(name.lower() for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "Q5_0", "Q5_1"))
FLASH_ATTN = ("on", "off", "auto")
# the types ggml's CPU backend repacks for its x86 AVX2 kernels (ggml-cpu/repack.cpp), a weight of rows in eights;
# with AVX-512 Q2_K too
REPACKED = ("Q4_0", "Q4_K", "IQ4_NL", "MXFP4")
REPACKED_AVX512 = ("Q2_K",)
CUDA_ROW_PADDING = 512   # ggml-cuda's MATRIX_ROW_PADDING (elements)
CUDA_ALIGNMENT = 128     # ggml-cuda's buffer alignment
PIPELINE_COPIES = 4      # ggml-backend's GGML_SCHED_MAX_COPIES: the copies a pipelined graph keeps of its inputs


@dataclass(frozen=True)
class LlamaCppSettings:
    """llama.cpp's load settings with its own names and its defaults (llama-server's, current release)."""
    ctx_size: int | None = None      # None (llama.cpp's 0): the context the model was trained with
    n_gpu_layers: int = -1           # -1: every layer (llama-server's default)
    n_batch: int = 2048
    n_ubatch: int = 512
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    parallel: int = 1
    kv_unified: bool = False
    no_kv_offload: bool = False
    no_op_offload: bool = False      # --no-op-offload: a GPU never runs a prompt's products on weights the CPU holds
    # several GPUs holding every layer pipeline the graph where each has async compute and events (CUDA's do; RPC
    # servers of 2024-2025 builds did not): not a flag of llama.cpp's
    pipeline: bool = True
    embeddings: bool = False         # --embeddings: the output buffer holds each slot's embedding too (Ollama's runner)
    cpu_avx512: bool = False         # the host CPU has AVX-512 (ggml repacks Q2_K weights too): not a llama.cpp flag
    n_cpu_moe: int = 0               # the experts of the first N layers kept on the CPU (-1: every layer's, --cpu-moe)
    swa_full: bool = False           # --swa-full: the sliding-window layers' cache as large as the others
    tensor_split: tuple[float, ...] | None = None   # --tensor-split: each GPU's share of the layers (None: equal)
    # --override-tensor: (pattern, device) pairs, the first whose pattern a weight's name contains decides its device
    override_tensor: tuple[tuple[str, str], ...] = ()
    engine_version: str | None = None   # the build's date, YYYY-MM[-DD]; None: the newest modelled

    def __post_init__(self) -> None:
        if self.tensor_split is not None and (not self.tensor_split or min(self.tensor_split) < 0
                                              or not sum(self.tensor_split)):
            raise MemfitError("--tensor-split: each GPU's share, 0 or more, not all 0 (e.g. 3,1).")
        if self.n_cpu_moe < -1:
            raise MemfitError(f"--n-cpu-moe {self.n_cpu_moe}: the number of layers whose experts stay on the CPU (0 "
                              "or more).")
        for name in ("ctx_size", "n_batch", "n_ubatch", "parallel"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise MemfitError(f"--{name.replace('_', '-')} {getattr(self, name)}: it takes a whole number of 1 or "
                                  "more.")
        for name in ("cache_type_k", "cache_type_v"):
            if getattr(self, name) not in CACHE_TYPES:
                raise MemfitError(f"--{name.replace('_', '-')} {getattr(self, name)}: llama.cpp's cache types are "
                                  f"{', '.join(CACHE_TYPES)}.")
        if self.flash_attn not in FLASH_ATTN:
            raise MemfitError(f"--flash-attn {self.flash_attn}: on, off or auto.")
        for pattern, device in self.override_tensor:
            try:
                re.compile(pattern)
            except re.error as error:
                raise MemfitError(f"--override-tensor {pattern}={device}: not a regular expression ({error}).") \
                    from None
            if not re.fullmatch(r"CPU|GPU\d+", device):
                raise MemfitError(f"--override-tensor {pattern}={device}: the device is CPU or GPU0, GPU1, ...")
        Release(self.engine_version)   # a malformed version: one line

    @property
    def release(self) -> Release:
        return Release(self.engine_version)

    @property
    def flash(self) -> bool:
        """auto: on where every backend runs it (the CPU's and CUDA's do)."""
        return self.flash_attn != "off"

    def n_ubatch_at(self, n_ctx: int) -> int:
        """The ubatch llama_context uses: a causal model's batch is at most its context."""
        return min(self.n_ubatch, self.n_batch, n_ctx)


@dataclass
class Buffers:
    """One device's buffers, in bytes."""
    device: str
    model: int = 0
    kv: int = 0
    compute: int = 0
    output: int = 0
    repack: int = 0                  # of `model`, what the CPU copies into its own layout (CPU_REPACK)

    @property
    def total(self) -> int:
        """What the device needs: a repacked weight counts once (its mapped pages are page cache, dropped when
        memory is short)."""
        return self.model + self.kv + self.compute + self.output


@dataclass
class KVCache:
    cells: int                       # per stream
    streams: int
    layer_bytes: list[int]           # K and V of each layer (0: a layer with no cache)
    swa_cells: int = 0               # per stream, of the sliding-window layers' own cache (0: none)

    @property
    def bytes(self) -> int:
        return sum(self.layer_bytes)


@dataclass
class LlamaCppEstimate:
    model: str
    source: str                      # the .gguf file, or the recipe the tensors came from
    engine: str
    settings: LlamaCppSettings
    n_ctx: int
    n_layer: int
    layers_on_gpu: int
    kv: KVCache
    buffers: dict[str, Buffers]      # by device: "CPU", "GPU0", ...
    weights_bytes: int
    placement: dict[str, str] = field(default_factory=dict)   # each weight's device ("CPU", "GPU0")
    notes: list[str] = field(default_factory=list)


def gguf_model(model, quant: str | None = None) -> GGUFModel:
    """A .gguf file's model (read from its header), or a Hugging Face model (a catalog name, config.json, folder,
    hub id, or a notebook's config: a transformers config or its dict) as llama.cpp's tools would write it in `quant`
    (a file type such as Q4_K_M)."""
    from memfit.specs.model_configs import find_config

    if hasattr(model, "to_dict"):   # a transformers config (model.config in a notebook)
        model = model.to_dict()
    if isinstance(model, dict):
        if not quant:
            raise MemfitError(f"a config given: which GGUF? Give quant= (one of {', '.join(FILE_TYPES)}).")
        name = str(model.get("_name_or_path") or model.get("model_type") or "the config given")
        return quantize(from_config(name, model, "the config given"), quant)
    if not isinstance(model, str) or not model.strip():
        raise MemfitError(f"name a .gguf file or a model (memfit models lists them), got {model!r}.")
    if model.endswith(".gguf"):
        if quant:
            raise MemfitError(f"--quant {quant}: {model} is already quantized (its header gives each tensor's type); "
                              "--quant writes a Hugging Face model's GGUF.")
        return read_gguf(model)
    if "/" in model and "gguf" in model.lower() and not model.endswith(".json"):
        raise MemfitError(f"{model} names a repository of GGUF files on the hub: memfit reads one .gguf file's header, "
                          "and the hub is not reached from here. Download the file you run (the repository's Files "
                          "tab) and give its path, or name the base model with --quant.")
    if not quant:
        raise MemfitError(f"{model}: which GGUF? Give --quant (one of {', '.join(FILE_TYPES)}), or a .gguf file.")
    found = find_config(model)
    if found is None:
        raise MemfitError(f"{model!r}: not a .gguf file, a catalog name (memfit models), a config.json or a hub id.")
    vision = {"vision_config": found.doc["vision_config"]} if "vision_config" in found.doc else {}
    return quantize(from_config(found.name, {**found.hf_config, **vision}, found.where), quant)


def gpu_tensor_bytes(tensor: GGUFTensor) -> int:
    """A weight's bytes in a CUDA buffer: a quantized row length not a multiple of 512 gets one row's padding up to
    it (ggml-cuda's get_alloc_size, MATRIX_ROW_PADDING), and every tensor starts 128-byte aligned."""
    size = tensor.nbytes
    block = type_size(tensor.type)[0]
    if block > 1 and tensor.shape[0] % CUDA_ROW_PADDING:
        size += row_bytes(tensor.type, CUDA_ROW_PADDING - tensor.shape[0] % CUDA_ROW_PADDING)
    return -(-size // CUDA_ALIGNMENT) * CUDA_ALIGNMENT


def padded_ctx(settings: LlamaCppSettings, flash_attn: bool) -> tuple[int, int, int]:
    """(n_ctx, cells per stream, streams) as llama_context and its KV cache set them in the release (the context
    given: estimate_llamacpp resolves llama.cpp's 0)."""
    release, asked = settings.release, settings.ctx_size or 0
    n_ctx = release.cells(asked, flash_attn) if release.has("ctx_pad_256") else asked
    if settings.kv_unified or settings.parallel == 1 or not release.has("kv_streams"):
        return n_ctx, release.cells(n_ctx, flash_attn), 1
    per_stream = release.cells(n_ctx // settings.parallel, flash_attn)
    return per_stream * settings.parallel, per_stream, settings.parallel


def swa_cells(model: GGUFModel, settings: LlamaCppSettings, cells: int, n_ctx: int) -> int:
    """The cells per stream of the sliding-window layers' cache (llama_kv_cache_iswa, since PR 13194): the window of
    every slot sharing it plus a ubatch, padded to 256, at most the full cache's; the full size with --swa-full or
    before that release (0: no sliding window)."""
    if not model.n_swa or not any(model.swa_layers):
        return 0
    if settings.swa_full or not settings.release.has("swa_cache"):
        return cells
    slots = settings.parallel if settings.kv_unified else 1
    return -(-min(cells, model.n_swa * slots + settings.n_ubatch_at(n_ctx)) // 256) * 256


def kv_cache(model: GGUFModel, settings: LlamaCppSettings, flash_attn: bool) -> KVCache:
    """The KV cache llama_kv_cache allocates: every layer with KV heads, its cells in each stream (a sliding-window
    layer's in the window's cache)."""
    n_ctx, cells, streams = padded_ctx(settings, flash_attn)
    window = swa_cells(model, settings, cells, n_ctx)
    per_layer = []
    for layer, heads in enumerate(model.n_head_kv):
        layer_cells = window if window and model.swa_layers[layer] else cells
        per_layer.append(layer_cells * streams * (row_bytes(settings.cache_type_k.upper(), heads * model.head_dim_k)
                                                  + row_bytes(settings.cache_type_v.upper(), heads * model.head_dim_v)))
    return KVCache(cells, streams, per_layer, window)


def _layer_devices(n_layer: int, on_gpu: int, gpus: int, split: tuple[float, ...] | None):
    """Each layer slot's device (slot n_layer: the output head), as llama_model::load_tensors assigns them: the last
    `on_gpu` slots go to the GPUs, each GPU taking the next run of them in proportion to its --tensor-split share
    (llama.cpp's default: each GPU's free memory; equal GPUs assumed here)."""
    shares = list(split or [1.0] * gpus)[:gpus] + [0.0] * max(0, gpus - len(split or ()))
    bounds = [sum(shares[:i + 1]) / sum(shares) for i in range(gpus)]
    first = n_layer + 1 - on_gpu

    def device_of(slot: int) -> str:
        if slot < first:
            return "CPU"
        position = (slot - first) / on_gpu   # std::upper_bound over the cumulative shares
        return f"GPU{min(next((i for i, b in enumerate(bounds) if b > position), gpus - 1), gpus - 1)}"

    return device_of


def _device(tensor: GGUFTensor, device_of, n_layer: int, cpu_moe: int,
            overrides: tuple[tuple[str, str], ...] = ()) -> str:
    """Where llama.cpp loads a weight: the device of the first --override-tensor pattern its name contains (searched
    as llama-model-loader's std::regex_search does); else a layer's on its layer's device (its experts on the CPU in
    the first --n-cpu-moe layers: llama.cpp's own override), the token embedding on the CPU, the rest with the head."""
    for pattern, device in overrides:
        if re.search(pattern, tensor.name):
            return device
    if tensor.layer is not None:
        return "CPU" if tensor.layer < cpu_moe and tensor.name.endswith("_exps.weight") else device_of(tensor.layer)
    if tensor.name.startswith(("token_embd", "per_layer_token_embd", "token_types", "position_embd")):
        return "CPU"
    return device_of(n_layer)


def estimate_llamacpp(model: GGUFModel, settings: LlamaCppSettings | None = None, *, engine: str = "llama.cpp",
                      gpus: int = 0, compute: bool = True) -> LlamaCppEstimate:
    """Each buffer llama.cpp allocates for `model` with `settings`, on `gpus` GPUs (0: the CPU alone); without
    `compute`, the compute buffers are left at 0 (a lower bound a search can rule settings out with)."""
    settings = settings or LlamaCppSettings()
    if model.arch not in GRAPHS or (model.n_swa and model.arch not in WINDOWED):
        kind = f"{model.arch}'s windowed attention" if model.n_swa else model.arch
        raise MemfitError(f"{model.name}: llama.cpp's buffers for {kind} are not modelled (memfit replays the graphs "
                          f"of {', '.join(GRAPHS)}); its weights alone: {model.weights_bytes / 2**30:.2f} GiB.")
    if settings.ctx_size is None:   # llama.cpp's -c 0: the training context (--fit may shrink it: not modelled)
        settings = replace(settings, ctx_size=model.n_ctx_train or 4096)
    if type_size(settings.cache_type_v.upper())[0] > 1 and settings.flash_attn == "off":   # a quantized V
        raise MemfitError(f"--cache-type-v {settings.cache_type_v}: a quantized V cache needs flash attention "
                          "(llama.cpp refuses it with --flash-attn off).")
    flash = settings.flash
    n_ctx, _, _ = padded_ctx(settings, flash)
    ngl = model.n_layer + 1 if settings.n_gpu_layers < 0 else settings.n_gpu_layers
    on_gpu = min(ngl, model.n_layer + 1) if gpus else 0
    device_of = _layer_devices(model.n_layer, on_gpu, gpus, settings.tensor_split)
    buffers = {"CPU": Buffers("CPU")} | {f"GPU{i}": Buffers(f"GPU{i}") for i in range(gpus)}
    cpu_moe = model.n_layer if settings.n_cpu_moe < 0 else settings.n_cpu_moe
    for _, device in settings.override_tensor:
        if device not in buffers:
            raise MemfitError(f"--override-tensor ...={device}: {gpus} GPU(s) here (--gpus).")
    placed = {tensor.name: _device(tensor, device_of, model.n_layer, cpu_moe, settings.override_tensor)
              for tensor in model.tensors}
    for tensor in model.tensors:
        device = placed[tensor.name]
        buffers[device].model += gpu_tensor_bytes(tensor) if device != "CPU" else tensor.nbytes
        repacked = REPACKED + (REPACKED_AVX512 if settings.cpu_avx512 else ())
        if device == "CPU" and tensor.type in repacked and len(tensor.shape) > 1 and tensor.shape[1] % 8 == 0 \
                and tensor.name != "token_embd.weight":   # a lookup table, not multiplied
            buffers["CPU"].repack += tensor.nbytes
    if model.tied_embeddings and device_of(model.n_layer) != "CPU":
        embedding = next(t for t in model.tensors if t.name == "token_embd.weight")
        buffers[device_of(model.n_layer)].model += gpu_tensor_bytes(embedding)   # the head's own copy
    kv = kv_cache(model, settings, flash)
    for layer, size in enumerate(kv.layer_bytes):
        buffers["CPU" if settings.no_kv_offload else device_of(layer)].kv += size
    rows = settings.parallel if settings.release.has("output_per_sequence") else min(settings.n_batch, n_ctx)
    buffers["CPU"].output = (model.n_vocab + (model.n_embd if settings.embeddings else 0)) * rows * 4
    notes = ["--n-cpu-moe: the model has no experts; it moves nothing"] if settings.n_cpu_moe and not model.n_expert \
        else []
    q2k = sum(t.nbytes for t in model.tensors if placed[t.name] == "CPU" and t.type in REPACKED_AVX512
              and len(t.shape) > 1 and t.shape[1] % 8 == 0)
    if q2k and not settings.cpu_avx512:
        notes.append(f"an x86 CPU with AVX-512 also repacks the CPU's Q2_K weights: {q2k / 2**20:.2f} MiB more host "
                     "memory (cpu_avx512=True)")
    if engine == "ollama" and model.arch == "gemma3":
        notes.append("Ollama runs Gemma 3 on its own engine, not llama.cpp's runner: these are llama.cpp's buffers")
    holding = [name for name in buffers if name != "CPU" and any(placed[t.name] == name for t in model.tensors)]
    if compute:
        notes += _compute_buffers(model, settings, n_ctx=n_ctx, kv=kv, flash=flash, placed=placed,
                                  device_of=device_of, buffers=buffers, holding=holding, gpus=gpus, on_gpu=on_gpu,
                                  cpu_moe=cpu_moe)
    if len(holding) > 1:
        notes.append(f"{len(holding)} GPUs: the layers split as llama.cpp splits them (checked on a published 4-GPU "
                     "log)")
    return LlamaCppEstimate(model=model.name, source=model.source, engine=engine, settings=settings, n_ctx=n_ctx,
                            n_layer=model.n_layer, layers_on_gpu=on_gpu,
                            kv=kv, buffers=buffers, weights_bytes=model.weights_bytes, placement=placed, notes=notes)


def _compute_buffers(model: GGUFModel, settings: LlamaCppSettings, *, n_ctx: int, kv: KVCache, flash: bool,
                     placed: dict[str, str], device_of, buffers: dict[str, Buffers], holding: list[str], gpus: int,
                     on_gpu: int, cpu_moe: int) -> list[str]:
    """Each device's compute buffer, set in `buffers`; the notes on how it was found."""
    notes: list[str] = []
    on_cpu = [t for t in model.tensors if t.layer is not None and placed[t.name] == "CPU"]
    if holding:   # a graph split between the GPUs and the CPU
        by_name = {tensor.name: tensor for tensor in model.tensors}
        head = device_of(model.n_layer)

        def where(name: str) -> str:
            if name.startswith("cache_"):   # --no-kv-offload: every cache on the host
                return "CPU" if settings.no_kv_offload else device_of(int(name.rsplit("_l", 1)[1]))
            return placed.get(name, head)   # a tied model's head: its own copy of the embedding

        def copy_bytes(name: str) -> int:
            return gpu_tensor_bytes(by_name.get(name) or by_name["token_embd.weight"])

        # llama_context's pipeline parallelism: several GPUs, every layer slot on them, no tensor override
        pipelined = settings.pipeline and gpus > 1 and not on_cpu and on_gpu == model.n_layer + 1 \
            and not settings.override_tensor and not settings.n_cpu_moe and not settings.no_kv_offload
        op_offload = None if settings.no_op_offload else "GPU0"
        # what the parts depend on besides the graph: each weight's and cache's device, and with op offload the
        # sizes of the CPU's weights GPU0 would copy (the embedding's only lookup is never offloaded)
        placement = (tuple(placed.items()), tuple(device_of(layer) for layer in range(model.n_layer + 1)),
                     tuple(copy_bytes(name) for name, device in placed.items()
                           if op_offload and device == "CPU" and name != "token_embd.weight"))
        parts = split_compute_bytes(model, settings, n_ctx=n_ctx, kv=kv, flash_attn=flash, device_of=where,
                                    weight_bytes=copy_bytes, devices=["CPU", *holding], op_offload=op_offload,
                                    n_copies=PIPELINE_COPIES if pipelined else 1, placement=placement)
        for name, size in parts.items():
            buffers[name].compute = size
        if on_cpu or settings.override_tensor:
            offload = "" if settings.no_op_offload else (
                "; with op offload (CUDA's, llama.cpp's default) GPU0 runs every prompt-sized op on a CPU weight, "
                "copying the weight in: modelled from ggml-cuda's rule, not checked against a CUDA log")
            notes.append(f"{on_gpu} of {model.n_layer + 1} layer slots on the GPU: each device's compute buffer is its "
                         "part of the graph as ggml's scheduler splits it (equal to llama.cpp's on RPC devices here)"
                         + offload)
        elif pipelined:
            notes.append(f"{len(holding)} GPUs pipeline the graph: each holds {PIPELINE_COPIES} copies of what it "
                         "reads from another device, the host as many of the graph's inputs (equal to llama.cpp's on "
                         "two RPC devices here)")
        notes.append("the CUDA context and driver pools are not included")
    else:
        buffers["CPU"].compute = compute_buffer_bytes(model, settings, n_ctx=n_ctx, kv=kv, flash_attn=flash)
    return notes
