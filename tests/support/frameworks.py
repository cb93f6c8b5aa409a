"""The training frameworks' own code, imported for the conformance tests (the ``conformance`` extra).

LLaMA-Factory 0.9.5 and axolotl 0.19.0 pin older transformers / TRL / peft than VRAM Lab's, so they are
installed without their dependencies (``pip install --no-deps``); their packages' ``__init__`` then fail to
import (LLaMA-Factory's imports TRL 0.x's value-head model, axolotl's its whole trainer stack). The modules
held here (argument dataclasses, the freeze step, the config schema) import without those: :func:`module`
imports one of them with its parent packages made bare (their ``__init__`` not run), so the code that runs is
the framework's own file, unchanged. A module that still cannot import skips the test that needs it."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

BARE = {"llamafactory", "axolotl", "swift"}  # installed --no-deps: their package __init__ is not run
_ROOTS: dict[str, Path] = {}  # a framework's package folder, found before its bare package is in sys.modules


def module(dotted: str) -> types.ModuleType:
    """``import dotted`` with the packages above it bare; skips the test when the framework is absent or
    the module does not import here."""
    top = dotted.split(".", maxsplit=1)[0]
    if top not in BARE:
        try:
            return importlib.import_module(dotted)
        except ImportError as e:
            pytest.skip(f"{dotted} is not installed or does not import here ({e}): pip install -e .[conformance]")
    if top not in _ROOTS:
        try:
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            found = None
        if found is None or not found.submodule_search_locations:
            pytest.skip(f"{top} is not installed (pip install -e .[conformance])")
        _ROOTS[top] = Path(next(iter(found.submodule_search_locations)))
    root = _ROOTS[top]
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            bare = types.ModuleType(name)
            bare.__path__ = [str(root.joinpath(*parts[1:i]))]
            sys.modules[name] = bare
    try:
        return importlib.import_module(dotted)
    except ImportError as e:
        pytest.skip(f"{dotted} does not import here ({e})")


def version(dist: str) -> str:
    from importlib.metadata import version as v

    return v(dist)
