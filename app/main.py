"""Start the GUI: ``vramlab`` (no arguments) or ``vramlab-gui``.

Options (everything else is passed to Qt). ``vramlab`` sends arguments that start with ``--gui`` to the
GUI and everything else to the CLI, so each option also has a ``--gui-`` spelling::

    --theme / --gui-theme system|light|dark   override the remembered theme for this run
    --settings / --gui-settings FILE          keep settings in FILE instead of the user's config folder
    --gui-smoke-test                          show the window, print one JSON line (start-up time, whether
                                              torch was imported) and exit 0: benchmarks, frozen builds

torch is never imported at start-up; the simulation imports it in its worker thread.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from types import TracebackType

from vramlab.app.qt import QtCore, QtGui, QtWidgets

_T0 = time.perf_counter()
log = logging.getLogger("vramlab.app")


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="vramlab", add_help=True)
    p.add_argument("--theme", "--gui-theme", dest="theme", choices=["system", "light", "dark"])
    p.add_argument("--settings", "--gui-settings", dest="settings")
    p.add_argument("--gui-smoke-test", action="store_true")
    p.add_argument("--gui", action="store_true", help=argparse.SUPPRESS)
    return p.parse_known_args(argv)


def _install_excepthook(app: QtWidgets.QApplication) -> None:
    """An exception escaping a slot is logged and shown in a dialog; the window keeps running."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            previous(kind, value, tb)
            return
        text = "".join(traceback.format_exception(kind, value, tb))
        log.error("unexpected error:\n%s", text)
        window = app.activeWindow()
        box = QtWidgets.QMessageBox(QtWidgets.QMessageBox.Icon.Critical, "VRAM Lab: unexpected error",
                                    f"{kind.__name__}: {value}\n\nThe window keeps running; please report this.",
                                    QtWidgets.QMessageBox.StandardButton.Ok, window)
        box.setDetailedText(text)
        box.setAttribute(QtCore.Qt.WidgetAttribute.WA_DeleteOnClose)
        box.open()

    sys.excepthook = hook


class _FirstPaint(QtCore.QObject):
    """Reports the first paint of the main window (smoke test / start-up benchmark), then quits."""

    def __init__(self, window: QtWidgets.QWidget) -> None:
        super().__init__(window)
        self.window = window
        self.done = False

    def eventFilter(self, obj: QtCore.QObject, event: QtCore.QEvent) -> bool:  # noqa: N802
        if not self.done and event.type() == QtCore.QEvent.Type.Paint and isinstance(obj, QtWidgets.QWidget) \
                and obj.window() is self.window:
            self.done = True
            shown = time.perf_counter()
            torch_loaded = "torch" in sys.modules
            print(json.dumps({"since_app_import_s": round(shown - _T0, 4), "since_process_start_s": _since_start(),
                              "wall_time": time.time(), "torch_loaded": torch_loaded}), flush=True)
            QtCore.QTimer.singleShot(0, self.window.close)
        return False


def _since_start() -> float | None:
    try:
        import psutil

        return round(time.time() - psutil.Process().create_time(), 3)
    except Exception:
        return None


def run(argv: list[str] | None = None) -> int:
    args, qt_args = _parse(list(argv or []))
    if args.settings:
        os.environ["VRAMLAB_SETTINGS_FILE"] = args.settings
    if QtWidgets.QApplication.instance() is None:  # fractional scale factors (125 %, 150 %) as they are
        QtGui.QGuiApplication.setHighDpiScaleFactorRoundingPolicy(
            QtCore.Qt.HighDpiScaleFactorRoundingPolicy.PassThrough)
    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication([sys.argv[0], *qt_args])
    assert isinstance(app, QtWidgets.QApplication)
    app.setApplicationName("VRAM Lab")
    app.setOrganizationName("VRAM Lab")
    app.setApplicationDisplayName("VRAM Lab")
    app.setDesktopFileName("vramlab")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _install_excepthook(app)

    from vramlab.app.main_window import MainWindow

    window = MainWindow(theme_mode=args.theme)
    app.setWindowIcon(window.windowIcon())
    if args.gui_smoke_test:
        probe = _FirstPaint(window)
        app.installEventFilter(probe)
    window.show()
    return int(app.exec())


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
