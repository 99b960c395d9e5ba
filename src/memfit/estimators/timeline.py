"""Memory over one step by category, thinned to a few thousand points that keep every local peak."""
from __future__ import annotations

from memfit.core.categories import CATEGORIES
from memfit.estimators.tracker import Trace


def timeline_of(trace: Trace, max_points: int = 2000) -> dict:
    points = [(index, [totals[c] for c in CATEGORIES]) for index, totals in trace.walk()]
    if len(points) > max_points:
        size = -(-len(points) // max_points)
        points = [max(points[k:k + size], key=lambda p: sum(p[1])) for k in range(0, len(points), size)]
    return {"categories": list(CATEGORIES), "event": [p[0] for p in points],
            "bytes": [p[1] for p in points], "phases": [[i, name] for i, name in trace.measured_marks()]}
