"""Memory over one step as stacked categories (matplotlib, imported only when a plot is asked for)."""
from __future__ import annotations

import json

from memfit.core.errors import MemfitError
from memfit.core.units import GiB


def write_timeline(timeline: dict, path: str, title: str) -> None:
    if path.endswith(".json"):
        with open(path, "w") as fh:
            json.dump(timeline, fh)
        return
    plt = pyplot_for(path)
    events = timeline["event"]
    series = list(zip(*timeline["bytes"]))
    names = timeline["categories"]
    keep = [i for i, s in enumerate(series) if any(s)]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.stackplot(range(len(events)), *[[v / GiB for v in series[i]] for i in keep],
                 labels=[names[i] for i in keep], alpha=0.85)
    position = {event: n for n, event in enumerate(events)}
    for index, phase in timeline["phases"]:
        x = min(position.items(), key=lambda kv: abs(kv[0] - index))[1] if position else 0
        ax.axvline(x, color="k", lw=0.6, ls="--")
        ax.text(x, ax.get_ylim()[1] * 0.98, f" {phase}", va="top", fontsize=8)
    ax.set_xlabel("allocation events in the step")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pyplot_for(path: str):
    """matplotlib's pyplot (the file-only Agg backend) for a plot written to `path`, or a one-line error for a name
    it cannot write or a missing matplotlib."""
    check_timeline_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MemfitError("plots need matplotlib: pip install 'memfit[plot]'") from None
    return plt


def check_timeline_path(path: str) -> None:
    """A --timeline file name memfit can write: a plot (.png, .svg, .pdf) or the series (.json)."""
    if not path.endswith((".png", ".svg", ".pdf", ".json")):
        raise MemfitError(f"--timeline {path!r}: give a .png, .svg, .pdf or .json file name.")
