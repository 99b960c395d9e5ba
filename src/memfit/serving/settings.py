"""A serving engine's start-up settings, with the engine's own names and defaults, checked as the engine checks them
before it loads anything (one line, exit 2). Which release: `engine_version`, whose accounting era decides the rules
(releases.py)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from memfit.core.errors import MemfitError, closest
from memfit.serving.releases import ENGINES, LOCAL_ENGINES, Release, release_of

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
ENTRYPOINTS = ("server", "offline")


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    engine: str = "vllm"
    engine_version: str | None = None        # None: the newest release memfit models
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: bool = False            # --enable-expert-parallel: a mixture's experts split whole over ranks
    max_model_len: int | None = None         # None: the model's max_position_embeddings; -1: the longest that fits
    allow_long_max_model_len: bool = False   # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: a context beyond the model's positions
    gpu_memory_utilization: float | None = None   # vLLM; None: the release's default
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    entrypoint: str = "server"               # vllm serve (the OpenAI server) or the offline LLM class
    enforce_eager: bool = False
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    quantization: str | None = None
    dtype: str = "auto"
    cpu_offload_gb: float = 0.0
    kv_cache_memory: int | None = None       # bytes: vLLM's --kv-cache-memory, skips the profile
    mem_fraction_static: float | None = None     # SGLang
    chunked_prefill_size: int | None = None      # SGLang
    cuda_graph_max_bs: int | None = None         # SGLang
    cuda_memory_fraction: float = 1.0            # TGI
    max_batch_prefill_tokens: int | None = None  # TGI
    other_process_bytes: int = 0             # memory other processes hold on the GPU at start (a co-tenant)
    speculative_config: str | None = None    # vLLM's --speculative-config: refused (estimate.py says why)
    enable_prefix_caching: bool = True       # vLLM V1's prefix cache (--no-enable-prefix-caching turns it off)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise MemfitError(f"unknown serving engine {self.engine!r}; choose {', '.join(ENGINES)}, or "
                              f"{' or '.join(LOCAL_ENGINES)} for GGUF models (their own flags)."
                              f"{closest(str(self.engine), ENGINES + LOCAL_ENGINES)}")
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemfitError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "chunked_prefill_size",
                     "cuda_graph_max_bs", "max_batch_prefill_tokens", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise MemfitError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool) or not isinstance(
                self.max_model_len, int) or not (self.max_model_len >= 1 or self.max_model_len == -1)):
            raise MemfitError(f"--max-model-len must be a positive integer or -1 (the longest that fits), got "
                              f"{self.max_model_len!r}.")
        for name in ("gpu_memory_utilization", "mem_fraction_static", "cuda_memory_fraction"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and 0 < value <= 1):
                raise MemfitError(f"--{name.replace('_', '-')} must be in (0, 1], got {value!r}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise MemfitError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose {', '.join(KV_CACHE_DTYPES)}."
                              f"{closest(str(self.kv_cache_dtype), KV_CACHE_DTYPES)}")
        if self.entrypoint not in ENTRYPOINTS:
            raise MemfitError(f"unknown --entrypoint {self.entrypoint!r}; choose server or offline.")
        if self.block_size is not None and self.block_size % 16 and self.block_size not in (1, 8):
            raise MemfitError(f"--block-size {self.block_size}: the engines take 1, 8 or a multiple of 16.")
        if not (isinstance(self.cpu_offload_gb, int | float) and self.cpu_offload_gb >= 0):
            raise MemfitError(f"--cpu-offload-gb must be >= 0, got {self.cpu_offload_gb!r}.")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "half"):
            raise MemfitError(f"unknown --dtype {self.dtype!r}; choose auto, bfloat16, float16 or float32.")
        self._engine_flags_only()
        release_of(self.engine, self.engine_version)   # an unknown version: one line

    def _engine_flags_only(self) -> None:
        """A flag of another engine is an error, not silently ignored."""
        own = {"vllm": {"gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "entrypoint",
                        "enforce_eager", "block_size", "cpu_offload_gb", "kv_cache_memory", "expert_parallel",
                        "pipeline_parallel", "data_parallel", "speculative_config", "enable_prefix_caching"},
               "sglang": {"mem_fraction_static", "chunked_prefill_size", "cuda_graph_max_bs", "max_num_seqs",
                          "enforce_eager", "data_parallel", "expert_parallel", "pipeline_parallel"},
               "tgi": {"cuda_memory_fraction", "max_batch_prefill_tokens", "max_num_seqs"}}
        engine_only = set().union(*own.values())
        defaults = {f.name: f.default for f in fields(self)}
        for name in sorted(engine_only - own[self.engine]):
            if getattr(self, name) != defaults[name]:
                takers = [e for e in own if name in own[e]]
                raise MemfitError(f"--{name.replace('_', '-')} is not a {self.engine} setting; "
                                  f"{' and '.join(takers)} take{'s' if len(takers) == 1 else ''} it.")

    @property
    def release(self) -> Release:
        return release_of(self.engine, self.engine_version)
