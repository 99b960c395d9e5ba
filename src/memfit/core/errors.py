"""The one error type for user mistakes; the CLI prints it on one line and exits 2."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class MemfitError(Exception):
    """A user error: the message names the user's value, the rule, and a way out."""


class ImpossibleCombination(MemfitError):
    """Techniques that only an estimate finds do not go together, or do not fit the model (pruned heads that do not
    split over the ranks; a block-wise technique on a model with no repeated blocks): the planner counts the
    combination as refused and goes on."""


class NotModelled(MemfitError):
    """A combination the estimator asked has no model of (the analytic model's adapters and quantized linears
    outside decoder families): the planner counts it as refused and goes on; the message names the method that
    models it."""


def closest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """A 'did you mean' fragment for an unknown `name`, or '' when nothing is close."""
    matches = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.5)
    return f" Did you mean: {', '.join(matches)}?" if matches else ""


def require_choice(value: object, choices: Iterable[object], what: str) -> None:
    """`value` one of `choices`, else a MemfitError naming them (and the closest, for a mistyped string)."""
    options = list(choices)
    if value not in options:
        near = closest(value, map(str, options)) if isinstance(value, str) else ""
        raise MemfitError(f"{what} must be one of {', '.join(map(str, options))}, got {value!r}.{near}")


def require_positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MemfitError(f"{what} must be a positive integer, got {value!r}.")
    if value <= 0:
        raise MemfitError(f"{what} must be a positive integer, got {value}.")
    return value
