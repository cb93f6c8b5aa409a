"""The packaged app (packaging/): entry-point routing, the self-test, the icons, and a real PyInstaller
build of the estimator-only variant checked from its folder (docs/packaging.md: a frozen build gets a smoke test).

The build takes about half a minute on two cores; it needs PyInstaller (``pip install -e '.[package]'``)
and is skipped without it.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ROOT / "packaging"


def _load(name: str, path: Path):  # noqa: ANN202 - packaging/ is scripts, not a package
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_entry(args: list[str], stdin: str = "", timeout: float = 240) -> subprocess.CompletedProcess[str]:
    code = ("import sys\nfrom vramlab.app.entry import main\nrc = main(sys.argv[1:])\n"
            "print('QT_LOADED' if 'PySide6' in sys.modules else 'QT_NOT_LOADED', file=sys.stderr)\nsys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})


def test_profile_child_is_routed_before_any_qt_import():
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

    spec = ModelSpec(id="t", name="T", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2,
                     intermediate_size=64, vocab_size=64)
    request = {"spec": spec.to_dict(), "setup": TrainingSetup(seq_len=8).resolved(), "device": "cpu", "steps": 1}
    p = _run_entry(["--profile-child"], stdin=json.dumps(request) + "\n")
    events = [json.loads(line)["event"] for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0, p.stderr
    assert events[-1] == "result" and "phase" in events
    assert "QT_NOT_LOADED" in p.stderr


def test_missing_torch_is_one_clear_line(monkeypatch, capsys):
    import vramlab.core.cli
    from vramlab.app import entry

    def no_torch(argv):  # noqa: ANN001, ANN202
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(vramlab.core.cli, "main", no_torch)
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    assert entry.main(["simulate", "--model", "llama-2-7b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no torch" in err and "full build" in err


def test_a_module_other_than_torch_missing_is_not_hidden(monkeypatch):
    import vramlab.core.cli
    from vramlab.app import entry

    def broken(argv):  # noqa: ANN001, ANN202
        raise ModuleNotFoundError("No module named 'something'", name="something")

    monkeypatch.setattr(vramlab.core.cli, "main", broken)
    with pytest.raises(ModuleNotFoundError):
        entry.main(["estimate", "--model", "llama-2-7b"])


@pytest.mark.slow
def test_self_test_passes_in_the_development_environment():
    p = _run_entry(["--self-test", "--json", "--no-profile"])
    report = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("{")))
    assert p.returncode == 0, p.stdout + p.stderr
    assert report["ok"] and {c["name"]: c["status"] for c in report["checks"]} == {
        "build": "ok", "resources": "ok", "estimate": "ok", "sources": "ok", "gui": "ok", "simulate": "ok"}


def test_icons_are_valid_ico_and_icns(tmp_path):
    icons = _load("vramlab_packaging_icons", PACKAGING / "icons.py")
    p = subprocess.run([sys.executable, str(PACKAGING / "icons.py"), str(tmp_path)], capture_output=True, text=True,
                       timeout=120, check=False, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert p.returncode == 0, p.stderr
    ico = (tmp_path / "vramlab.ico").read_bytes()
    reserved, kind, count = struct.unpack_from("<HHH", ico)
    assert (reserved, kind, count) == (0, 1, len(icons.ICO_SIZES))
    for i in range(count):
        width, _h, _c, _r, _planes, _bpp, size, offset = struct.unpack_from("<BBBBHHII", ico, 6 + 16 * i)
        assert ico[offset:offset + 8] == b"\x89PNG\r\n\x1a\n" and offset + size <= len(ico)
        assert (width or 256) == icons.ICO_SIZES[i]
    icns = (tmp_path / "vramlab.icns").read_bytes()
    assert icns[:4] == b"icns" and struct.unpack_from(">I", icns, 4)[0] == len(icns)
    assert (tmp_path / "png" / "vramlab-256.png").read_bytes()[:4] == b"\x89PNG"


def test_desktop_entry():
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str
    entry.read(PACKAGING / "linux" / "vramlab.desktop", encoding="utf-8")
    d = entry["Desktop Entry"]
    assert d["Type"] == "Application" and d["Exec"] == "vramlab" and d["Icon"] == "vramlab"
    assert d["Terminal"] == "false" and d["Categories"].endswith(";")


@pytest.mark.slow
def test_estimator_only_build_runs_from_its_folder(tmp_path):
    """Build the estimator-only app (no torch) with packaging/build.py into a temporary folder; build.py runs
    the frozen app's --self-test, `estimate`, and `simulate` (which must say that torch is missing)."""
    pytest.importorskip("PyInstaller", reason="needs PyInstaller: pip install -e '.[package]'")
    try:
        _build_and_run(tmp_path)
    finally:  # some 400 MB; pytest keeps the temporary folders of the last runs
        shutil.rmtree(tmp_path / "work", ignore_errors=True)
        shutil.rmtree(tmp_path / "dist", ignore_errors=True)


def _build_and_run(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    p = subprocess.run([sys.executable, str(PACKAGING / "build.py"), "--variant", "estimator", "--no-archives",
                        "--dist", str(tmp_path / "dist"), "--work", str(tmp_path / "work"),
                        "--summary", str(summary_file)], capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    build = json.loads(summary_file.read_text())["builds"][0]
    assert set(build["self_test"]["checks"].values()) == {"ok"}
    assert build["folder_bytes"] < 250 * 10**6, "the estimator-only build should stay under 250 MB"
    folder = Path(build["folder"])
    assert not (folder / "_internal" / "torch").exists()

    exe = Path(build["executable"])
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "VRAMLAB_CONFIG_DIR": str(tmp_path / "config")}
    r = subprocess.run([str(exe), "--self-test", "--json"], capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["build"]["variant"] == "estimator" and checks["build"]["frozen"] is True
    assert checks["gui"]["status"] == "ok" and checks["gui"]["torch_loaded"] is False
