"""Bytes inside, units only at the edge.

Every number in the core is an integer count of bytes. These helpers turn bytes into text for people
(GiB by default, which is what `nvidia-smi` and torch print; GB on request) and parse sizes people type.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum

KiB = 1024
MiB = 1024**2
GiB = 1024**3
KB = 1000
MB = 1000**2
GB = 1000**3


class Unit(StrEnum):
    GIB = "GiB"
    GB = "GB"
    MIB = "MiB"

    @property
    def factor(self) -> int:
        return {Unit.GIB: GiB, Unit.GB: GB, Unit.MIB: MiB}[self]


def to_unit(nbytes: float, unit: Unit | str = Unit.GIB) -> float:
    return nbytes / Unit(unit).factor


def fmt_bytes(nbytes: float, unit: Unit | str = Unit.GIB, digits: int = 2, suffix: bool = True) -> str:
    """Format a byte count in one unit, e.g. ``fmt_bytes(13.5e9) == '12.57 GiB'``."""
    unit = Unit(unit)
    text = f"{nbytes / unit.factor:,.{digits}f}"
    return f"{text} {unit.value}" if suffix else text


def fmt_auto(nbytes: float, binary: bool = True) -> str:
    """Format with the largest unit that keeps the number >= 1 (for small items such as norms)."""
    step = 1024 if binary else 1000
    names = ["B", "KiB", "MiB", "GiB", "TiB"] if binary else ["B", "kB", "MB", "GB", "TB"]
    value = float(nbytes)
    for name in names:
        if abs(value) < step or name == names[-1]:
            return f"{value:,.0f} {name}" if name == "B" else f"{value:,.2f} {name}"
        value /= step
    raise AssertionError("unreachable")


def fmt_count(n: int) -> str:
    """Parameter counts the way model cards write them: 6.74B, 494M, 20.0M."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}K"
    return str(n)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_FACTORS = {
    "": 1, "b": 1,
    "k": KB, "kb": KB, "kib": KiB,
    "m": MB, "mb": MB, "mib": MiB,
    "g": GB, "gb": GB, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """Parse '24GB', '80 GiB', '1.5e9' (bytes) into bytes. Raises ValueError with the accepted forms."""
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _FACTORS:
        raise ValueError(f"cannot read size {text!r}: write e.g. 24GiB, 80GB or a number of bytes")
    value = float(m.group(1)) * _FACTORS[m.group(2).lower()]
    if not math.isfinite(value) or value >= 2**63:
        raise ValueError("too large: write at most 8 EiB")
    return int(value)
