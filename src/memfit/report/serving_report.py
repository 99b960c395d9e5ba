"""A serving estimate as the engine's own start-up log would read, then the command line that starts it."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.core.units import GiB, format_bytes
from memfit.serving.command import command_line
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
        console.print(f"[dim]note: {escape(note)}[/]")
    if e.speed is not None:
        print_speed(e, console)
    console.print(f"\n{command_line(e)}", highlight=False, soft_wrap=True)
    if e.speed is not None:
        console.print(client_line(e), highlight=False, soft_wrap=True)


def print_speed(e: ServingEstimate, console: Console) -> None:
    """The load's figures as vLLM's benchmark client prints them (simulated: speed.py)."""
    speed = e.speed
    assert speed is not None
    console.print(f"\n[bold]serving the load[/] (simulated: {speed.steps:,} engine steps, at most "
                  f"{speed.most_running:,} requests running{', ' if speed.preemptions else ''}"
                  f"{f'{speed.preemptions:,} preemptions' if speed.preemptions else ''})")
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column()
    table.add_column(justify="right")
    for label, value in (("Benchmark duration (s)", f"{speed.duration_s:,.2f}"),
                         ("Request throughput (req/s)", f"{speed.request_throughput:,.2f}"),
                         ("Output token throughput (tok/s)", f"{speed.output_tokens_per_s:,.2f}"),
                         ("Total token throughput (tok/s)", f"{speed.total_tokens_per_s:,.2f}"),
                         ("Mean / median TTFT (ms)", f"{speed.mean_ttft_ms:,.2f} / {speed.median_ttft_ms:,.2f}"),
                         ("Mean / median TPOT (ms)", f"{speed.mean_tpot_ms:,.2f} / {speed.median_tpot_ms:,.2f}"),
                         ("Mean ITL (ms)", f"{speed.mean_itl_ms:,.2f}"),
                         ("Mean E2EL (ms)", f"{speed.mean_e2el_ms:,.2f}")):
        table.add_row(label, value)
    console.print(table)
    for note in speed.notes:
        console.print(f"[dim]note: {escape(note)}[/]")


def client_line(e: ServingEstimate) -> str:
    """vLLM's benchmark client for this load."""
    assert e.speed is not None
    load = e.speed.load
    parts = ["vllm", "bench", "serve", "--model", e.hub_id, "--num-prompts", str(load["num_prompts"])]
    if load["dataset"] == "random":
        parts += ["--dataset-name", "random", "--random-input-len", str(int(load["input_len"])),
                  "--random-output-len", str(int(load["output_len"])), "--ignore-eos"]
    else:
        parts += ["--dataset-name", "sharegpt", "--dataset-path", "ShareGPT_V3_unfiltered_cleaned_split.json"]
    if load["request_rate"] != float("inf"):
        parts += ["--request-rate", f"{load['request_rate']:g}"]
    if load["max_concurrency"]:
        parts += ["--max-concurrency", str(load["max_concurrency"])]
    return " ".join(parts)


def _budget_rule(e: ServingEstimate) -> str:
    if e.engine == "vllm":
        return f" (total x {e.settings['gpu_memory_utilization']})"
    if e.engine == "tgi":
        return f" (total x {e.settings['cuda_memory_fraction']})"
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
    elif e.engine == "tgi":
        lines.append(f"Setting max batch total tokens to {e.kv_cache_tokens}")
    else:
        lines.append(f"KV Cache is allocated. #tokens: {e.kv_cache_tokens}, K size: {e.kv_cache_bytes / 2 / GiB:.2f} "
                     f"GB, V size: {e.kv_cache_bytes / 2 / GiB:.2f} GB")
    if e.starts:
        lines.append(f"[green]starts[/]: the longest context that would start is {e.max_model_len_fits:,} tokens")
    else:
        lines.append(f"[red]does not start[/]: {escape(e.refusal or '')}")
        if 0 < e.max_model_len_fits < e.max_model_len:
            lines.append(f"--max-model-len {e.max_model_len_fits} would start")
    return lines


def serving_failure_json(failure, estimate: ServingEstimate, fixes) -> dict:
    return {"schema": "memfit.serve-failure/1", "failure": {"kind": failure.kind, "message": failure.message,
                                                            "summary": failure.summary},
            "predicted": estimate.to_json(), "agrees": not estimate.starts,
            "fixes": [{"change": f.change, "cost": f.cost, "max_concurrency": f.estimate.max_concurrency,
                       "kv_cache_tokens": f.estimate.kv_cache_tokens, "max_model_len": f.estimate.max_model_len,
                       "command": command_line(f.estimate)} for f in fixes]}


def print_serving_failure(failure, estimate: ServingEstimate, fixes, console: Console) -> None:
    console.print(f"[bold]{failure.summary}[/]")
    console.print(f"[dim]{escape(failure.message)}[/]", highlight=False)
    if estimate.starts:
        console.print(f"memfit predicts that these settings start ({estimate.kv_cache_tokens:,} cache tokens): it "
                      "counts less than the engine did here (another process, a larger profile, a driver's share); "
                      "the fixes below are ranked on memfit's figures", highlight=False)
    else:
        console.print(f"memfit agrees: {escape(estimate.refusal or '')}", highlight=False)
    if not fixes:
        console.print("[red]no single change starts it[/]: a GPU with more memory, or several changes together")
        return
    table = Table(show_header=True, header_style="bold", title="fixes, each alone (estimated)")
    for column in ("change", "requests at max_model_len", "cache tokens", "costs"):
        table.add_column(column, justify="right" if column in ("requests at max_model_len", "cache tokens") else "left")
    for fix in fixes:
        e = fix.estimate
        table.add_row(fix.change, f"{e.max_concurrency:.2f} at {e.max_model_len:,}", f"{e.kv_cache_tokens:,}",
                      fix.cost)
    console.print(table)
    console.print(f"\n{command_line(fixes[0].estimate)}", highlight=False, soft_wrap=True)
