"""Does `memfit plan` pick what a brute-force search of real runs would pick?

On a zoo of small training workloads on this machine's CPU, each with a memory budget it cannot meet
without techniques, the oracle runs every configuration of the planner's search space for real: every
combination of techniques the composition rules accept, at every micro-batch that splits the global batch
(smaller to larger, until the measured peak passes the budget; a step in backward only at the whole batch, as it
cannot accumulate) — but those too slow to be the fastest are stopped early, by rules that cannot drop a finalist
(`oracle`). The measurements hold for one processor (`this_cpu`, named in the results). A configuration is
feasible when its measured peak (memfit measure's CPU allocator tracking) is within the budget; its step time is
that of one optimizer step over the global batch as an accumulating loop runs it: the median forward and backward of
a micro-batch times the accumulation steps, plus the median optimizer step.
memfit's top plan — from the analytic estimator and the cost model only, with the CPU described by rates measured
kernel class by kernel class on runs of its own (`calibrate`) — must fit when run, and its measured step time must
be within 10 % of the oracle's best in at least 80 % of the cases.

All configurations of one case are measured in one process one after the other, on the same batches. The machine
is shared and its speed drifts over a sweep of hundreds of runs (tens of minutes), so the sweep only finds the
finalists: its FINALISTS fastest feasible configurations and memfit's plan are measured again, round-robin over
ROUNDS rounds in one sitting, and the oracle's best is the fastest of them there.

Run:  python benchmarks/planner_oracle.py [--cases N] [--steps N] [--resume | --replan]
Writes benchmarks/results/planner_oracle.{txt,json} after every case, and the case being measured to
planner_oracle.partial.json after every configuration (a stopped sweep continues from there); --resume keeps the
cases the results already hold for the same workload, budget and steps (a long run can be finished in a later
session); --replan keeps their measured configurations and plans again (a change to the planner or its cost model,
judged against the same measurements: the finalists and memfit's new plan are measured again side by side).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from statistics import median_high as median

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
warnings.filterwarnings("ignore")

import docs_sync  # noqa: E402   # benchmarks/docs_sync.py: the docs show these results
import torch  # noqa: E402
from cpu_cost_model import calibrate, cpu_as_gpu  # noqa: E402   # benchmarks/cpu_cost_model.py
from oracle_timing import TooSlow, peak_bytes, step_seconds  # noqa: E402   # benchmarks/oracle_timing.py
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memfit.core.errors import MemfitError  # noqa: E402
from memfit.core.units import format_bytes  # noqa: E402
from memfit.estimators.analytic import analytic_estimate  # noqa: E402
from memfit.measurement.training import text_batches  # noqa: E402
from memfit.planner import PlanRequest, plan  # noqa: E402
from memfit.planner.cost import step_time  # noqa: E402
from memfit.planner.search import Search, divisors  # noqa: E402
from memfit.specs.workload import Workload  # noqa: E402
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
FINALISTS = 5   # the sweep's fastest feasible configurations measured again beside memfit's plan
ROUNDS = 3
PRUNE = 4.0     # a warm-up past this many times the fastest step so far: not the fastest (oracle())
CONTENDERS = 1.25   # a step slower than this many times the fastest so far cannot be a finalist: no peak measured
ONE_STEP = 1.5      # a first timed step over this many times the fastest so far: not a finalist, the last step timed
TARGET_SHARE = 0.8
RESULTS = "benchmarks/results/planner_oracle"


def oracle(request: PlanRequest, steps: int, console: Console) -> list[dict]:
    """Every configuration of the planner's space, measured, with its feasibility under the budget — but for those
    too slow to be the fastest: a configuration whose warm-up step (one micro-batch and an optimizer step), or its
    warm-up forward and backward times its accumulation steps, passes PRUNE times the fastest feasible step measured
    so far is stopped there (a warm-up's pass was measured at most 1.4x a later one's, quiet), and one
    whose step is over CONTENDERS times that fastest is not measured for its peak (it cannot be a finalist), nor
    timed past its first step when that one is over ONE_STEP times the fastest. A configuration stopped in its
    warm-up is not tried at larger micro-batches: doubling the micro-batch would have to make a step over
    PRUNE / CONTENDERS (3.2) times faster for one to be a finalist (the speed-ups measured are in the results).
    Candidates are measured in the order of the cost model's prediction, so that the bound is tight early: the
    order saves time, it does not choose what is measured. Each row is saved to PARTIAL as it is measured, and the
    rows a stopped run saved there for this case, steps and CPU are read back, not measured again: a sweep of an
    hour or more can be finished in a later session."""
    saved = partial_rows(request, steps)
    if saved:
        console.print(f"[dim]  {len(saved)} configurations read back from {PARTIAL}[/dim]")
    rows = []
    for candidate, workload, per_replica in in_predicted_order(request):
        sizes = [m for m in divisors(per_replica) if m % candidate.batch_multiple == 0]
        if workload.with_trait("steps-in-backward"):   # it cannot accumulate: the whole batch at once (as planned)
            sizes = sizes[-1:]
        for micro in sizes:
            row = saved.get((tuple(candidate.labels()), micro))
            if row is None:
                row = sweep_row(request, candidate, micro, per_replica, steps, fastest_feasible(rows), console)
                save_partial(request, steps, [*rows, row])
            rows.append(row)
            if row["fits"] is False:
                break   # a larger micro-batch only needs more
            if "too_slow_over_s" in row:
                break   # a larger one is not PRUNE / CONTENDERS times faster (micro_batch_speedup says how much)
    return rows


def sweep_row(request: PlanRequest, candidate, micro: int, per_replica: int, steps: int, fastest: float | None,
              console: Console) -> dict:
    workload = candidate.workload(request, micro)
    accum = per_replica // micro
    row = {"techniques": candidate.labels(), "micro_batch": micro, "grad_accum": accum}
    batches = text_batches(batch_size=micro, seq_len=workload.effective_seq_len, num_batches=steps + 1)
    name = f"{' + '.join(candidate.labels())} {micro}×{accum}"
    try:
        seconds = step_seconds(workload, batches, accum, limit_s=PRUNE * fastest if fastest else None,
                               one_step_limit_s=ONE_STEP * fastest if fastest else None)
        if fastest and seconds > CONTENDERS * fastest:
            console.print(f"[dim]  {name}: {seconds:.3f} s, not a finalist: its peak is not measured[/dim]")
            return dict(row, peak_bytes=None, step_time_s=seconds, fits=None)
        peak = peak_bytes(workload)
    except TooSlow as slow:
        if slow.seconds is not None:
            console.print(f"[dim]  {name}: {slow.seconds:.3f} s in its first timed step, not a finalist[/dim]")
            return dict(row, peak_bytes=None, step_time_s=slow.seconds, fits=None, timed_steps=1)
        console.print(f"[dim]  {name}: its warm-up passed {PRUNE:g}x the fastest step so far[/dim]")
        return dict(row, peak_bytes=None, step_time_s=None, fits=None, too_slow_over_s=PRUNE * fastest)
    except (MemfitError, RuntimeError) as exc:
        console.print(f"[dim]  {name}: failed ({exc})[/dim]")
        return dict(row, peak_bytes=None, step_time_s=None, fits=False, failed=str(exc))
    fits = peak <= request.budget_bytes
    console.print(f"[dim]  {name}: {format_bytes(peak)}, {seconds:.3f} s{'' if fits else ' (over)'}[/dim]")
    return dict(row, peak_bytes=peak, step_time_s=seconds, fits=fits)


def micro_batch_speedup(rows: list[dict]) -> float | None:
    """The most a configuration's step got faster from one micro-batch to the next larger one, over those measured
    at both (the sweep stops a configuration's larger micro-batches when one is too slow by PRUNE: this is the
    check on it)."""
    timed = {(tuple(r["techniques"]), r["micro_batch"]): r["step_time_s"] for r in rows
             if r.get("step_time_s") and not r.get("timed_steps")}
    speedups = []
    for (techniques, micro), seconds in timed.items():
        larger = min((m for t, m in timed if t == techniques and m > micro), default=None)
        if larger is not None:
            speedups.append(seconds / timed[techniques, larger])
    return round(max(speedups), 3) if speedups else None


def fastest_feasible(rows: list[dict]) -> float | None:
    return min((r["step_time_s"] for r in rows if r["fits"]), default=None)


def in_predicted_order(request: PlanRequest) -> list:
    """The search's candidates, fastest first as the cost model predicts them at their smallest micro-batch."""
    search = Search(request)

    def predicted(entry) -> float:
        candidate, workload, per_replica = entry
        try:
            estimate = search.estimate(workload)
        except MemfitError:
            return float("inf")
        return step_time(workload, estimate, request.gpu, grad_accum=per_replica // candidate.batch_multiple,
                         num_gpus=candidate.num_gpus, cost=request.cost).total_s
    return sorted(search.workloads(), key=predicted)


PARTIAL = f"{RESULTS}.partial.json"   # the case a stopped sweep was measuring, its rows so far


def partial_key(request: PlanRequest, steps: int) -> list:
    return [request.model, request.seq_len, request.global_batch, request.budget_bytes, steps, this_cpu()]


def this_cpu() -> str:
    """The processor the sweep runs on: its measurements hold for that one (a bfloat16 step is 1.3x faster than a
    float32 one on a CPU with AMX units, 15x slower on one without)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            info = fh.read()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = next(line for line in info.splitlines() if line.startswith("flags")).split()
        name += " (" + (" ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "no bf16 units") + ")"
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} CPUs"


def partial_rows(request: PlanRequest, steps: int) -> dict[tuple, dict]:
    try:
        with open(PARTIAL) as fh:
            saved = json.load(fh)
    except FileNotFoundError:
        return {}
    if saved["case"] != partial_key(request, steps):
        return {}
    return {(tuple(r["techniques"]), r["micro_batch"]): r for r in saved["configurations"]}


def save_partial(request: PlanRequest, steps: int, rows: list[dict]) -> None:
    with open(PARTIAL + ".tmp", "w") as fh:
        json.dump({"case": partial_key(request, steps), "configurations": rows}, fh)
    os.replace(PARTIAL + ".tmp", PARTIAL)


def run_case(model: str, seq_len: int, global_batch: int, fraction: float, steps: int, console: Console,
             measured_before: list[dict] | None = None) -> dict:
    """One case: memfit's plan, and every configuration measured (or, given `measured_before`, those measurements of
    an earlier run: memfit plans again, the oracle's figures are kept)."""
    plain_workload = resolve(Workload(model=model, task="train", batch_size=global_batch, seq_len=seq_len))
    plain = analytic_estimate(plain_workload)
    budget = int(plain.peak_bytes * fraction)
    gpu = cpu_as_gpu(budget, model, seq_len, max(divisors(global_batch)))
    cost = calibrate(gpu, model, seq_len, divisors(global_batch))
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
            "too_slow": sum(r["fits"] is None for r in rows),
            "largest_micro_batch_speedup": micro_batch_speedup(rows),
            "oracle_best": best, "planning_s": round(planning_s, 2), "plan": None,
            "cost_model": {k: v for k, v in vars(cost).items()}, "configurations": rows}
    if not chosen.feasible:
        case["plan"] = {"feasible": False, "reason": chosen.reason}
        return case
    top = chosen.plan_json(0)
    plan_row = {"techniques": top["techniques"], "micro_batch": top["micro_batch"], "grad_accum": top["grad_accum"]}
    finalists = sorted(feasible, key=lambda r: r["step_time_s"])[:FINALISTS]
    again = side_by_side(request, [plan_row, *(r for r in finalists if not same(r, plan_row))], chosen.plans[0],
                         steps, console)
    mine = again[0]
    if finalists:   # the oracle's best: the fastest finalist in the side-by-side rounds
        best = case["oracle_best"] = min(again[1:] + ([mine] if any(same(r, mine) for r in finalists) else []),
                                         key=lambda r: r["step_time_s"])
    case["finalists"] = again
    case["plan"] = {"techniques": top["techniques"], "micro_batch": top["micro_batch"], "grad_accum": top["grad_accum"],
                    "predicted_peak_bytes": top["peak_bytes"], "predicted_step_time_s": top["step_time_s"],
                    "measured_peak_bytes": mine["peak_bytes"], "measured_step_time_s": mine["step_time_s"],
                    "fits_when_run": mine["peak_bytes"] <= budget}
    if best:
        case["plan"]["time_vs_oracle"] = mine["step_time_s"] / best["step_time_s"]
    return case


def same(row: dict, other: dict) -> bool:
    return row["techniques"] == other["techniques"] and row["micro_batch"] == other["micro_batch"]


def side_by_side(request: PlanRequest, rows: list[dict], plan_found, steps: int, console: Console) -> list[dict]:
    """`rows` (memfit's plan first, then the sweep's fastest feasible configurations) measured again in ROUNDS
    round-robin rounds: each one's peak, and its median step time over the rounds — the machine is shared, and a
    sweep of hundreds of configurations takes long enough for its speed to drift, so the oracle's best and memfit's
    plan are compared in one sitting."""
    candidates = {tuple(c.labels()): c for c, _, _ in Search(request).workloads()}
    workloads = [plan_found.workload(request)] + [candidates[tuple(r["techniques"])].workload(request, r["micro_batch"])
                                                  for r in rows[1:]]
    peaks, times = [None] * len(rows), [[] for _ in rows]
    for _ in range(ROUNDS):
        for i, (row, workload) in enumerate(zip(rows, workloads)):
            batches = text_batches(batch_size=row["micro_batch"], seq_len=workload.effective_seq_len,
                                   num_batches=steps + 1)
            times[i].append(step_seconds(workload, batches, row["grad_accum"]))
            peaks[i] = peaks[i] if peaks[i] is not None else peak_bytes(workload)
    again = [dict(row, peak_bytes=peak, step_time_s=median(seconds), rounds=seconds)
             for row, peak, seconds in zip(rows, peaks, times)]
    for row in again:
        console.print(f"[dim]  again: {' + '.join(row['techniques'])} {row['micro_batch']}×{row['grad_accum']}: "
                      f"{row['step_time_s']:.3f} s[/dim]")
    return again


def render(cases: list[dict]) -> Table:
    table = Table(title="memfit plan vs the oracle (every configuration measured for real on this CPU)",
                  title_justify="left")
    for column in ("case", "budget", "measured / too slow / feasible", "oracle's best", "oracle time", "memfit's plan",
                   "plan peak: predicted / measured", "plan time", "vs oracle", "pass"):
        table.add_column(column, justify="left" if column in ("case", "oracle's best", "memfit's plan") else "right")
    for case in cases:
        best, mine = case["oracle_best"], case["plan"]
        name = f"{case['model']} s{case['seq_len']} G{case['global_batch']}"
        best_text = f"{' + '.join(best['techniques'])} {best['micro_batch']}×{best['grad_accum']}" if best else "none"
        if not mine or mine.get("feasible") is False:
            table.add_row(name, format_bytes(case["budget_bytes"]), counts(case), best_text, "",
                          "no plan", "", "", "", "no" if best else "yes")
            continue
        ok = mine["fits_when_run"] and mine.get("time_vs_oracle", 99) <= 1 + TOLERANCE
        table.add_row(name, format_bytes(case["budget_bytes"]), counts(case),
                      best_text, f"{best['step_time_s']:.3f} s" if best else "",
                      f"{' + '.join(mine['techniques'])} {mine['micro_batch']}×{mine['grad_accum']}",
                      f"{format_bytes(mine['predicted_peak_bytes'])} / {format_bytes(mine['measured_peak_bytes'])}",
                      f"{mine['measured_step_time_s']:.3f} s", f"{mine.get('time_vs_oracle', 0):.3f}",
                      "yes" if ok else "no")
    return table


def counts(case: dict) -> str:
    return f"{case['configurations_measured']} / {case.get('too_slow', 0)} / {case['feasible']}"


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
    header = f"{command}\n{this_cpu()}; {platform.platform()}, torch {torch.__version__}\n"
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
            if os.path.exists(PARTIAL):   # its rows are in the case now
                os.remove(PARTIAL)
        write(cases, header, console, final=len(cases) == args.cases)


def earlier_cases(steps: int) -> dict[tuple, dict]:
    """The cases of an earlier run with these steps on this CPU, by workload, whose budget is the zoo's budget today."""
    try:
        with open(f"{RESULTS}.json") as fh:
            earlier = json.load(fh)
    except FileNotFoundError:
        return {}
    if f"--steps {steps} " not in earlier["command"] + " " or earlier.get("cpu") != this_cpu():
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
        file_console.print("the most a step got faster from one micro-batch to the next, by case (a configuration "
                           f"stopped in its warm-up is not tried larger: {PRUNE / CONTENDERS:.1f}x would be needed): "
                           + ", ".join(f"{c['model']} s{c['seq_len']} {c.get('largest_micro_batch_speedup')}"
                                       for c in cases))
    with open(f"{RESULTS}.json", "w") as fh:
        json.dump({"command": header.splitlines()[0], "cpu": this_cpu(), "cases": cases, "share_passed": share}, fh,
                  indent=2)
    docs_sync.sync()


if __name__ == "__main__":
    main()
