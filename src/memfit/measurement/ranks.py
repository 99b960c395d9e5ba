"""Measuring a distributed workload for real: torchrun starts `world_size` ranks on this machine (gloo
on CPU), each runs the same measured step with its own allocator and profiler and writes its result;
the rank with the highest peak is reported, every rank's peak beside it.

`python -m memfit.measurement.ranks OUT_DIR WORKLOAD_JSON` is the per-rank entry point.
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
    n = workload.world_size
    with tempfile.TemporaryDirectory(prefix="memfit-ranks-") as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   "-m", "memfit.measurement.ranks", out, json.dumps(workload.to_json())]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise MemfitError(f"the {n}-rank run did not finish in {RANK_TIMEOUT_S} s.") from None
        if done.returncode:
            lines = (done.stderr or done.stdout).strip().splitlines()
            errors = [line for line in lines if "Error" in line or "error:" in line][-5:]
            raise MemfitError(f"the {n}-rank torchrun run failed (exit {done.returncode}):\n"
                              + "\n".join(errors or lines[-15:]))
        results = []
        for rank in range(n):
            with open(os.path.join(out, f"rank{rank}.json")) as fh:
                results.append(MemoryEstimate.from_json(json.load(fh)))
    top = max(results, key=lambda r: r.peak_bytes)
    top.extra["rank_peak_bytes"] = [r.peak_bytes for r in results]
    top.notes.append(f"measured on {n} ranks (torchrun, gloo); the highest per-rank peak is shown")
    return top


def _rank_main(out: str, workload_json: str) -> None:
    import torch.distributed as dist

    from memfit.measurement.run import measure_run

    dist.init_process_group("gloo")
    try:
        result = measure_run(Workload.from_json(json.loads(workload_json)), device="cpu")
        with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as fh:
            json.dump(result.to_json(), fh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
