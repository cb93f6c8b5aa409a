"""Model families as units that plug in: a folder per family, one registry (:mod:`.registry`) naming them.

:func:`family` answers which family a ``model_type`` belongs to; :func:`piece` imports one of its modules
(``config``, ``vision``, ``program``, ``reference``) when it is first asked for, so that the estimator-only
build never imports a family's torch reference, and so that the registry (data) never imports its families.
The import-cycle check (``tests/test_architecture.py``) counts a :func:`piece` call as an import of that piece
of every family.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from vramlab.core.families.registry import FAMILIES, Family

_BY_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}


def family(model_type: str) -> Family | None:
    """The family that answers ``model_type``, or None when no folder does (the trace or a refusal then)."""
    return _BY_TYPE.get(model_type)


def piece(model_type: str, name: str) -> ModuleType | None:
    """The ``name`` module of ``model_type``'s family folder, or None when the family has no such piece."""
    f = _BY_TYPE.get(model_type)
    if f is None or name not in f.pieces:
        return None
    return importlib.import_module(f"vramlab.core.families.{f.name}.{name}")


def hand_written_towers() -> tuple[str, ...]:
    """The vision-language model types whose family folder has a hand-written program of the tower."""
    return tuple(t for f in FAMILIES if f.vision for t in f.model_types)
