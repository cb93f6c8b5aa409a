"""Edits of a setup: what follows from a change of some fields (the one rule the CLI and the window apply), and
setup fields read back from a file value by value."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import DType, Method, Optimizer
from vramlab.core.spec.training import TrainingSetup

LORA_VARIANTS = ("use_dora", "use_rslora", "lora_fa")  # peft's LoRA options, each refused without adapters


def follow_changes(current: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """What follows from an edit of setup fields (``TrainingSetup`` keyword arguments): the one rule the CLI
    and the window both apply. A method change brings the weight storage it needs, unless the same edit
    names the storage too: QLoRA a quantized base (nf4), every other method a float one (bf16). A change to
    a method without adapters (full, freeze) drops LoRA's variants (DoRA, rsLoRA, LoRA-FA). A change to
    an 8-bit optimizer drops the torch implementation choice (it has none), unless the edit names one.
    Returns only the consequences; the caller applies ``{**current, **changes, **consequences}``."""
    new = {**current, **changes}
    out: dict[str, Any] = {}
    if "method" in changes and "weights" not in changes:
        method = Method(new["method"])
        weights = DType(new["weights"]) if new.get("weights") is not None else None
        if method is Method.QLORA and (weights is None or not weights.is_quantized):
            out["weights"] = DType.NF4
        elif method is not Method.QLORA and weights is not None and weights.is_quantized:
            out["weights"] = DType.BF16
    if "method" in changes and Method(new["method"]) not in (Method.LORA, Method.QLORA):
        # LoRA's variants are refused without adapters: a method without them drops those the edit does not name
        out.update({k: False for k in LORA_VARIANTS if new.get(k) and k not in changes})
    if "optimizer" in changes and "optimizer_impl" not in changes and new.get("optimizer") is not None \
            and not Optimizer(new["optimizer"]).has_impl_choice:
        out["optimizer_impl"] = None
    return out


def repair_setup_fields(data: Any, base: TrainingSetup | None = None, model: ModelSpec | None = None,
                        where: str = "setup") -> tuple[dict[str, Any], list[str]]:
    """Setup fields read back from a file we wrote earlier (the window's settings), checked value by value
    with the rules the CLI applies: a bad value is left out (so ``base``'s, the default, stays) and reported.
    If the values are each fine but do not go together, none is kept. Returns (fields, problems): the
    fields build a setup that validates, and every problem is one line for people.

    Files the user opens (scenarios) are refused whole instead, with the first problem: see
    :meth:`TrainingSetup.from_dict` and :meth:`validate`."""
    base = base or TrainingSetup()
    if not isinstance(data, Mapping):
        return {}, [f"{where}: expected an object of settings, found {type(data).__name__}; using the defaults"]
    names = {f.name for f in dataclasses.fields(TrainingSetup)}
    good: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in data.items():
        if key not in names or value is None:
            continue
        try:
            good[key] = getattr(base.replace(**{key: value}), key)
        except (SetupError, TypeError, ValueError) as e:
            problems.append(f"{where}: {_first_line(e)}; using {_shown_default(getattr(base, key))}")
            continue
        try:
            base.replace(**{key: value}).check_fields()
        except SetupError as e:
            good.pop(key)
            problems.append(f"{where}: {_first_line(e)}; using {_shown_default(getattr(base, key))}")
    try:
        base.replace(**good).validate(model)
    except SetupError as e:
        problems.append(f"{where}: {_first_line(e)}; using the defaults")
        good = {}
    return good, problems


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _shown_default(value: Any) -> str:
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, tuple):
        return ",".join(value)
    return "the default" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
