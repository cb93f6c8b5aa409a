"""The compiled build of the allocator replay: ``core/allocator.py`` itself, compiled by Cython as
``vramlab.core._allocator_c`` (typed by ``core/allocator.pxd``), three to five times as fast as the interpreted
module.

Everything else is declared in pyproject.toml, but the list of packages, which :func:`packages` finds. The
extension is optional: without Cython, or where the C
compiler fails, the install goes on and the interpreted module serves (the same results, slower). The copy
that is compiled differs from the source in one line, ``COMPILED_FROM``, which records the source's sha256:
allocator.py uses the compiled class only when that matches its own text, so an edited allocator.py is never
shadowed by an older build (``pip install -e .`` again rebuilds it).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "core" / "allocator.py"
MARKER = 'COMPILED_FROM = ""'


def extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("setup.py: Cython is not installed; the allocator replay stays interpreted")
        return []
    text = SOURCE.read_bytes()
    if text.count(MARKER.encode()) != 1:
        raise SystemExit(f"setup.py: {SOURCE} must hold exactly one line {MARKER!r}")
    digest = hashlib.sha256(text).hexdigest()
    out = HERE / "build" / "cython" / "vramlab" / "core"
    out.mkdir(parents=True, exist_ok=True)
    (out / "_allocator_c.py").write_bytes(text.replace(MARKER.encode(), f'COMPILED_FROM = "{digest}"'.encode()))
    (out / "_allocator_c.pxd").write_bytes((SOURCE.with_suffix(".pxd")).read_bytes())
    # -O1 without debug information: as fast here as Python's -O3 -g (the loop's time is in CPython's own
    # calls), a quarter of the compile time and a sixth of the size; MSVC keeps its defaults
    flags = [] if sys.platform == "win32" else ["-O1", "-g0"]
    ext = Extension("vramlab.core._allocator_c", [str((out / "_allocator_c.py").relative_to(HERE))],
                    extra_compile_args=flags)
    directives = {"language_level": 3, "overflowcheck": True, "annotation_typing": False}
    built = cythonize([ext], quiet=True, include_path=[str(HERE / "build" / "cython")], compiler_directives=directives)
    for e in built:
        e.optional = True  # a failed C compile leaves the interpreted module (cythonize does not carry this over)
    return built


def packages() -> list[str]:
    """Every folder with an ``__init__.py`` under the fixed top level, named in the ``vramlab`` namespace
    (``core/families/gemma3`` is ``vramlab.core.families.gemma3``): a new family or objective folder is
    installed without a line of its own here or in pyproject.toml."""
    found = []
    for top in ("core", "app", "resources"):
        for init in sorted((HERE / top).rglob("__init__.py")):
            if "__pycache__" not in init.parts:
                found.append("vramlab." + init.parent.relative_to(HERE).as_posix().replace("/", "."))
    return found


setup(ext_modules=extensions(), packages=packages())
