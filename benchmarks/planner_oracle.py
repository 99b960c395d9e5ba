"""Does `memfit plan` pick what a brute-force search of real runs would pick?

On a zoo of small training workloads on this machine's CPU, each with a memory budget it cannot meet
without techniques, the oracle runs every configuration of the planner's search space for real: every
combination of techniques the composition rules accept, at every micro-batch that splits the global batch
(smaller to larger, until the measured peak passes the budget). A configuration is feasible when its
measured peak (memfit measure's CPU allocator tracking) is within the budget; its step time is the
measured median micro-step (forward, backward, optimizer step) times the gradient-accumulation steps. The
oracle's best is the fastest feasible configuration. memfit's top plan — from the analytic estimator and
the cost model only, with the CPU described by its measured matmul throughput (at the model's own matmul
shape, small and large micro-batch), memory bandwidth and optimizer step speed — must
fit when run, and its measured step time must be within 10 % of the oracle's best in at least 80 % of the
cases.

All configurations of one case are measured in one process one after the other, on the same batches; the
machine is shared, so each time is the median of several steps. The micro-step includes an optimizer step,
so configurations with more accumulation steps pay extra optimizer steps in the measurement that a real
accumulation loop would not, and the planner's cost model (one optimizer step per global step, no fixed
cost per micro-step) does not count them: one reason it can undervalue a larger micro-batch here.

Run:  python benchmarks/planner_oracle.py [--cases N] [--steps N] [--resume | --replan]
Writes benchmarks/results/planner_oracle.{txt,json} after every case; --resume keeps the cases that file already
holds for the same workload, budget and steps (a long run can be finished in a later session); --replan keeps their
measured configurations and plans again (a change to the planner or its cost model, judged against the same
measurements: memfit's new plan is read from them, or measured when it is not among them).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import time
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
warnings.filterwarnings("ignore")

import docs_sync  # noqa: E402   # benchmarks/docs_sync.py: the docs show these results
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memfit.core.errors import MemfitError  # noqa: E402
from memfit.core.units import format_bytes  # noqa: E402
from memfit.estimators.analytic import analytic_estimate  # noqa: E402
from memfit.estimators.analytic.families import registry  # noqa: E402
from memfit.estimators.kernels import kernel_profile  # noqa: E402
from memfit.measurement import measure  # noqa: E402
from memfit.measurement.training import text_batches, train_run  # noqa: E402
from memfit.planner import PlanRequest, plan  # noqa: E402
from memfit.planner.cost import CostModel  # noqa: E402
from memfit.planner.search import Search, divisors  # noqa: E402
from memfit.specs.hardware import GPU  # noqa: E402
from memfit.specs.workload import Workload  # noqa: E402
from memfit.steps.optim import make_optimizer  # noqa: E402
from memfit.steps.train import call_model  # noqa: E402
from memfit.techniques import REGISTRY  # noqa: E402
from memfit.techniques.resolve import resolve  # noqa: E402

# (model, seq_len, global batch, budget as a fraction of the plain float32 AdamW step's peak at the whole batch)
ZOO = [
    ("tiny-llama", 256, 8, 0.5),
    ("tiny-gpt2", 256, 8, 0.5),
    ("tiny-bert", 128, 16, 0.5),
    ("tiny-qwen2", 256, 8, 0.4),
    ("tiny-llama", 512, 4, 0.35),
]
TOLERANCE = 0.10
TARGET_SHARE = 0.8
RESULTS = "benchmarks/results/planner_oracle"


def cpu_as_gpu(memory_bytes: int) -> GPU:
    """This CPU described as the planner's cost model reads a GPU: measured matmul throughput (float32 and
    bfloat16) and memory bandwidth (a large copy), no interconnect, no CUDA context."""
    def matmul_tflops(dtype: torch.dtype) -> float:
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        a @ b
        started, runs = time.perf_counter(), 10
        for _ in range(runs):
            a @ b
        return 2 * 1024**3 * runs / (time.perf_counter() - started) / 1e12

    source = torch.empty(64 * 2**20, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    started = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    bandwidth = 2 * source.numel() * 10 / (time.perf_counter() - started) / 1e9   # read + write
    bf16 = matmul_tflops(torch.bfloat16)
    return GPU(name="cpu (measured)", vendor="cpu", memory_bytes=memory_bytes, fp32_tflops=matmul_tflops(torch.float32),
               bf16_tflops=bf16, fp16_tflops=bf16, memory_bandwidth_gbps=bandwidth, interconnect="none",
               interconnect_gbps=0.0, host_link_gbps=bandwidth, context_bytes=0)


def _seconds(fn, runs: int = 5) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - started) / runs


# every optimizer the search tries without --allow lossy (the paged ones run bitsandbytes' kernels on a CPU as well)
OPTIMIZERS = ("adamw", "adamw8bit", "paged-adamw8bit", "paged-adamw")


def calibrate(gpu: GPU, model: str, hidden: int, seq_len: int, micro_batches: list[int]) -> CostModel:
    """The cost model's constants measured on this CPU, not assumed: the throughput of the model's own
    matmul shape (tokens x hidden @ hidden x 4 hidden) at the smallest and largest micro-batch gives the
    utilisation and the half-utilisation token count; one optimizer step over 2M parameters gives each
    optimizer's seconds per parameter; the host's time per kernel is the model's forward over one token (no
    configuration the oracle measures) over the kernels it launches; the CPU has no copy engine and no
    interconnect (nothing overlaps), and issues each kernel before running it."""
    def tflops(tokens: int) -> float:
        x, w = torch.randn(tokens, hidden), torch.randn(hidden, 4 * hidden)
        return 2 * tokens * hidden * 4 * hidden / _seconds(lambda: x @ w) / 1e12

    t1, t2 = seq_len * micro_batches[0], seq_len * micro_batches[-1]
    g1, g2 = tflops(t1), tflops(t2)
    ratio = g2 / g1
    half = max(0.0, t1 * t2 * (1 - ratio) / (ratio * t1 - t2)) if ratio > 1 else 0.0
    mfu = min(1.0, g2 / gpu.fp32_tflops * (t2 + half) / t2)

    def per_param(name: str) -> float:
        params = [torch.nn.Parameter(torch.randn(512, 512)) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        # an optimizer technique builds its own; torch.optim's are memfit's step's
        optimizer = REGISTRY[name]().build(params) if name in REGISTRY else make_optimizer(params, name)
        return _seconds(optimizer.step) / sum(p.numel() for p in params)

    return CostModel(mfu=mfu, tokens_half=int(half), attention_efficiency=mfu, launch_s=0.0,
                     host_op_s=host_seconds_per_kernel(model), host_overlaps=False, comm_overlap=0.0,
                     copy_overlap=0.0,
                     optimizer_s_per_param=tuple((name, per_param(name)) for name in OPTIMIZERS),
                     source="measured on this CPU (benchmarks/planner_oracle.py)")


def host_seconds_per_kernel(model: str) -> float:
    """The model's forward over one token of one sequence — the work all but nothing, the time its kernels' issue —
    over the kernels it launches (counted as the cost model counts them)."""
    workload = resolve(Workload(model=model, task="inference", batch_size=1, seq_len=1))
    module = workload.source.build(device="cpu", dtype=torch.float32).eval()
    batch = workload.source.make_batch(batch_size=1, seq_len=1, task="inference", dtype=torch.float32)
    with torch.no_grad():
        seconds = _seconds(lambda: call_model(module, batch), runs=50)
    return seconds / kernel_profile(workload, (8, 0)).forward.eager_kernels


def measured(workload: Workload, batches: list[dict]) -> tuple[int, float]:
    """(peak bytes of one real step, median seconds per step over `batches` after a warm-up step)."""
    peak = measure(workload, device="cpu", estimates=()).peak_bytes
    run = train_run(workload, batches)
    times = run.step_seconds[1:]
    release_freed_memory()
    return peak, sorted(times)[len(times) // 2]


def release_freed_memory() -> None:
    """Hundreds of runs in one process: collect, and give freed heap back to the system (glibc keeps it)."""
    gc.collect()
    if platform.system() == "Linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def oracle(request: PlanRequest, steps: int, console: Console) -> list[dict]:
    """Every configuration of the planner's space, measured, with its feasibility under the budget."""
    search = Search(request)
    rows = []
    for candidate, _, per_replica in search.workloads():
        for micro in [m for m in divisors(per_replica) if m % candidate.batch_multiple == 0]:
            workload = candidate.workload(request, micro)
            batches = text_batches(batch_size=micro, seq_len=workload.effective_seq_len, num_batches=steps + 1)
            try:
                peak, seconds = measured(workload, batches)
            except (MemfitError, RuntimeError) as exc:
                console.print(f"[dim]  {' + '.join(candidate.labels())} mb {micro}: failed ({exc})[/dim]")
                break
            rows.append({"techniques": candidate.labels(), "micro_batch": micro, "grad_accum": per_replica // micro,
                         "peak_bytes": peak, "step_time_s": seconds * (per_replica // micro),
                         "fits": peak <= request.budget_bytes})
            console.print(f"[dim]  {' + '.join(candidate.labels())} {micro}×{per_replica // micro}: "
                          f"{format_bytes(peak)}, {rows[-1]['step_time_s']:.3f} s"
                          f"{'' if rows[-1]['fits'] else ' (over)'}"
                          "[/dim]")
            if peak > request.budget_bytes:
                break   # a larger micro-batch only needs more
    return rows


def run_case(model: str, seq_len: int, global_batch: int, fraction: float, steps: int, console: Console,
             measured_before: list[dict] | None = None) -> dict:
    """One case: memfit's plan, and every configuration measured (or, given `measured_before`, those measurements of
    an earlier run: memfit plans again, the oracle's figures are kept)."""
    plain_workload = resolve(Workload(model=model, task="train", batch_size=global_batch, seq_len=seq_len))
    plain = analytic_estimate(plain_workload)
    budget = int(plain.peak_bytes * fraction)
    gpu = cpu_as_gpu(budget)
    spec = registry.family_of(plain_workload.source)[1]
    cost = calibrate(gpu, model, getattr(spec, "hidden", None) or spec.d_model, seq_len, divisors(global_batch))
    console.print(f"calibrated: {cost}")
    # speed_margin 0: the oracle checks the cost model's pick of the fastest plan, not the preference for the one
    # that changes training least
    request = PlanRequest(model=model, gpu=gpu, seq_len=seq_len, global_batch=global_batch, margin=0.0,
                          on_cpu=True, top=3, cost=cost, speed_margin=0.0)
    started = time.perf_counter()
    chosen = plan(request)
    planning_s = time.perf_counter() - started
    console.print(f"{model} s{seq_len} G{global_batch}, budget {format_bytes(budget)}: planned in {planning_s:.1f} s; "
                  + ("the configurations measured before are kept" if measured_before else
                     "measuring every configuration ..."))
    rows = measured_before or oracle(request, steps, console)
    feasible = [r for r in rows if r["fits"]]
    best = min(feasible, key=lambda r: r["step_time_s"]) if feasible else None
    case = {"model": model, "seq_len": seq_len, "global_batch": global_batch, "budget_bytes": budget,
            "plain_peak_bytes": plain.peak_bytes, "configurations_measured": len(rows), "feasible": len(feasible),
            "oracle_best": best, "planning_s": round(planning_s, 2), "plan": None,
            "cost_model": {k: v for k, v in vars(cost).items()}, "configurations": rows}
    if not chosen.feasible:
        case["plan"] = {"feasible": False, "reason": chosen.reason}
        return case
    top = chosen.plan_json(0)
    mine = next((r for r in rows if r["techniques"] == top["techniques"] and r["micro_batch"] == top["micro_batch"]),
                None)
    if mine is None:   # expandable-segments (a CUDA setting) or a row the oracle could not run: measure it now
        workload = chosen.plans[0].workload(request)
        batches = text_batches(batch_size=top["micro_batch"], seq_len=seq_len, num_batches=steps + 1)
        peak, seconds = measured(workload, batches)
        mine = {"peak_bytes": peak, "step_time_s": seconds * top["grad_accum"], "fits": peak <= budget}
        if measured_before and best:   # the oracle's best measured again beside it: ratios from one run only
            again = Search(request).workloads()
            workload = next(c.workload(request, best["micro_batch"]) for c, _, _ in again
                            if c.labels() == best["techniques"])
            batches = text_batches(batch_size=best["micro_batch"], seq_len=seq_len, num_batches=steps + 1)
            best = case["oracle_best"] = dict(best, step_time_s=measured(workload, batches)[1] * best["grad_accum"],
                                              measured_again=True)
    case["plan"] = {"techniques": top["techniques"], "micro_batch": top["micro_batch"], "grad_accum": top["grad_accum"],
                    "predicted_peak_bytes": top["peak_bytes"], "predicted_step_time_s": top["step_time_s"],
                    "measured_peak_bytes": mine["peak_bytes"], "measured_step_time_s": mine["step_time_s"],
                    "fits_when_run": mine["fits"]}
    if best:
        case["plan"]["time_vs_oracle"] = mine["step_time_s"] / best["step_time_s"]
    return case


def render(cases: list[dict]) -> Table:
    table = Table(title="memfit plan vs the oracle (every configuration measured for real on this CPU)",
                  title_justify="left")
    for column in ("case", "budget", "measured / feasible", "oracle's best", "oracle time", "memfit's plan",
                   "plan peak: predicted / measured", "plan time", "vs oracle", "pass"):
        table.add_column(column, justify="left" if column in ("case", "oracle's best", "memfit's plan") else "right")
    for case in cases:
        best, mine = case["oracle_best"], case["plan"]
        name = f"{case['model']} s{case['seq_len']} G{case['global_batch']}"
        best_text = f"{' + '.join(best['techniques'])} {best['micro_batch']}×{best['grad_accum']}" if best else "none"
        if not mine or mine.get("feasible") is False:
            table.add_row(name, format_bytes(case["budget_bytes"]), f"{case['configurations_measured']} / "
                          f"{case['feasible']}", best_text, "", "no plan", "", "", "", "no" if best else "yes")
            continue
        ok = mine["fits_when_run"] and mine.get("time_vs_oracle", 99) <= 1 + TOLERANCE
        measured = f"{case['configurations_measured']} / {case['feasible']}"
        again = " (again)" if best and best.get("measured_again") else ""
        table.add_row(name, format_bytes(case["budget_bytes"]), measured,
                      best_text, f"{best['step_time_s']:.3f} s{again}" if best else "",
                      f"{' + '.join(mine['techniques'])} {mine['micro_batch']}×{mine['grad_accum']}",
                      f"{format_bytes(mine['predicted_peak_bytes'])} / {format_bytes(mine['measured_peak_bytes'])}",
                      f"{mine['measured_step_time_s']:.3f} s", f"{mine.get('time_vs_oracle', 0):.3f}",
                      "yes" if ok else "no")
    return table


def passed(case: dict) -> bool:
    mine = case["plan"]
    if not mine or mine.get("feasible") is False:
        return case["oracle_best"] is None
    return mine["fits_when_run"] and mine.get("time_vs_oracle", 99) <= 1 + TOLERANCE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--cases", type=int, default=len(ZOO), help=f"the first N cases of the zoo (default all "
                                                                     f"{len(ZOO)}; each takes 10-30 minutes here)")
    parser.add_argument("--resume", action="store_true", help=f"keep the cases {RESULTS}.json already holds for the "
                                                                  "same workload, budget and steps")
    parser.add_argument("--replan", action="store_true", help=f"keep the configurations {RESULTS}.json measured for "
                                                                  "the same workload, budget and steps; plan again")
    args = parser.parse_args()
    console = Console(width=200)
    command = (f"python benchmarks/planner_oracle.py --steps {args.steps} --cases {args.cases}"
               + (" --replan" if args.replan else ""))
    header = f"{command}\n{platform.platform()}, torch {torch.__version__}, {os.cpu_count()} CPUs\n"
    done = earlier_cases(args.steps) if args.resume or args.replan else {}
    cases = []
    for entry in ZOO[:args.cases]:   # the results are written after every case: nothing is lost on a stop
        model, seq_len, global_batch, _ = entry
        if args.replan and (model, seq_len, global_batch) in done:
            cases.append(run_case(*entry, args.steps, console, done[model, seq_len, global_batch]["configurations"]))
        elif (model, seq_len, global_batch) in done:
            console.print(f"{model} s{seq_len} G{global_batch}: kept from the earlier run")
            cases.append(done[model, seq_len, global_batch])
        else:
            cases.append(run_case(*entry, args.steps, console))
        write(cases, header, console, final=len(cases) == args.cases)


def earlier_cases(steps: int) -> dict[tuple, dict]:
    """The cases of an earlier run with these steps, by workload, whose budget is the zoo's budget today."""
    try:
        with open(f"{RESULTS}.json") as fh:
            earlier = json.load(fh)
    except FileNotFoundError:
        return {}
    if f"--steps {steps} " not in earlier["command"] + " ":
        return {}
    fractions = {(model, seq_len, global_batch): fraction for model, seq_len, global_batch, fraction in ZOO}
    kept = {}
    for case in earlier["cases"]:
        key = (case["model"], case["seq_len"], case["global_batch"])
        if key in fractions and case["budget_bytes"] == int(case["plain_peak_bytes"] * fractions[key]):
            kept[key] = case
    return kept


def write(cases: list[dict], header: str, console: Console, final: bool) -> None:
    share = sum(passed(c) for c in cases) / len(cases)
    table = render(cases)
    verdict = (f"{sum(passed(c) for c in cases)} of {len(cases)} cases pass ({share:.0%}; target "
               f"{TARGET_SHARE:.0%}): the plan fits when run and is within {TOLERANCE:.0%} of the oracle's best"
               + ("" if final else " (run still in progress)"))
    if final:
        console.print(table)
        console.print(verdict)
    os.makedirs("benchmarks/results", exist_ok=True)
    with open(f"{RESULTS}.txt", "w") as fh:
        file_console = Console(file=fh, width=200)
        file_console.print(header)
        file_console.print(table)
        file_console.print(verdict)
    with open(f"{RESULTS}.json", "w") as fh:
        json.dump({"command": header.splitlines()[0], "cases": cases, "share_passed": share}, fh, indent=2)
    docs_sync.sync()


if __name__ == "__main__":
    main()
