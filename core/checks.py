"""The error every reader and check raises, and the checks of a number or a switch a user or a file gives.

The bottom of the core: it imports nothing of the project, so that the setup model, the vision rules, the
families and the readers can all raise the same error without importing each other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any


class SetupError(ValueError):
    """An impossible or inconsistent setup; the message tells the user what to change."""



_LABELS = {"seq_len": "sequence length", "grad_accum": "gradient accumulation", "gpus": "GPU count",
           "grad_ckpt": "gradient checkpointing", "amp": "autocast (amp)",
           "lora_rank": "LoRA rank", "lora_alpha": "LoRA alpha", "lora_dropout": "LoRA dropout",
           "loss_chunks": "loss chunks", "quant_block": "quantization block"}


def field_label(name: str) -> str:
    return _LABELS.get(name, name.replace("_", " "))


def short_repr(value: Any, limit: int = 40) -> str:
    """repr() for a message: at most ``limit`` characters, and never an error (a 5,000-digit number has none)."""
    try:
        text = repr(value)
    except ValueError:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_int(name: str, value: Any, lo: int, hi: int, label: str | None = None) -> int:
    """``value`` as a whole number in [lo, hi], else SetupError saying the range. Booleans, floats and
    strings are not whole numbers (a JSON ``true`` or ``8.5`` is an error, not 1 or 8)."""
    if isinstance(value, bool) or not isinstance(value, int):
        shown = short_repr(value)
        raise SetupError(f"{label or field_label(name)} must be a whole number from {lo:,} to {hi:,} (got {shown})")
    if not lo <= value <= hi:
        shown = f"{value:,}" if value.bit_length() < 128 else f"a number of about {value.bit_length() * 3 // 10} digits"
        raise SetupError(f"{label or field_label(name)} must be from {lo:,} to {hi:,} (got {shown})")
    return value


def check_float(name: str, value: Any, lo: float, hi: float, label: str | None = None,
                hi_open: bool = False) -> float:
    """``value`` as a finite number in [lo, hi] (or [lo, hi)), else SetupError saying the range."""
    label = label or field_label(name)
    upper = ")" if hi_open else "]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SetupError(f"{label} must be a number in [{lo:g}, {hi:g}{upper} (got {short_repr(value)})")
    try:
        v = float(value)
    except OverflowError:
        v = float("inf")
    if not math.isfinite(v) or v < lo or v > hi or (hi_open and v >= hi):
        raise SetupError(f"{label} must be a finite number in [{lo:g}, {hi:g}{upper} (got {short_repr(value)})")
    return v


def known_fields(cls: type, data: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``data`` as keyword arguments of the dataclass ``cls``; a key that is none of its fields is refused
    (``unknown <what> fields: ...``)."""
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise SetupError(f"unknown {what} fields: {', '.join(sorted(unknown))}")
    return dict(data)


def check_flag(name: str, value: Any, allow_none: bool = False) -> None:
    """A switch is true or false: "no", 0 or 1 in a file are errors, not guesses."""
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        raise SetupError(f"{field_label(name)} must be true or false (got {short_repr(value)})")
