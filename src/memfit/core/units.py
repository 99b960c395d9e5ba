"""Byte units. Binary units (KiB, MiB, GiB, TiB) unless a name says GB."""
from __future__ import annotations

import re

from memfit.core.errors import MemfitError

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def format_bytes(num_bytes: float, digits: int = 2) -> str:
    """1536 -> '1.50 KiB'; negative values keep their sign."""
    sign = "-" if num_bytes < 0 else ""
    value = abs(float(num_bytes))
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= size:
            return f"{sign}{value / size:.{digits}f} {unit}"
    return f"{sign}{int(value)} B"


def parse_bytes(text: str) -> int:
    """'24GiB', '1 TiB', '80GB', '123456' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise MemfitError(f"cannot read {text!r} as a size; write e.g. 24GiB, 80GB or 512MiB.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
