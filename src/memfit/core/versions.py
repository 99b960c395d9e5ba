"""Which versions of its libraries memfit's models of their behaviour were read from and checked on.

The traced estimator and the measurements run the installed torch and transformers themselves (their autocast,
their model code, Inductor's partitioner): those follow whatever is installed. The analytic estimator, the GPU
emulation and the simulated allocator restate library behaviour as rules, and each rule is true of the versions it
was read from: `MODELLED` lists them, with the versions checked (the suite runs the newest, the GPU validation ran
the oldest). No rule is known to differ between those versions, so none is chosen by version yet; an estimate made
with a version outside a rule's range says so (`version_notes`), and `memfit --version` names the ranges.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version


@dataclass(frozen=True)
class Modelled:
    mechanism: str
    library: str
    oldest: str      # the oldest minor version checked ("2.11")
    newest: str      # the newest
    read_from: str   # where in the library the rules come from
    used_in: str = "estimate"   # the command whose figures rest on them: estimate (and plan), or measure

    @property
    def versions(self) -> str:
        return _span(self.oldest, self.newest)

    def covers(self, installed: str) -> bool:
        return _minor(self.oldest) <= _minor(installed) <= _minor(self.newest)


MODELLED = (
    Modelled("SDPA's kernel choice and what each kernel keeps", "torch", "2.11", "2.13",
             "sdp_utils.cpp, derivatives.yaml, flash_api.cpp (estimators/sdpa_backend.py)"),
    Modelled("autocast's op lists", "torch", "2.11", "2.13", "autocast_mode.cpp (estimators/analytic/ops.py)"),
    Modelled("the CUDA caching allocator", "torch", "2.11", "2.13",
             "CUDACachingAllocator.cpp (core/caching_allocator.py)"),
    Modelled("the memory profiler's categories", "torch", "2.13", "2.13",
             "torch.profiler._memory_profiler, a private API (steps/profiler.py)", used_in="measure"),
    Modelled("the model code of the analytic families", "transformers", "5.17", "5.24",
             "models/*/modeling_*.py, cache_utils.py (estimators/analytic/families/)"),
)
LIBRARIES = ("torch", "transformers")


def _minor(text: str) -> tuple[int, int]:
    """"2.13.0+cpu" -> (2, 13)."""
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def installed(library: str) -> str | None:
    """The installed version of `library` (read without importing it), or None."""
    try:
        return version(library)
    except PackageNotFoundError:
        return None


def checked_range(library: str, used_in: str = "estimate") -> str:
    """The versions every rule about `library` that `used_in` rests on was checked on ("2.11 to 2.13")."""
    rules = [m for m in MODELLED if m.library == library and m.used_in == used_in]
    oldest = max((m.oldest for m in rules), key=_minor)
    newest = min((m.newest for m in rules), key=_minor)
    return _span(oldest, newest)


def _span(oldest: str, newest: str) -> str:
    return oldest if oldest == newest else f"{oldest} to {newest}"


def version_notes(used_in: str = "estimate", versions: dict[str, str | None] | None = None) -> list[str]:
    """A note per library whose installed version (or the one `versions` gives) is outside the range of a rule
    the command `used_in` rests on."""
    notes = []
    for library in LIBRARIES:
        have = versions.get(library) if versions is not None else installed(library)
        if have is None:
            continue
        outside = [m for m in MODELLED if m.library == library and m.used_in == used_in and not m.covers(have)]
        if outside:
            notes.append(f"{library} {have} is installed; memfit's rules for "
                         + "; ".join(f"{m.mechanism} ({m.versions})" for m in outside)
                         + " were read from and checked on those versions only")
    return notes
