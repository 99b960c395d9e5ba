"""The llama.cpp changes that moved its buffers, with the pull request that made each and the date it was merged
(llama.cpp's repository; a release is named by its build's date, as Ollama and the published logs date them).
`--engine-version 2025-06` means llama.cpp as it was built then; the default is the release llama-cpp-python
0.3.36 vendors (the one run here), which has every change below."""
from __future__ import annotations

import re
from dataclasses import dataclass

from memfit.core.errors import MemfitError

# change: (merged, what changed)
CHANGES = {
    "kv_pad_32": ("2024-05-13", "PR 7257: the KV cache padded to 32 cells without flash attention (256 with it)"),
    "output_per_sequence": ("2024-03-26", "PR 6017: the output buffer holds a row per sequence, not per batch token "
                                          "(date assumed: the logs of b2459, 2024-03-18, still show n_batch rows)"),
    "swa_cache": ("2025-05-20", "PR 13194: the window layers get their own cache of the window and a ubatch "
                                "(before, the full context; date assumed: reviewed 2025-05-11)"),
    "kv_streams": ("2025-08-01", "virtual sequences (after PR 14285): --parallel slots get a stream each unless "
                                 "unified (before, one unified cache; date assumed)"),
    "kv_set_rows": ("2025-08-01", "PR 14959: K and V written with set_rows, whose row indices are graph inputs"),
    "kv_no_pad": ("2025-10-28", "PR 16812: the KV cache no longer padded"),
    "ctx_pad_256": ("2025-11-07", "PR 17046: n_ctx padded to 256"),
    "no_mask_pad": ("2025-12-10", "PR 17910: the attention mask's tokens no longer padded (to 32)"),
    "embd_input": ("2026-01-18", "PR 18898: every graph also takes an embeddings input (ggml_build_forward_select)"),
    "kv_rotation": ("2026-04-01", "PR 21038: a quantized KV cache stores Q, K and V rotated (Hadamard matrices as "
                                  "graph inputs, a matrix product each, and one on the attention's output)"),
    "f16_mask": ("2026-05-27", "PR 23764: with flash attention the mask is made F16, not F32 then cast"),
}
_DATE = re.compile(r"^(\d{4})-(\d{2})(?:-(\d{2}))?$")


@dataclass(frozen=True)
class Release:
    date: str | None = None   # None: the newest modelled

    def __post_init__(self) -> None:
        if self.date is not None and not _DATE.match(self.date):
            raise MemfitError(f"--engine-version {self.date}: a llama.cpp release is named by its build's date, "
                              "YYYY-MM or YYYY-MM-DD (e.g. 2025-06).")

    def has(self, change: str) -> bool:
        merged = CHANGES[change][0]
        if self.date is None:
            return True
        date = self.date if len(self.date) == 10 else self.date + "-01"
        return date >= merged

    def cells(self, n_ctx: int, flash_attn: bool) -> int:
        """The cells a cache of n_ctx tokens gets."""
        if self.has("ctx_pad_256"):
            pad = 256
        elif self.has("kv_no_pad"):
            pad = 1
        elif self.has("kv_pad_32"):
            pad = 256 if flash_attn else 32
        else:
            pad = 256
        return -(-n_ctx // pad) * pad
