"""The engine's own command line for an estimate's settings (defaults the engine would pick are left out)."""
from __future__ import annotations

from memfit.serving.result import ServingEstimate


def command_line(e: ServingEstimate) -> str:
    """The engine's command line for these settings (defaults the engine would pick are left out)."""
    s = e.settings
    if e.engine == "vllm":
        parts = ["vllm", "serve", e.hub_id, "--max-model-len", str(s["max_model_len"])]
        for key, flag in (("tensor_parallel", "--tensor-parallel-size"),
                          ("pipeline_parallel", "--pipeline-parallel-size"), ("data_parallel", "--data-parallel-size")):
            if s[key] > 1:
                parts += [flag, str(s[key])]
        parts += ["--gpu-memory-utilization", str(s["gpu_memory_utilization"]), "--max-num-seqs",
                  str(s["max_num_seqs"])]
        if s.get("quantize_on_load"):
            parts += ["--quantization", s["quantize_on_load"]]
        if s["kv_cache_dtype"] != "auto":
            parts += ["--kv-cache-dtype", s["kv_cache_dtype"]]
        if s["enforce_eager"]:
            parts.append("--enforce-eager")
        return " ".join(parts)
    if e.engine == "tgi":
        parts = ["text-generation-launcher", "--model-id", e.hub_id, "--max-total-tokens", str(s["max_model_len"]),
                 "--max-batch-prefill-tokens", str(s["max_batch_prefill_tokens"])]
        if s["tensor_parallel"] > 1:
            parts += ["--num-shard", str(s["tensor_parallel"])]
        if s["cuda_memory_fraction"] != 1.0:
            parts += ["--cuda-memory-fraction", str(s["cuda_memory_fraction"])]
        if s.get("quantize_on_load"):
            parts += ["--quantize", s["quantize_on_load"]]
        return " ".join(parts)
    parts = ["python", "-m", "sglang.launch_server", "--model-path", e.hub_id, "--context-length",
             str(s["max_model_len"]), "--mem-fraction-static", str(s["mem_fraction_static"])]
    if s["tensor_parallel"] > 1:
        parts += ["--tp", str(s["tensor_parallel"])]
    if s.get("quantize_on_load"):
        parts += ["--quantization", s["quantize_on_load"]]
    if s["kv_cache_dtype"] != "auto":
        parts += ["--kv-cache-dtype", s["kv_cache_dtype"]]
    return " ".join(parts)
