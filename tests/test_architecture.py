"""The boundary: core never imports Qt or pyqtgraph (also enforced by ruff via core/ruff.toml), and the
estimate path does not import torch (the window must appear before torch loads)."""

from __future__ import annotations

import json
import pathlib
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


def test_every_package_is_listed_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    for top in ("core", "app"):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix().replace("/", ".")
            assert f'"vramlab.{rel}"' in text, f"vramlab.{rel} missing from [tool.setuptools] packages"
