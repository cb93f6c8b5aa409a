"""unsloth's and unsloth_zoo's own source, as ``make conformance`` unpacks their wheels (unsloth imports only with a
GPU and triton, so it is read, not installed) into the folder ``VRAMLAB_UNSLOTH_SRC`` names, and xformers' Python
(its wheel unpacked there too): where each test finds a file, picks the definitions it runs, and runs them."""

from __future__ import annotations

import ast
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest


def unsloth_source(*parts: str) -> Path:
    """``parts`` below the unpacked wheels (``unsloth/kernels/rope_embedding.py``, ``unsloth_zoo/fused_losses``);
    skips the test where they are not there."""
    path = Path(os.environ.get("VRAMLAB_UNSLOTH_SRC", "/nonexistent")).joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{'/'.join(parts)} not unpacked (set VRAMLAB_UNSLOTH_SRC; make conformance)")
    return path


def definitions(src: Path, names: Iterable[str] | Callable[[str], bool]) -> list[ast.stmt]:
    """The module-level classes and functions of ``src`` called one of ``names`` (or whose name it accepts), as
    written."""
    wanted = names if callable(names) else set(names).__contains__
    return [n for n in ast.parse(src.read_text()).body
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and wanted(n.name)]


def run_definitions(src: Path, body: list[ast.stmt], namespace: dict) -> dict:
    """``body`` (read from ``src``) run in ``namespace``, which supplies the names it reads; the namespace."""
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    exec(compile(module, str(src), "exec"), namespace)  # noqa: S102 - the library's own code
    return namespace
