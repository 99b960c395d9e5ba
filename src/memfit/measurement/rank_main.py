"""One rank of a torchrun launch that measurement/ranks.py starts: each job of OUT_DIR/jobs.json in turn (a
workload's measured step, or a short training run), the results written as JSON to OUT_DIR/rank{N}.json.

    python -m memfit.measurement.rank_main OUT_DIR
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import sys

import torch.distributed as dist

from memfit.measurement.run import measure_run
from memfit.measurement.training import text_batches, train_run
from memfit.specs.workload import Workload
from memfit.techniques.resolve import resolve


def run_job(job: dict) -> dict:
    workload = resolve(Workload.from_json(job["workload"]))
    if job["job"] == "measure":
        return measure_run(workload, device="cpu").to_json()
    batches = text_batches(batch_size=workload.batch_size, seq_len=workload.effective_seq_len,
                           num_batches=job["steps"])
    run = train_run(workload, batches, lr=job["lr"])
    return {"losses": run.losses, "step_seconds": run.step_seconds}


def rank_main(out: str) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # ranks.py asks a rank that hangs for its stacks
    with open(os.path.join(out, f"pid{os.environ['RANK']}"), "w") as fh:
        fh.write(str(os.getpid()))
    with open(os.path.join(out, "jobs.json")) as fh:
        jobs = json.load(fh)
    dist.init_process_group("gloo")
    try:
        results = []
        for job in jobs:
            results.append(run_job(job))
            gc.collect()   # the job's model and optimizer go before the next one is measured
            # a rank that moves on (or closes its connections) while another still reads the tail of the last
            # collective (a broadcast, an all-reduce) fails that one with "connection closed by peer"
            dist.barrier()
        with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as fh:
            json.dump(results, fh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(sys.argv[1])
