"""The boundary: core never imports Qt or pyqtgraph (also enforced by ruff via core/ruff.toml), and the
estimate path does not import torch (the window must appear before torch loads)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    script = code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    return set(json.loads(p.stdout.splitlines()[-1]))


def test_core_never_imports_qt():
    modules = [f"vramlab.core.{p.relative_to(ROOT / 'core').with_suffix('').as_posix().replace('/', '.')}"
               for p in (ROOT / "core").rglob("*.py") if p.name != "__init__.py"]
    loaded = _modules_after("\n".join(f"import {m}" for m in modules))
    assert not {m for m in loaded if m.split(".")[0] in ("PySide6", "shiboken6", "pyqtgraph")}


def test_estimate_path_does_not_import_torch():
    loaded = _modules_after(
        "from vramlab.core.catalog import find_model\n"
        "from vramlab.core.estimate import estimate\n"
        "from vramlab.core.spec.training import TrainingSetup\n"
        "estimate(find_model('llama-2-7b'), TrainingSetup(method='qlora'))"
    )
    assert "torch" not in loaded


def test_an_install_carries_every_module_as_a_package(tmp_path):
    """setup.py finds the packages (a new family or objective folder needs no line of its own): what setuptools
    would install holds every module of core/ and app/ under the vramlab namespace, each in a package it was
    told of (setuptools warns of a folder it only carries along as data)."""
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True)
    wanted = {f"vramlab/{p.relative_to(ROOT).as_posix()}" for top in ("core", "app") for p in (ROOT / top).rglob("*.py")
              if "__pycache__" not in p.parts}
    built = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.py")}
    assert wanted <= built, sorted(wanted - built)
    untold = re.findall(r"Package '(vramlab\.(?:core|app)[\w.]*)' is absent", run.stdout + run.stderr)
    assert not untold, untold


def _import_graph():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return import_graph


def test_no_import_cycle_in_core_or_app():
    """The house rule: the modules of core/ and app/ import each other without a cycle, counting lazy imports
    inside functions and a families.piece() lookup (tools/import_graph.py); TYPE_CHECKING imports aside."""
    ig = _import_graph()
    cycles = ig.cycles(ig.graph(ROOT))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_count_sees_lazy_imports_and_family_lookups(tmp_path):
    """The graph the rule above trusts: a function-level import and a piece() lookup are arrows; a
    TYPE_CHECKING import is not."""
    ig = _import_graph()
    (tmp_path / "core" / "families" / "fam").mkdir(parents=True)
    (tmp_path / "app").mkdir()
    for rel, text in {
        "core/__init__.py": "",
        "core/a.py": "def f():\n    from vramlab.core import b\n",
        "core/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vramlab.core import c\n",
        "core/c.py": "from vramlab.core.families import piece\n\ndef g():\n    return piece('x', 'vision')\n",
        "core/families/__init__.py": "",
        "core/families/fam/__init__.py": "",
        "core/families/fam/vision.py": "from vramlab.core import c\n",
        "app/__init__.py": "",
    }.items():
        (tmp_path / rel).write_text(text)
    g = ig.graph(tmp_path)
    assert "vramlab.core.b" in g["vramlab.core.a"]
    assert "vramlab.core.c" not in g["vramlab.core.b"]
    assert "vramlab.core.families.fam.vision" in g["vramlab.core.c"]
    assert ig.cycles(g) == [["vramlab.core.c", "vramlab.core.families.fam.vision"]]


def test_no_core_or_app_module_is_over_800_lines():
    """A module past 800 lines holds more than one job (issue 26): split it by responsibility."""
    long = {p.relative_to(ROOT).as_posix(): n for top in ("core", "app") for p in (ROOT / top).rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 800}
    assert not long, f"modules over 800 lines: {long}"
