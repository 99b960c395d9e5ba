"""A serving estimate as the engine's own start-up log would read, then the command line that starts it."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memfit.core.units import GiB, format_bytes
from memfit.serving.estimate import ServingEstimate

ROWS = (("weights_bytes", "model weights (per GPU)"), ("activation_bytes", "profile run's activation peak"),
        ("non_torch_bytes", "memory outside torch"), ("cuda_graph_bytes", "CUDA graphs"),
        ("budget_bytes", "budget"), ("kv_cache_bytes", "available KV cache memory"))


def print_serving(estimate: ServingEstimate, console: Console) -> None:
    e = estimate
    console.print(f"[bold]{e.model}[/] on {e.engine} {e.engine_version}, {e.gpus} x {e.gpu} "
                  f"({format_bytes(e.gpu_memory_bytes)} as CUDA reports it)")
    table = Table(show_header=True, header_style="bold")
    table.add_column("per GPU")
    table.add_column("bytes", justify="right")
    table.add_column("source")
    for key, label in ROWS:
        value = getattr(e, key)
        if key == "cuda_graph_bytes" and not e.graphs_in_budget and value:
            label += " (captured after the cache, above the budget)"
        if key == "budget_bytes":
            label += _budget_rule(e)
        table.add_row(label, format_bytes(value), e.sources.get(key, "modelled" if key != "budget_bytes" else "rule"))
    console.print(table)
    for line in log_lines(e):
        console.print(line, highlight=False)
    for note in e.notes:
        console.print(f"[dim]note: {note}[/]")
    console.print(f"\n{command_line(e)}", highlight=False, soft_wrap=True)


def _budget_rule(e: ServingEstimate) -> str:
    if e.engine == "vllm":
        return f" (total x {e.settings['gpu_memory_utilization']})"
    return f" (free x {e.settings.get('mem_fraction_static')})"


def log_lines(e: ServingEstimate) -> list[str]:
    """What the engine prints about its cache, in its own words, and whether it starts."""
    lines = []
    if e.engine == "vllm":
        lines.append(f"Available KV cache memory: {e.kv_cache_bytes / GiB:.2f} GiB")
        if e.starts or e.kv_blocks:
            lines.append(f"# GPU blocks: {e.kv_blocks} (block size {e.block_size}, "
                         f"{format_bytes(e.kv_bytes_per_token)} per token)")
            lines.append(f"GPU KV cache size: {e.kv_cache_tokens:,} tokens")
            lines.append(f"Maximum concurrency for {e.max_model_len:,} tokens per request: {e.max_concurrency:.2f}x")
    else:
        lines.append(f"KV Cache is allocated. #tokens: {e.kv_cache_tokens}, K size: {e.kv_cache_bytes / 2 / GiB:.2f} "
                     f"GB, V size: {e.kv_cache_bytes / 2 / GiB:.2f} GB")
    if e.starts:
        lines.append(f"[green]starts[/]: the longest context that would start is {e.max_model_len_fits:,} tokens")
    else:
        lines.append(f"[red]does not start[/]: {e.refusal}")
        if e.max_model_len_fits:
            lines.append(f"--max-model-len {e.max_model_len_fits} would start")
    return lines


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
        if s["kv_cache_dtype"] != "auto":
            parts += ["--kv-cache-dtype", s["kv_cache_dtype"]]
        if s["enforce_eager"]:
            parts.append("--enforce-eager")
        return " ".join(parts)
    parts = ["python", "-m", "sglang.launch_server", "--model-path", e.hub_id, "--context-length",
             str(s["max_model_len"]), "--mem-fraction-static", str(s["mem_fraction_static"])]
    if s["tensor_parallel"] > 1:
        parts += ["--tp", str(s["tensor_parallel"])]
    if s["kv_cache_dtype"] != "auto":
        parts += ["--kv-cache-dtype", s["kv_cache_dtype"]]
    return " ".join(parts)
