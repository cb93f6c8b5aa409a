"""Files the window writes and reads under hostile conditions (issue 13): a failed write loses nothing, and
no saved value or file can stop the window from starting."""

from __future__ import annotations

import json


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
