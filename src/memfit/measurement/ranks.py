"""Measuring a distributed workload for real: torchrun starts `world_size` ranks on this machine (gloo
on CPU), each runs the same measured step with its own allocator and profiler and writes its result;
the rank with the highest peak is reported, every rank's peak beside it.

Several workloads of one world size run in one torchrun launch, one after the other in the same ranks
(`measure_ranks_many`, `train_ranks_many`): starting the ranks costs more than a small workload's step. If a
launch fails, each of its workloads runs alone, so that the error names its own.

Each rank runs `python -m memfit.measurement.rank_main OUT_DIR`; the jobs are in OUT_DIR/jobs.json: a measured
step (`measure_ranks_many`) or a short training run whose losses are compared with one process's
(`train_ranks_many`).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import cast

from memfit.core.errors import MemfitError
from memfit.estimators.breakdown import MemoryEstimate
from memfit.specs.workload import Workload
from memfit.steps.deepspeed_loop import build_deepspeed_ops
from memfit.techniques.resolve import resolve


def measure_ranks_many(workloads: Sequence[Workload]) -> list[MemoryEstimate]:
    """Each workload measured on its ranks: the rank with the highest peak, every rank's peak beside it."""
    measured = []
    for workload, per_rank in zip(workloads, run_rank_jobs([(w, {"job": "measure"}) for w in workloads])):
        results = [MemoryEstimate.from_json(r) for r in per_rank]
        top = max(results, key=lambda r: r.peak_bytes)
        top.extra["rank_peak_bytes"] = [r.peak_bytes for r in results]
        top.notes.append(f"measured on {workload.world_size} ranks (torchrun, gloo); the highest per-rank peak is "
                         "shown")
        measured.append(top)
    return measured


def train_ranks_many(workloads: Sequence[Workload], *, steps: int, lr: float | None = None) -> list[list[list[float]]]:
    """Train each workload on `world_size` real ranks for `steps` steps of the bundled text, every rank on the
    same batches (so the result is comparable with one process): each workload's losses on each rank."""
    return [[r["losses"] for r in per_rank] for per_rank in train_ranks_runs(workloads, steps=steps, lr=lr)]


def train_ranks_runs(workloads: Sequence[Workload], *, steps: int, lr: float | None = None) -> list[list[dict]]:
    """`train_ranks_many`, with each rank's step times: {"losses": [...], "step_seconds": [...]} per rank."""
    return run_rank_jobs([(w, {"job": "train", "steps": steps, "lr": lr}) for w in workloads])


def run_rank_jobs(jobs: list[tuple[Workload, dict]]) -> list[list[dict]]:
    """Each job's result on every rank, in the jobs' order: one launch per world size."""
    for offload, swaps in {(bool(r.with_trait("host-optimizer")), bool(r.with_trait("swaps-to-disk")))
                           for r in (resolve(w) for w, _ in jobs) if r.engine == "deepspeed"}:
        build_deepspeed_ops(offload=offload, swaps=swaps)
    results: list[list[dict] | None] = [None] * len(jobs)
    for world_size in sorted({w.world_size for w, _ in jobs}):
        indices = [i for i, (w, _) in enumerate(jobs) if w.world_size == world_size]
        try:
            for i, per_rank in zip(indices, _launch(world_size, [jobs[i] for i in indices])):
                results[i] = per_rank
        except RanksFailed:
            if len(indices) == 1:
                raise
            for i in indices:   # one at a time: the error names its own workload
                results[i] = _launch(world_size, [jobs[i]])[0]
    return cast("list[list[dict]]", results)   # every job's slot filled: each job has a world size


class RanksFailed(MemfitError):
    """A rank exited with an error (a timeout is a plain MemfitError: running the jobs again would wait again)."""


def rank_timeout_s() -> int:
    """How long one torchrun launch may take: MEMFIT_RANK_TIMEOUT_S, else 30 minutes."""
    value = os.environ.get("MEMFIT_RANK_TIMEOUT_S", "1800")
    if not value.isdigit() or int(value) == 0:
        raise MemfitError(f"MEMFIT_RANK_TIMEOUT_S must be a whole number of seconds, not {value!r}.")
    return int(value)


def _launch(n: int, jobs: list[tuple[Workload, dict]]) -> list[list[dict]]:
    timeout = rank_timeout_s()
    with tempfile.TemporaryDirectory(prefix="memfit-ranks-") as out:
        with open(os.path.join(out, "jobs.json"), "w") as fh:
            json.dump([{**job, "workload": workload.to_json()} for workload, job in jobs], fh)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   "-m", "memfit.measurement.rank_main", out]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stderr = _stop(process, out)
            where = [line.strip() for line in stderr.splitlines() if line.lstrip().startswith(("File", "Thread",
                                                                                                 "Current thread"))]
            raise MemfitError(f"the {n}-rank run did not finish in {timeout} s (MEMFIT_RANK_TIMEOUT_S); where the "
                              f"ranks were: {' | '.join(where[:24]) or 'no stack was printed'}") from None
        if process.returncode:
            lines = (stderr or stdout).strip().splitlines()
            errors = [line for line in lines if "Error" in line or "error:" in line]
            errors = [line for line in errors if line.startswith("[rank")][-5:] or errors[-5:]   # the ranks' own
            raise RanksFailed(f"the {n}-rank torchrun run failed (exit {process.returncode}): "
                              + " | ".join(line.strip() for line in errors or lines[-15:]))
        by_rank = []
        for rank in range(n):
            with open(os.path.join(out, f"rank{rank}.json")) as fh:
                by_rank.append(json.load(fh))
    return [list(per_job) for per_job in zip(*by_rank)]


def _stop(process: subprocess.Popen, out: str) -> str:
    """Stop a launch that hangs: ask each rank for its Python stacks (rank_main registers SIGUSR1 with
    faulthandler and writes its pid; torchrun starts each rank in a session of its own), stop torchrun, kill
    what is left; what they printed to stderr."""
    pids = []
    for name in glob.glob(os.path.join(out, "pid*")):
        with open(name) as fh:
            pids.append(int(fh.read()))
    for pid, sig in [(pid, signal.SIGUSR1) for pid in pids] + [(process.pid, signal.SIGTERM)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        time.sleep(1)
    try:
        process.wait(timeout=30)   # torchrun stops its ranks on SIGTERM
    except subprocess.TimeoutExpired:
        process.kill()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return process.communicate()[1] or ""
