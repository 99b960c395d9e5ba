"""One rank of a torchrun job that measurement/ranks.py starts: the workload's measured step or a short
training run, written as JSON to `OUT_DIR/rank{N}.json`.

    python -m memfit.measurement.rank_main OUT_DIR WORKLOAD_JSON JOB_JSON
"""
from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from memfit.measurement.run import measure_run
from memfit.measurement.training import text_batches, train_run
from memfit.specs.workload import Workload
from memfit.techniques.resolve import resolve


def rank_main(out: str, workload_json: str, job_json: str) -> None:
    workload, job = resolve(Workload.from_json(json.loads(workload_json))), json.loads(job_json)
    dist.init_process_group("gloo")
    try:
        if job["job"] == "measure":
            result = measure_run(workload, device="cpu").to_json()
        else:
            batches = text_batches(batch_size=workload.batch_size, seq_len=workload.effective_seq_len,
                                   num_batches=job["steps"])
            result = {"losses": train_run(workload, batches, lr=job["lr"]).losses}
        with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as fh:
            json.dump(result, fh)
        # a rank that closes its connections while another still reads the tail of the last collective
        # (a broadcast, an all-reduce) fails that one with "connection closed by peer"
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2], sys.argv[3])
