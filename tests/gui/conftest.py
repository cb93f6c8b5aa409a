"""Strict fixtures for the GUI tests (pytest-qt, offscreen).

* Qt warnings fail a test (``qt_log_level_fail = WARNING`` in pyproject.toml). Only the offscreen platform
  plugin's notes that it cannot resize or raise native windows are ignored: they say nothing about our code.
* A test that leaves a QThread running fails (napari's rule): every ``QThread.start`` is recorded, and
  at teardown a thread still running is stopped and reported. So does a test that leaves a child process
  running (psutil; e.g. a profile child that was not ended).
* An exception raised inside a Qt slot, timer or event handler fails the test: PySide6 reports those
  through ``sys.excepthook``, which a watchdog replaces for setup, call and teardown of every test.
  Tests that provoke one on purpose consume it with ``qt_exceptions.expect(ExcType)``.
* Settings never touch the user's files: ``VRAMLAB_SETTINGS_FILE`` and QSettings' INI paths point into
  the test's temporary folder.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import pytest
import shiboken6

from vramlab.app.qt import QtCore, QtWidgets

PLATFORM_NOISE = (
    r"This plugin does not support propagateSizeHints\(\)",
    r"This plugin does not support raise\(\)",
    r"This plugin does not support grabbing the keyboard",
)
GUI_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if GUI_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gui)
            item.add_marker(pytest.mark.qt_log_ignore(*PLATFORM_NOISE))


# ---- exceptions in slots ---------------------------------------------------------------------------------------

class QtExceptionWatchdog:
    """Collects exceptions that reach ``sys.excepthook`` (how PySide6 reports errors in slots)."""

    def __init__(self) -> None:
        self.errors: list[tuple[type[BaseException], BaseException, TracebackType | None]] = []

    def hook(self, kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        self.errors.append((kind, value, tb))

    @contextmanager
    def expect(self, kind: type[BaseException]) -> Iterator[list[BaseException]]:
        """Consume exceptions of ``kind`` raised in slots inside the block; fails if none arrived."""
        before = len(self.errors)
        caught: list[BaseException] = []
        yield caught
        new = self.errors[before:]
        del self.errors[before:]
        caught.extend(v for k, v, _ in new if issubclass(k, kind))
        others = [(k, v, tb) for k, v, tb in new if not issubclass(k, kind)]
        self.errors.extend(others)
        if not caught:
            pytest.fail(f"expected a {kind.__name__} raised inside a Qt slot; none was")

    def report(self) -> str:
        return "\n".join("".join(traceback.format_exception(k, v, tb)) for k, v, tb in self.errors)


WATCHDOG = QtExceptionWatchdog()


def _guarded(phase: str) -> Iterator[None]:
    previous = sys.excepthook
    WATCHDOG.errors.clear()
    sys.excepthook = WATCHDOG.hook
    try:
        result = yield
    finally:
        sys.excepthook = previous
    if WATCHDOG.errors:
        text = WATCHDOG.report()
        WATCHDOG.errors.clear()
        pytest.fail(f"exception raised inside a Qt slot/timer during {phase}:\n{text}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded("setup"))


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded("the test"))


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded("teardown"))


@pytest.fixture
def qt_exceptions() -> QtExceptionWatchdog:
    return WATCHDOG


# ---- threads ---------------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def no_leaked_qthreads(monkeypatch: pytest.MonkeyPatch, qapp: object) -> Iterator[list[QtCore.QThread]]:
    started: list[QtCore.QThread] = []
    original = QtCore.QThread.start

    def recording_start(self: QtCore.QThread, *args: object) -> None:
        started.append(self)
        original(self, *args)

    monkeypatch.setattr(QtCore.QThread, "start", recording_start)
    yield started
    deadline = QtCore.QDeadlineTimer(2000)
    leaked = []
    for t in started:
        while shiboken6.isValid(t) and t.isRunning() and not deadline.hasExpired():
            QtCore.QCoreApplication.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 50)
        if shiboken6.isValid(t) and t.isRunning():
            leaked.append(t.objectName() or repr(t))
            t.requestInterruption()
            t.quit()
            t.wait(10000)
    if leaked:
        pytest.fail(f"test left QThread(s) running: {', '.join(leaked)}", pytrace=False)


# ---- child processes -------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def no_leaked_child_processes() -> Iterator[None]:
    """A test that leaves a child process of this one running (a profile child, say) fails; the leftovers
    are killed so later tests start clean."""
    import psutil

    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children(recursive=True)}

    def running() -> list[psutil.Process]:
        out = []
        for p in me.children(recursive=True):
            try:
                if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    yield
    deadline = QtCore.QDeadlineTimer(3000)
    left = running()
    while left and not deadline.hasExpired():
        QtCore.QCoreApplication.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 50)
        left = running()
    if left:
        names = []
        for p in left:
            try:
                names.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
                p.kill()
            except psutil.Error:
                pass
        pytest.fail(f"test left child process(es) running: {', '.join(names)}", pytrace=False)


# ---- modal dialogs ---------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def no_modal_dialogs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A modal dialog nobody answers blocks the test inside Qt's event loop, where no Python timeout can end
    it. Every blocking dialog fails the test at once instead; tests that use one patch it with their answer."""
    def refuse(what: str):  # noqa: ANN202
        def blocked(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"a test opened a modal {what} without answering it (monkeypatch it)")
        return blocked

    for name in ("getOpenFileName", "getSaveFileName", "getExistingDirectory", "getOpenFileNames"):
        monkeypatch.setattr(QtWidgets.QFileDialog, name, staticmethod(refuse(f"QFileDialog.{name}")))
    for name in ("getText", "getInt", "getDouble", "getItem"):
        monkeypatch.setattr(QtWidgets.QInputDialog, name, staticmethod(refuse(f"QInputDialog.{name}")))
    for name in ("critical", "warning", "information", "question"):
        monkeypatch.setattr(QtWidgets.QMessageBox, name, staticmethod(refuse(f"QMessageBox.{name}")))
    monkeypatch.setattr(QtWidgets.QMessageBox, "exec", refuse("QMessageBox"))
    monkeypatch.setattr(QtWidgets.QDialog, "exec", refuse("QDialog"))


# ---- clipboard -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def _clear_clipboard_at_exit(qapp: object) -> Iterator[None]:
    """The offscreen clipboard keeps a Python-made QMimeData past interpreter shutdown (a segfault at exit
    in PySide6 6.11); the app clears it on quit, and the test session, which never quits, here."""
    yield
    from vramlab.app.export import clear_clipboard

    clear_clipboard()


# ---- settings ----------------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def temporary_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "settings" / "vramlab.ini"
    path.parent.mkdir()
    monkeypatch.setenv("VRAMLAB_SETTINGS_FILE", str(path))
    for scope in (QtCore.QSettings.Scope.UserScope, QtCore.QSettings.Scope.SystemScope):
        QtCore.QSettings.setPath(QtCore.QSettings.Format.IniFormat, scope, str(tmp_path / "settings"))
    return path


def make_window(settings_path: Path, theme: str = "light", **kwargs: object):  # noqa: ANN201
    """The main window without GPU detection and, unless ``replay=True``, without the allocator replay's second
    snapshot, so that what a test reads is the fast estimate it compares with (tests/gui/test_app.py checks
    the replay)."""
    from vramlab.app.main_window import MainWindow

    settings = QtCore.QSettings(str(settings_path), QtCore.QSettings.Format.IniFormat)
    kwargs.setdefault("replay", False)
    return MainWindow(settings=settings, detect_gpus=False, theme_mode=theme, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def window(qtbot, temporary_settings: Path):  # noqa: ANN001, ANN201
    w = make_window(temporary_settings)
    qtbot.addWidget(w)
    w.resize(1280, 860)
    w.show()
    qtbot.waitExposed(w)
    w.state.flush()
    yield w
    close_and_delete(w)


def close_and_delete(w) -> None:  # noqa: ANN001
    """Close a window and delete its widgets now, so later tests do not re-polish leftovers."""
    if shiboken6.isValid(w):
        w.close()
        w.deleteLater()
    QtCore.QCoreApplication.sendPostedEvents(None, QtCore.QEvent.Type.DeferredDelete.value)
    QtCore.QCoreApplication.processEvents()


os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
