"""A serving plan as a table (cheapest or fastest first), the launch command of plan 1, and a Kubernetes Deployment
that runs it."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.serving.command import command_line
from memfit.serving.planner import ServePlan, ServePlanResult
from memfit.serving.served_model import ServedModel

IMAGES = {"vllm": "vllm/vllm-openai:latest", "sglang": "lmsysorg/sglang:latest"}


def print_serve_plans(result: ServePlanResult, console: Console, elapsed_s: float) -> None:
    r = result.request
    prompt, answer = r.lengths
    console.print(f"[bold]{r.engine}[/] serving {r.concurrency} users at {r.max_model_len:,} tokens "
                  f"({prompt:,} in, {answer:,} out each), {len(r.machines)} machine(s), {result.tried} setups tried "
                  f"in {elapsed_s:.1f} s")
    if not result.feasible:
        console.print(f"[red]no plan[/]: {escape(result.reason or '')}")
        return
    lossy = any(plan.accuracy_cost for plan in result.plans)
    priced = any(plan.machine.usd_per_hour for plan in result.plans)
    table = Table(show_header=True, header_style="bold")
    columns = ["#", "machine", "TP x DP", *(["weights / KV"] if lossy else []), "users fit", "out tok/s", "TTFT ms",
               "TPOT ms", *(["$/h", "$/M out"] if priced else [])]
    for column in columns:
        table.add_column(column, justify="left" if column in ("machine", "weights / KV") else "right",
                         no_wrap=column == "machine")
    for index, plan in enumerate(result.plans, 1):
        j = plan.to_json()
        row = [str(index), plan.machine.name, f"{plan.tensor_parallel} x {plan.replicas}"]
        if lossy:
            row.append(f"{plan.quantization or 'checkpoint'} / {plan.kv_cache_dtype}")
        row += [f"{j['max_concurrency']:,.1f}", f"{j['output_tokens_per_s']:,.0f}", f"{j['mean_ttft_ms']:,.0f}",
                f"{j['mean_tpot_ms']:,.1f}"]
        if priced:
            row += [_money(j["usd_per_hour"]), _money(j["usd_per_million_output_tokens"])]
        table.add_row(*row)
    console.print(table)
    best = result.plans[0]
    for cost in best.accuracy_cost:
        console.print(f"[yellow]plan 1 is lossy[/]: {escape(cost)}")
    console.print("[dim]speeds simulated (the engine's scheduler over its step model; memfit estimate --task serve "
                  "with --max-concurrency shows one in full)[/]")
    console.print(f"\n{command_line(best.estimate)}", highlight=False, soft_wrap=True)
    if best.replicas > 1:
        console.print(f"[dim]one such server per {best.tensor_parallel} GPU(s): {best.replicas} replicas behind a "
                      "load balancer[/]")


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def deployment_yaml(plan: ServePlan, model: ServedModel) -> str:
    """A Kubernetes Deployment running plan `plan`: one pod per replica, its GPUs, the engine's own arguments."""
    e = plan.estimate
    args = command_line(e).split()
    if e.engine == "vllm":
        args = args[2:]   # the image's entry point is the server: `vllm serve` drops
        command = ["vllm", "serve"]
    else:
        command = args[:3]
        args = args[3:]
    name = "".join(c if c.isalnum() else "-" for c in model.name.lower()).strip("-")[:40] or "llm"
    lines = [
        "apiVersion: apps/v1", "kind: Deployment", "metadata:", f"  name: {name}-{e.engine}",
        "  labels:", f"    app: {name}-{e.engine}", "spec:", f"  replicas: {plan.replicas}", "  selector:",
        "    matchLabels:", f"      app: {name}-{e.engine}", "  template:", "    metadata:", "      labels:",
        f"        app: {name}-{e.engine}", "    spec:", "      containers:", f"        - name: {e.engine}",
        f"          image: {IMAGES[e.engine]}", f"          command: [{', '.join(_quoted(c) for c in command)}]",
        "          args:", *[f"            - {_quoted(a)}" for a in args],
        "          ports:", "            - containerPort: 8000" if e.engine == "vllm" else
        "            - containerPort: 30000",
        "          resources:", "            limits:", f"              nvidia.com/gpu: {plan.tensor_parallel}",
        "          volumeMounts:", "            - name: shm", "              mountPath: /dev/shm",
        "      volumes:", "        - name: shm", "          emptyDir:", "            medium: Memory",
        f"      # memfit: {plan.machine.gpu.name}, {plan.tensor_parallel} GPU(s) a pod, {plan.replicas} pod(s)"]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return f'"{text}"'
