"""The training frameworks' own code, imported for the conformance tests (the ``conformance`` extra).

LLaMA-Factory 0.9.5 and axolotl 0.19.0 pin older transformers / TRL / peft than VRAM Lab's, so they are
installed without their dependencies (``pip install --no-deps``); their packages' ``__init__`` then fail to
import (LLaMA-Factory's imports TRL 0.x's value-head model, axolotl's its whole trainer stack). The modules
held here (argument dataclasses, the freeze step, the config schema) import without those: :func:`module`
imports one of them with its parent packages made bare (their ``__init__`` not run), so the code that runs is
the framework's own file, unchanged. A module that still cannot import skips the test that needs it."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
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
            pytest.skip(f"{dotted} is not installed or does not import here ({e}): pip install -e .[conformance]",
                        allow_module_level=True)
    if top not in _ROOTS:
        try:
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            found = None
        if found is None or not found.submodule_search_locations:
            pytest.skip(f"{top} is not installed (pip install -e .[conformance])", allow_module_level=True)
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
        pytest.skip(f"{dotted} does not import here ({e})", allow_module_level=True)


def version(dist: str) -> str:
    from importlib.metadata import version as v

    return v(dist)


def source_defaults(dist: str, where: str) -> dict[str, object]:
    """The field defaults of a dataclass read from its source file in the installed distribution (``where`` is
    ``path/in/site-packages.py:Class``), for a framework that does not import here (ms-swift pins transformers
    < 5.20 and trl < 1.0). Only the class's own fields: a literal, ``field(default=...)`` or
    ``field(default_factory=list | dict | lambda: literal)``."""
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed (pip install -e .[conformance])")
    path, _, cls = where.partition(":")
    found = next((f for f in files if str(f) == path), None)
    if found is None:
        pytest.skip(f"{dist} has no {path}")
    tree = ast.parse(Path(found.locate()).read_text(encoding="utf-8"))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    out: dict[str, object] = {}
    for stmt in node.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name) or stmt.value is None:
            continue
        out[stmt.target.id] = _value(stmt.value)
    return out


def _value(node: ast.expr) -> object:
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "field":
        kw = {k.arg: k.value for k in node.keywords}
        if "default" in kw:
            return _value(kw["default"])
        factory = kw.get("default_factory")
        if isinstance(factory, ast.Name):
            return {"list": [], "dict": {}}[factory.id]
        if isinstance(factory, ast.Lambda):
            return ast.literal_eval(factory.body)
        return object()  # a default that is not a plain value: compares unequal
    try:
        return ast.literal_eval(node)
    except ValueError:
        return object()
