"""Files the window writes and reads under hostile conditions (issue 13): a failed write loses nothing, and
no saved value or file can stop the window from starting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gui.conftest import close_and_delete, make_window
from vramlab.app.qt import QtCore


def _disk_full(monkeypatch):
    def fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", fsync)


def test_saving_scenarios_on_a_full_disk_keeps_the_old_file(window, tmp_path, monkeypatch):
    path = tmp_path / "runs.json"
    assert window.save_scenarios(str(path))
    before = path.read_bytes()
    window.state.pin_current("another")
    _disk_full(monkeypatch)
    assert not window.save_scenarios(str(path))
    assert "No space left" in window.message_banner.text()
    assert path.read_bytes() == before and len(json.loads(before)["scenarios"]) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.json", "settings"]


def test_exports_on_a_full_disk_keep_the_old_file(window, tmp_path, monkeypatch):
    for kind, name in (("table-csv", "t.csv"), ("chart-png", "c.png"), ("chart-svg", "c.svg")):
        path = tmp_path / name
        path.write_text("old export")
        with monkeypatch.context() as m:
            _disk_full(m)
            assert not window.export_to(str(path), kind)
        assert path.read_text() == "old export"
        assert window.export_to(str(path), kind) and path.read_bytes() != b"old export"


# ---- settings that bricked every start ---------------------------------------------------------------------

def _scenarios(setup: dict) -> str:
    return json.dumps({"format": "vramlab-scenarios", "version": 1,
                       "scenarios": [{"name": "bad", "model": "llama-2-7b", "setup": setup}]})


BRICKING = {
    "micro_batch 3e9": ("setup/fields", json.dumps({"micro_batch": 3_000_000_000}), "micro batch must be from 1"),
    "lora_rank NaN": ("setup/fields", '{"method": "lora", "lora_rank": NaN}', "NaN"),
    "nested": ("setup/fields", "[" * 50_000 + "]" * 50_000, "nests deeper"),
    "5000 digits": ("setup/fields", '{"seq_len": ' + "9" * 5000 + "}", "digits"),
    "grad_ckpt no": ("setup/fields", json.dumps({"grad_ckpt": "no"}), "must be true or false"),
    "infinite GPU": ("setup/gpu", json.dumps({"id": "x", "name": "Big", "memory_bytes": 1e300}), "memory"),
    "scenario 3e9": ("scenarios/json", _scenarios({"micro_batch": 3_000_000_000}), "micro batch must be from 1"),
}


@pytest.mark.parametrize("cases", [("micro_batch 3e9", "infinite GPU", "scenario 3e9"), ("nested",)])
def test_damaged_settings_are_reported_and_replaced_by_their_defaults(qtbot, temporary_settings, cases):
    """Each value on its own is held by tests/test_hostile_input.py (the core's repair); here the window."""
    s = QtCore.QSettings(str(temporary_settings), QtCore.QSettings.Format.IniFormat)
    for case in cases:
        s.setValue(BRICKING[case][0], BRICKING[case][1])
    s.setValue("window/tab", "9" * 5000)
    s.sync()
    w = make_window(temporary_settings)
    qtbot.addWidget(w)
    try:
        w.show()
        qtbot.waitUntil(w.message_banner.isVisible)
        text = w.message_banner.text()
        assert BRICKING[cases[0]][2] in text and "reset" in text
        if len(cases) > 1:
            assert "(and 1 more)" in text
        snap = w.state.flush()
        assert not snap.error and all(r.result is not None for r in snap.rows)
        setup = w.state.candidate_setup()
        setup.validate(w.state.model.spec)
        assert setup.micro_batch == 1 and all(sc.setup.micro_batch == 1 for sc in w.state.scenarios)
        w.save_settings()  # and what is saved now starts cleanly
    finally:
        close_and_delete(w)
    w = make_window(temporary_settings)
    qtbot.addWidget(w)
    try:
        w.show()
        qtbot.wait(10)
        assert not w.message_banner.isVisible()
    finally:
        close_and_delete(w)


def test_the_app_starts_with_the_worst_settings_file(tmp_path):
    """The real entry point, offscreen, on a settings file holding every bricking value at once."""
    settings = tmp_path / "s.ini"
    s = QtCore.QSettings(str(settings), QtCore.QSettings.Format.IniFormat)
    for key, raw, _needle in BRICKING.values():
        s.setValue(key, raw)
    s.setValue("setup/fields", BRICKING["micro_batch 3e9"][1])  # the case (one value per key)
    s.sync()
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    proc = subprocess.run([sys.executable, "-m", "vramlab.app.main", "--gui-smoke-test", "--settings", str(settings)],
                          capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_opening_a_scenario_file_with_an_absurd_batch_is_refused_whole(window, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(_scenarios({"micro_batch": 3_000_000_000}))
    assert not window.load_scenarios(str(path))
    assert "micro batch must be from 1 to 1,048,576" in window.message_banner.text()
    path.write_text(_scenarios({"grad_ckpt": "no"}))
    assert not window.load_scenarios(str(path))
    assert "gradient checkpointing must be true or false" in window.message_banner.text()
    assert len(window.state.scenarios) == 3
