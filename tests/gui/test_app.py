"""Desktop behaviour: settings persistence, shortcuts, themes, the About box, the status bar, the slot
exception watchdog, and a cold start in a fresh process that never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.gui.conftest import close_and_delete, make_window
from vramlab.app import main as app_main
from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.theme import DARK, LIGHT
from vramlab.core.catalog import find_gpu
from vramlab.core.result import MemLevel
from vramlab.core.units import fmt_bytes


def test_settings_round_trip(qtbot, temporary_settings):
    first = make_window(temporary_settings)
    first.show()
    qtbot.waitExposed(first)
    first.resize(1111, 777)
    first.state.set_model("mistral-7b-v0.3")
    first.state.apply_preset("qlora-nf4")
    first.state.set_field("seq_len", 2048)
    first.state.set_gpu(find_gpu("l40s"))
    first.level_actions[MemLevel.DEVICE].trigger()
    first.unit_actions[first.state.unit.__class__("GB")].trigger()
    first.act_sizes.trigger()
    first.apply_theme_mode("dark")
    first.state.pin_current("Pinned QLoRA")
    first.tabs.setCurrentIndex(2)
    first.addDockWidget(QtCore.Qt.DockWidgetArea.RightDockWidgetArea, first.dock)
    fields = dict(first.state.fields)
    close_and_delete(first)
    settings = QtCore.QSettings(str(temporary_settings), QtCore.QSettings.Format.IniFormat)
    geometry = settings.value("window/geometry")
    assert isinstance(geometry, QtCore.QByteArray) and not geometry.isEmpty()

    second = make_window(temporary_settings, theme=None)
    second.show()
    qtbot.waitExposed(second)
    try:
        st = second.state
        assert st.model.spec.id == "mistral-7b-v0.3"
        assert dict(st.fields) == fields
        assert st.gpu == find_gpu("l40s")
        assert (st.level, st.unit.value, st.common_sizes) == (MemLevel.DEVICE, "GB", True)
        assert second.theme_mode.value == "dark" and second.theme is DARK
        assert [s.name for s in st.scenarios][-1] == "Pinned QLoRA"
        assert second.tabs.currentIndex() == 2
        # The offscreen platform's screen is 800 x 600, so Qt fits a restored window onto it; on a desktop the
        # size comes back exactly. What is checked here: the geometry was stored and restores, and the
        # window state (the setup dock moved to the right) comes back.
        assert second.restoreGeometry(geometry)
        assert second.dockWidgetArea(second.dock) == QtCore.Qt.DockWidgetArea.RightDockWidgetArea
        assert second.panel.preset_combo.currentData() == "qlora-nf4"
    finally:
        close_and_delete(second)
        app = QtWidgets.QApplication.instance()
        from vramlab.app.theme import apply_theme

        apply_theme(app, LIGHT)


def test_corrupt_settings_fall_back_to_defaults(qtbot, temporary_settings):
    temporary_settings.write_text("[setup]\nmodel=/no/such/folder\nfields=\"{not json\"\ngpu=\"[1,2]\"\n"
                                  "[scenarios]\njson=\"{\\\"format\\\": 1}\"\n")
    w = make_window(temporary_settings)
    w.show()
    try:
        snap = w.state.flush()
        assert snap.current.model.id == "llama-2-7b" and snap.error == ""
        qtbot.waitUntil(w.message_banner.isVisible, timeout=2000)
        assert "could not be loaded again" in w.message_banner.text()
    finally:
        close_and_delete(w)


def test_keyboard_shortcuts(window):
    def keys(action: QtGui.QAction) -> str:
        return action.shortcut().toString()

    assert keys(window.act_open) == "Ctrl+O"
    assert keys(window.act_pin) == "Ctrl+P"
    assert keys(window.act_export) == "Ctrl+E"
    assert keys(window.act_quit) == "Ctrl+Q"
    assert keys(window.act_about) == "F1"
    assert keys(window.level_actions[MemLevel.RESERVED]) == "Ctrl+2"
    assert all(a.toolTip() for a in (window.act_open, window.act_pin, window.act_export, window.act_simulate))


def test_ctrl_q_quits(window, qtbot):
    qtbot.keyClick(window, QtCore.Qt.Key.Key_Q, QtCore.Qt.KeyboardModifier.ControlModifier)
    assert not window.isVisible()


def test_f1_opens_the_about_box_with_versions(window, qtbot):
    qtbot.keyClick(window, QtCore.Qt.Key.Key_F1)
    dialogs = [w for w in QtWidgets.QApplication.topLevelWidgets()
               if isinstance(w, QtWidgets.QDialog) and w.isVisible()]
    assert len(dialogs) == 1
    about = dialogs[0]
    for name in ("VRAM Lab", "Qt", "PySide6", "pyqtgraph", "Python"):
        assert about.versions[name]
    assert ("torch" in about.versions) == ("torch" in sys.modules)
    about.copy_versions()
    assert "PySide6: " in QtWidgets.QApplication.clipboard().text()
    about.close()


def test_theme_toggle(window):
    plot = window.breakdown.plot
    assert window.theme is LIGHT
    window.act_toggle_theme.trigger()
    assert window.theme is DARK
    assert plot.backgroundBrush().color().name().upper() == DARK.chart_bg.upper()
    assert QtWidgets.QApplication.palette().color(QtGui.QPalette.ColorRole.Window).name().upper() == DARK.window.upper()
    window.act_toggle_theme.trigger()
    assert window.theme is LIGHT
    assert plot.backgroundBrush().color().name().upper() == LIGHT.chart_bg.upper()


def test_status_bar_names_the_level_and_unit(window):
    text = window.status_level.text()
    assert "Tensor peak (max_memory_allocated)" in text and "GiB per GPU" in text and "2³⁰" in text
    window.level_actions[MemLevel.DEVICE].trigger()
    window.state.flush()
    assert "Device used (nvidia-smi)" in window.status_level.text()


def test_watchdog_catches_exceptions_in_slots(window, qtbot, qt_exceptions):
    def broken_slot() -> None:
        raise RuntimeError("raised inside a timer slot")

    with qt_exceptions.expect(RuntimeError) as caught:
        QtCore.QTimer.singleShot(0, broken_slot)
        qtbot.wait(30)
    assert "timer slot" in str(caught[0])


def test_entry_point_contract(monkeypatch):
    from vramlab.app import entry

    calls = []
    monkeypatch.setattr(app_main, "run", lambda argv: calls.append(argv) or 0)
    assert entry.gui_main(["--theme", "dark"]) == 0
    assert entry.main([]) == 0
    assert entry.main(["--gui-theme", "light"]) == 0  # "vramlab --gui-..." reaches the GUI, not the CLI
    assert calls == [["--theme", "dark"], [], ["--gui-theme", "light"]]
    args, _qt = app_main._parse(["--gui-theme", "light", "--gui-settings", "x.ini", "-style", "fusion"])
    assert (args.theme, args.settings) == ("light", "x.ini")


def test_cold_start_shows_the_window_without_torch(tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    proc = subprocess.run([sys.executable, "-m", "vramlab.app.main", "--gui-smoke-test",
                           "--settings", str(tmp_path / "s.ini")],
                          capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("{"))
    info = json.loads(line)
    assert info["torch_loaded"] is False
    assert 0 < info["since_app_import_s"] < 30


def test_the_allocator_replay_follows_the_fast_estimate(qtbot, temporary_settings):
    """The first snapshot's outer levels are the fast model's; the replay's follow from the worker thread and are
    what `vramlab estimate` prints. The tensor level never moves; going back to a setup is instant."""
    from vramlab.core.estimate import estimate

    w = make_window(temporary_settings, replay=True)
    qtbot.addWidget(w)
    w.show()
    try:
        st = w.state
        st.set_level(MemLevel.DEVICE)
        st.set_field("seq_len", 1024)
        w.tabs.setCurrentWidget(w.advisor)
        fast = st.flush()
        w.advisor.flush()  # the advice of the fast snapshot is on show when the replayed one arrives
        assert not fast.exact and st.replaying
        assert "fast model" in w.status_level.text()
        qtbot.waitUntil(lambda: st.snapshot.exact and not st.replaying, timeout=60_000)
        exact = st.snapshot
        for before, after in zip(fast.rows, exact.rows):
            if after.result is None:
                continue
            replayed = estimate(after.model, after.setup, exact.gpu, allocator=True)
            assert after.result.peak_reserved_bytes == replayed.peak_reserved_bytes
            assert after.result.device_used_bytes == replayed.device_used_bytes
            assert after.result.peak_allocated_bytes == before.result.peak_allocated_bytes
        assert "allocator replayed" in w.status_level.text()
        # the Advisor's verdict follows the replayed snapshot too (its own parts already use the replay)
        assert fmt_bytes(exact.current.result.device_used_bytes) in w.advisor.verdict.text()
        top = max(w.breakdown.plot.stacks, key=lambda s: s.total_bytes)  # the bars are the replayed device level
        assert top.total_bytes == max(r.result.device_used_bytes for r in exact.rows if r.result)
        st.set_field("seq_len", 2048)
        st.flush()
        st.set_field("seq_len", 1024)
        assert st.flush().exact  # kept: no second replay of a setup already replayed
    finally:
        close_and_delete(w)
    assert not st.replaying
