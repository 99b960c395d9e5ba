"""Measuring a distributed workload for real: torchrun starts `world_size` ranks on this machine (gloo
on CPU), each runs the same measured step with its own allocator and profiler and writes its result;
the rank with the highest peak is reported, every rank's peak beside it.

Each rank runs `python -m memfit.measurement.rank_main OUT_DIR WORKLOAD_JSON JOB_JSON`; the job is a measured
step (`measure_ranks`) or a short training run whose losses are compared with one process's (`train_ranks`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from memfit.core.errors import MemfitError
from memfit.estimators.breakdown import MemoryEstimate
from memfit.specs.workload import Workload

RANK_TIMEOUT_S = 1800


def measure_ranks(workload: Workload) -> MemoryEstimate:
    results = [MemoryEstimate.from_json(r) for r in _run_ranks(workload, {"job": "measure"})]
    top = max(results, key=lambda r: r.peak_bytes)
    top.extra["rank_peak_bytes"] = [r.peak_bytes for r in results]
    top.notes.append(f"measured on {workload.world_size} ranks (torchrun, gloo); the highest per-rank peak is shown")
    return top


def train_ranks(workload: Workload, *, steps: int, lr: float | None = None) -> list[list[float]]:
    """Train the workload on `world_size` real ranks for `steps` steps of the bundled text, every rank on
    the same batches (so the result is comparable with one process); each rank's losses."""
    return [r["losses"] for r in _run_ranks(workload, {"job": "train", "steps": steps, "lr": lr})]


def _run_ranks(workload: Workload, job: dict) -> list[dict]:
    n = workload.world_size
    with tempfile.TemporaryDirectory(prefix="memfit-ranks-") as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   "-m", "memfit.measurement.rank_main", out, json.dumps(workload.to_json()), json.dumps(job)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise MemfitError(f"the {n}-rank run did not finish in {RANK_TIMEOUT_S} s.") from None
        if done.returncode:
            lines = (done.stderr or done.stdout).strip().splitlines()
            errors = [line for line in lines if "Error" in line or "error:" in line]
            errors = [line for line in errors if line.startswith("[rank")][-5:] or errors[-5:]   # the ranks' own
            raise MemfitError(f"the {n}-rank torchrun run failed (exit {done.returncode}): "
                              + " | ".join(line.strip() for line in errors or lines[-15:]))
        results = []
        for rank in range(n):
            with open(os.path.join(out, f"rank{rank}.json")) as fh:
                results.append(json.load(fh))
    return results
