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


def parse_bytes(text: str, flag: str = "a size") -> int:
    """'24GiB', '1 TiB', '80GB', '0' -> bytes. A number without a unit is refused (is '64' GiB or bytes?), but for
    0, which is 0 in any unit."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise MemfitError(f"{flag}: cannot read {text!r} as a size; write e.g. 24GiB, 80GB or 512MiB.")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit and number != 0:
        raise MemfitError(f"{flag} {text}: give a unit, e.g. {match.group(1)}GiB ({match.group(1)} alone could be "
                          "bytes or GiB).")
    return int(number * _UNITS[unit])
