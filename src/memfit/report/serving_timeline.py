"""A simulated serving run over time (speed.py's timeline): requests running and waiting, the KV cache's blocks in
use, and tokens per second (matplotlib, imported only when a plot is asked for; .json writes the series)."""
from __future__ import annotations

import json

from memfit.report.timeline_plot import pyplot_for


def write_serving_timeline(timeline: dict, blocks: int, path: str, title: str) -> None:
    if path.endswith(".json"):
        with open(path, "w") as fh:
            json.dump({**timeline, "kv_blocks_total": blocks}, fh)
        return
    plt = pyplot_for(path)
    times = timeline["time_s"]
    fig, (ax_requests, ax_blocks, ax_tokens) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    ax_requests.plot(times, timeline["running"], label="running")
    ax_requests.plot(times, timeline["waiting"], label="waiting")
    ax_requests.set_ylabel("requests")
    ax_requests.legend(loc="upper right", fontsize=8)
    ax_blocks.plot(times, [100 * b / blocks for b in timeline["kv_blocks"]], color="tab:purple")
    ax_blocks.set_ylabel("KV blocks in use (%)")
    ax_blocks.set_ylim(0, 105)
    starts = [0.0, *times[:-1]]
    rates = [(tokens / (end - start) if end > start else 0.0, out / (end - start) if end > start else 0.0)
             for start, end, tokens, out in zip(starts, times, timeline["tokens"], timeline["output_tokens"])]
    ax_tokens.plot(times, [r[0] for r in rates], label="tokens computed / s", lw=0.8)
    ax_tokens.plot(times, [r[1] for r in rates], label="output tokens / s", lw=0.8)
    ax_tokens.set_ylabel("tokens / s (per step)")
    ax_tokens.set_xlabel("seconds since the first request was sent")
    ax_tokens.legend(loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
