"""`memfit plan MODEL --engine llama.cpp --gpu G --host-ram R --ctx-size L`: the GGUF quantization, KV cache type and
layer split (-ngl) that fit one GPU and the host's RAM, best quality first (or fastest), each with its speed.

Fit, as llama.cpp's --fit judges it: the GPU's buffers plus its CUDA context leave --fit-target (1024 MiB by
default) free; the host holds the CPU's layers (mapped from the file), its KV cache, compute and output buffers, and
keeps HOST_RESERVE for the system (assumed). Quality: each type's published perplexity increase over F16
(QUALITY_SOURCE). Speed: serving/llamacpp_speed.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from memfit.core.errors import MemfitError
from memfit.core.units import GiB
from memfit.serving.gguf_file import GGUFModel
from memfit.serving.llamacpp import LlamaCppEstimate, LlamaCppSettings, estimate_llamacpp, gguf_model
from memfit.serving.llamacpp_fit import FIT_TARGET
from memfit.serving.llamacpp_speed import HOST_BANDWIDTH_GBPS, speed
from memfit.specs.hardware import GPU

# perplexity increase over F16 on wiki.test, Llama-3-70B (the type, its share); types without a figure are not searched
QUALITY = {"Q8_0": 0.0003, "Q6_K": 0.0047, "Q5_K_M": 0.0123, "Q5_K_S": 0.0189, "Q4_K_M": 0.0483, "Q4_K_S": 0.0615,
           "IQ4_XS": 0.0707, "Q3_K_L": 0.1663, "Q3_K_M": 0.1875, "Q3_K_S": 0.2895, "Q2_K": 0.6873}
QUALITY_SOURCE = ("Llama-3-70B perplexity on wiki.test against F16, dranger003 in llama.cpp PR 6745 "
                  "(github.com/ggml-org/llama.cpp/pull/6745#issuecomment-2093892514)")
HOST_RESERVE = 2 * GiB           # assumed: what the operating system and other programs keep of host RAM
SPEED_SOURCE = ("memfit's model (serving/llamacpp_speed.py) against published llama-bench runs "
                "(benchmarks/published_llamabench.py): generating, mean |error| 8 % on the 16 rows it was calibrated "
                "on and 26 % on 3 others (70B models faster than it predicts); reading a prompt, 6 % on 16 and 19 % "
                "on 1 other")
KV_TYPES = ("f16", "q8_0")       # q8_0: about half the KV bytes, at a small accuracy cost
KV_Q8_COST = 0.001               # assumed: a q8_0 KV cache's perplexity increase (no published figure bundled)


@dataclass
class LlamaCppPlan:
    quant: str
    settings: LlamaCppSettings
    estimate: LlamaCppEstimate
    gpu_bytes: int                   # the GPU's buffers and CUDA context
    host_bytes: int
    decode_tokens_per_s: float
    prompt_tokens_per_s: float
    ppl_increase: float

    @property
    def split(self) -> str:
        """What goes where: -ngl's layer slots, and the first layers whose experts stay on the CPU."""
        text = f"-ngl {self.estimate.layers_on_gpu}/{self.estimate.n_layer + 1}"
        return text + f" --n-cpu-moe {self.settings.n_cpu_moe}" if self.settings.n_cpu_moe else text

    @property
    def full_offload(self) -> bool:
        return self.estimate.layers_on_gpu == self.estimate.n_layer + 1

    def command(self) -> str:
        s = self.settings
        words = ["llama-server", "-m", f"MODEL-{self.quant}.gguf", "-c", str(s.ctx_size or self.estimate.n_ctx),
                 "-ngl", str(self.estimate.layers_on_gpu), "-fa", s.flash_attn]
        if s.cache_type_k != "f16":
            words += ["-ctk", s.cache_type_k, "-ctv", s.cache_type_v]
        if s.n_cpu_moe:
            words += ["--n-cpu-moe", str(s.n_cpu_moe)]
        if s.parallel > 1:
            words += ["-np", str(s.parallel)]
        return " ".join(words)

    def modelfile(self, model: str) -> str | None:
        """Ollama's Modelfile for the plan (its num_ctx is per slot), headed by the server's environment the plan
        needs (flash attention, the KV cache type and the slots are not Modelfile parameters); None where the plan
        keeps experts on the CPU, which Ollama has no parameter for."""
        s = self.settings
        if s.n_cpu_moe:
            return None
        per_slot = (s.ctx_size or self.estimate.n_ctx) // s.parallel
        env = ["OLLAMA_FLASH_ATTENTION=1"] if s.flash_attn == "on" else []   # else Ollama's default
        env.append(f"OLLAMA_NUM_PARALLEL={s.parallel}")
        if s.cache_type_k != "f16":
            env.append(f"OLLAMA_KV_CACHE_TYPE={s.cache_type_k}")
        return "\n".join([f"# serve with: {' '.join(env)} ollama serve", f"FROM ./{model}-{self.quant}.gguf",
                          f"PARAMETER num_ctx {per_slot}", f"PARAMETER num_gpu {self.estimate.layers_on_gpu}"]) + "\n"


@dataclass
class LlamaCppPlanResult:
    model: str
    plans: list[LlamaCppPlan]
    rejected: list[str] = field(default_factory=list)
    least_host_bytes: int = 0        # the least host RAM any searched setup needs (0: none fit the GPU)

    @property
    def reason(self) -> str:
        if self.plans:
            return ""
        if not self.least_host_bytes:
            return "nothing fits: " + "; ".join(self.rejected[:3])
        return (f"nothing fits the host: the setup that needs the least host RAM still needs "
                f"{self.least_host_bytes / GiB:.1f} GiB (with {HOST_RESERVE / GiB:.0f} GiB kept for the system: "
                f"--host-ram {-(-(self.least_host_bytes + HOST_RESERVE) // GiB)}GiB would do)")


def _fits(estimate: LlamaCppEstimate, gpu: GPU, host_ram_bytes: int) -> tuple[bool, bool, int, int]:
    """(the GPUs fit, the host fits, the fullest GPU's bytes with its CUDA context, the host's bytes)."""
    gpu_bytes = max(b.total for name, b in estimate.buffers.items() if name != "CPU") + gpu.context_bytes
    host_bytes = estimate.buffers["CPU"].total
    return gpu_bytes <= gpu.memory_bytes - FIT_TARGET, host_bytes <= host_ram_bytes - HOST_RESERVE, gpu_bytes, \
        host_bytes


def _most(settings: LlamaCppSettings, gguf: GGUFModel, gpu: GPU, gpus: int, *, experts: bool
          ) -> LlamaCppEstimate | None:
    """The most on the GPUs that fits them, if anything does: layer slots (-ngl, split equally over `gpus`), or with
    `experts` every layer and the experts of all but the fewest first layers (--n-cpu-moe)."""
    best = None
    low, high = 0, gguf.n_layer if experts else gguf.n_layer + 1
    while low <= high:
        middle = (low + high) // 2
        at = replace(settings, n_cpu_moe=gguf.n_layer - middle) if experts else replace(settings, n_gpu_layers=middle)
        fits = _fits(estimate_llamacpp(gguf, at, gpus=gpus, compute=False), gpu, 0)[0]   # weights and KV first
        if fits:
            estimate = estimate_llamacpp(gguf, at, gpus=gpus)
            fits = _fits(estimate, gpu, 0)[0]
        if fits:
            best, low = estimate, middle + 1
        else:
            high = middle - 1
    return best


def plan_llamacpp(model: str, gpu: GPU, *, host_ram_bytes: int, ctx_size: int | None = None, parallel: int = 1,
                  objective: str = "quality", host_bandwidth_gbps: float = HOST_BANDWIDTH_GBPS,
                  quants: tuple[str, ...] = tuple(QUALITY), gpus: int = 1) -> LlamaCppPlanResult:
    """Every searched quantization and KV type at the most layers on `gpus` GPUs (llama.cpp's split of equal GPUs)
    that fit, ranked."""
    if objective not in ("quality", "fastest"):
        raise MemfitError(f"--objective {objective}: quality (the least perplexity first) or fastest.")
    plans, rejected, least_host = [], [], 0
    for quant in quants:
        gguf = gguf_model(model, quant)
        for kv_type in KV_TYPES:
            settings = LlamaCppSettings(ctx_size=ctx_size, parallel=parallel, flash_attn="on",
                                        cache_type_k=kv_type, cache_type_v=kv_type)
            # the most layer slots on the GPU that fit it; a mixture of experts may instead keep every layer there
            # and leave the experts of its first layers on the CPU (--n-cpu-moe: the fewest that fit)
            splits = [_most(settings, gguf, gpu, gpus, experts=False)]
            if gguf.n_expert:
                splits.append(_most(settings, gguf, gpu, gpus, experts=True))
            for best in splits:
                if best is None:
                    rejected.append(f"{quant}, KV {kv_type}: not even the output head fits {gpu.name}")
                    continue
                _, host_fits, gpu_bytes, host_bytes = _fits(best, gpu, host_ram_bytes)
                if not host_fits:
                    least_host = min(least_host or host_bytes, host_bytes)
                    rejected.append(f"{quant}, KV {kv_type}: the host needs {host_bytes / GiB:.1f} GiB with "
                                    f"{best.layers_on_gpu} layer slots on the GPU ({host_ram_bytes / GiB:.0f} GiB "
                                    f"less {HOST_RESERVE / GiB:.0f} for the system)")
                    continue
                decode, prompt = speed(best, gguf, gpu, host_bandwidth_gbps)
                plans.append(LlamaCppPlan(quant, best.settings, best, gpu_bytes, host_bytes, decode, prompt,
                                          QUALITY[quant] + (KV_Q8_COST if kv_type == "q8_0" else 0.0)))
    key = (lambda p: (p.ppl_increase, -p.decode_tokens_per_s)) if objective == "quality" else (
        lambda p: (-p.decode_tokens_per_s, p.ppl_increase))
    return LlamaCppPlanResult(model, sorted(plans, key=key), rejected, least_host)
