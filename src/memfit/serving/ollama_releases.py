"""Ollama's releases: each one's date (its release tags), the changes to how it sized a load that memfit replays
(CHANGES, each with the commit that made it), how a release sizes one (its estimate, its layout, llama.cpp's --fit)
and its defaults (num_ctx, OLLAMA_NUM_PARALLEL). A release is named by its version (0.5.4) or a date."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources

from memfit.core.errors import MemfitError

GiB = 1 << 30

# change: (first release, first release without it or None, what changed)
CHANGES = {
    "graph_logits": ((0, 3, 10), None, "2003d6015: llama's full-offload graph at least the logits' 4 x batch x "
                                       "(n_embd + n_vocab)"),
    "weights_without_kv": ((0, 6, 1), None, "033cec232: memory.weights.* no longer count the KV cache"),
    "weights_total_with_output": ((0, 6, 3), None, "f4f0992b6: memory.weights.total adds the output layer"),
    "kv_per_layer": ((0, 6, 3), None, "f66216e39: the KV cache layer by layer (Gemma 3's window layers hold slots x "
                                      "window + batch cells); the fallback graph from the most heads"),
    "last_layer_first": ((0, 7, 0), None, "0478d440f: the layers placed last first, each one left off counted in "
                                          "required.full"),
    "largest_layer_reserve": ((0, 7, 0), (0, 7, 1), "0478d440f: the largest layer group held in reserve, not "
                                                     "blk.0 (3fe74fba4 went back)"),
    "output_always_counted": ((0, 7, 1), None, "a2cc8571c: an output layer left off the GPU counted in "
                                               "required.full even where num_gpu stopped the layers"),
    "gemma3_projector": ((0, 6, 1), None, "033cec232: Gemma 3's image encoder counted (its v.* weights and a "
                                          "graph) on the first GPU"),
    "projector_with_output": ((0, 7, 1), None, "d75557747: its own engine's projector placed with the output layer "
                                               "(num_ctx at least 2048)"),
    "gpt_oss": ((0, 11, 1), None, "fa7776fd2: gpt-oss's window layers and graph"),
    "layout": ((0, 12, 11), None, "f560bd077: the llama runner's layers laid out as the engine's (on memory "
                                  "synthesized from GraphSize); the estimate gone"),
    "llama_server_fit": ((0, 30, 0), None, "llama-server run with llama.cpp's --fit"),
}
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?$")
_DATE = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")


def _release_dates() -> dict[str, str]:
    text = resources.files("memfit.specs").joinpath("ollama_releases.json").read_text()
    return json.loads(text)["releases"]


@dataclass(frozen=True)
class OllamaRelease:
    version: tuple[int, int, int]

    @classmethod
    def parse(cls, text: str) -> OllamaRelease:
        match = _VERSION.match(text.strip())
        if not match:
            raise MemfitError(f"--engine-version {text}: an Ollama release is named like 0.5.4 (or a llama.cpp "
                              "build's date, YYYY-MM).")
        return cls((int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)))

    @classmethod
    def at(cls, date: str) -> OllamaRelease:
        """The newest release made by `date` (YYYY-MM[-DD])."""
        dates = _release_dates()
        made = [v for v, d in dates.items() if d <= (date if len(date) == 10 else date + "-31")]
        if not made:
            raise MemfitError(f"--engine-version {date}: before Ollama's first release ({min(dates.values())}).")
        return cls(max(tuple(int(n) for n in v.split(".")) for v in made))   # type: ignore[arg-type]

    @property
    def name(self) -> str:
        return ".".join(str(n) for n in self.version)

    @property
    def date(self) -> str:
        """The release's date, which stands for the llama.cpp it vendors (assumed: it is at most weeks older)."""
        dates = _release_dates()
        known = [tuple(int(n) for n in v.split(".")) for v in dates]
        made = [v for v in known if v <= self.version]
        if not made:
            raise MemfitError(f"Ollama {self.name}: before its first release.")
        return dates[".".join(str(n) for n in max(made))]

    def has(self, change: str) -> bool:
        since, until, _ = CHANGES[change]
        return self.version >= since and (until is None or self.version < until)

    @property
    def sizing(self) -> str:
        """How this release sizes a load of its llama.cpp runner: estimate, layout or fit."""
        return "fit" if self.has("llama_server_fit") else "layout" if self.has("layout") else "estimate"


NEWEST_ESTIMATE = OllamaRelease((0, 12, 10))


def newest_release() -> OllamaRelease:
    """The newest release memfit knows the date of."""
    return OllamaRelease(max(tuple(int(n) for n in v.split(".")) for v in _release_dates()))  # type: ignore[arg-type]


def release_named(text: str | None) -> tuple[OllamaRelease, str | None]:
    """An Ollama release named by its version (0.5.4) or a date (the release then), and the llama.cpp build it ran:
    the date given, else the release's date (None: no release named, the newest rules)."""
    if text is None:
        return newest_release(), None
    if _DATE.match(text):
        return OllamaRelease.at(text), text
    release = OllamaRelease.parse(text)
    return release, release.date


def default_num_ctx(release: OllamaRelease, total_vram: int) -> int:
    """num_ctx when neither the request nor OLLAMA_CONTEXT_LENGTH sets it: 2048, 4096 from 0.6.7 (44b466eeb), and
    from 0.15.5 by the GPUs' total memory (0334ffa62: 262144 from 47 GiB, 32768 from 23 GiB)."""
    if release.version < (0, 6, 7):
        return 2048
    if release.version < (0, 15, 5):
        return 4096
    return 262144 if total_vram >= 47 * GiB else 32768 if total_vram >= 23 * GiB else 4096


def default_parallel(release: OllamaRelease) -> int:
    """OLLAMA_NUM_PARALLEL's default (server/sched.go): 4, 2 from 0.6.7 (fe5b9bb21), 1 from 0.10.0 (20c3266e9)."""
    return 4 if release.version < (0, 6, 7) else 2 if release.version < (0, 10, 0) else 1
