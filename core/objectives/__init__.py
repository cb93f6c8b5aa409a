"""Training objectives as units that plug in: a folder per objective, one table (:mod:`.registry`) naming them.

:func:`unit` answers which folder models an objective; :func:`piece` imports one of its modules (``program``,
``reference``) when it is first asked for, so that the estimator-only build never imports a torch reference
and the table (data) never imports its units.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from vramlab.core.objectives.registry import UNITS, Unit
from vramlab.core.spec.options import Objective

_BY_OBJECTIVE: dict[Objective, Unit] = {o: u for u in UNITS for o in u.objectives}


def unit(objective: Objective) -> Unit:
    """The unit that models ``objective`` (every :class:`Objective` has one: tests/test_objectives.py)."""
    return _BY_OBJECTIVE[objective]


def piece(objective: Objective, name: str) -> ModuleType | None:
    """The ``name`` module of ``objective``'s folder, or None when the unit has no such piece."""
    u = _BY_OBJECTIVE[objective]
    if name not in u.pieces:
        return None
    return importlib.import_module(f"vramlab.core.objectives.{u.name}.{name}")
