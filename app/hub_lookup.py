"""Looking up a Hugging Face Hub id off the GUI thread (config.json and safetensors headers; never weights).

The same shape as :mod:`vramlab.app.simulation` (STYLE.md §5): :class:`HubLookupWorker` is a plain QObject
moved to a QThread; its one ending signal quits the thread, whose ``finished`` deletes both; ``abort()`` sets
a flag the lookup checks before each request (a request already sent ends within the Hub timeout). The worker
ends through :func:`~vramlab.app.simulation.hand_back`, and Python's automatic garbage collection is paused
while it runs (collected on a GUI timer instead), for the reasons given there.

:class:`HubLookupController` owns at most one lookup, relays progress to the GUI thread and hands back a
:class:`~vramlab.app.state.ModelChoice` plus the adapter config of an adapter repository, if any.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

from vramlab.app.qt import QtCore
from vramlab.app.simulation import hand_back
from vramlab.core.catalog import ModelEntry, hub_entry
from vramlab.core.spec import SetupError

LookupFn = Callable[..., ModelEntry]


class HubLookupWorker(QtCore.QObject):
    """One lookup. Emits exactly one of ``finished(ModelEntry)``, ``errored(exception)``, ``cancelled()``."""

    progress = QtCore.Signal(str)
    finished = QtCore.Signal(object)
    errored = QtCore.Signal(object)
    cancelled = QtCore.Signal()

    def __init__(self, ref: str, lookup_fn: LookupFn | None = None) -> None:
        super().__init__()
        self._ref = ref
        self._fn = lookup_fn or hub_entry
        self._abort = threading.Event()

    def abort(self) -> None:
        self._abort.set()

    @QtCore.Slot()
    def run(self) -> None:
        from vramlab.core.sources.hub import LookupCancelled

        outcome: tuple[str, Any] = ("cancelled", None)
        try:
            if not self._abort.is_set():
                entry = self._fn(self._ref, progress=self.progress.emit, cancelled=self._abort.is_set)
                outcome = ("cancelled", None) if self._abort.is_set() else ("finished", entry)
        except LookupCancelled:
            outcome = ("cancelled", None)
        except Exception as e:  # reported through `errored`, which the controller always listens to
            outcome = ("cancelled", None) if self._abort.is_set() else ("errored", e)
        hand_back(self, outcome)


class HubLookupController(QtCore.QObject):
    """Starts Hub lookups on a QThread and hands their outcome back on the GUI thread."""

    started = QtCore.Signal(str)  # the id
    progress = QtCore.Signal(str)
    succeeded = QtCore.Signal(str, object)  # the id, ModelEntry
    failed = QtCore.Signal(str, str)  # the id, one line
    cancelled = QtCore.Signal(str)
    runningChanged = QtCore.Signal(bool)

    def __init__(self, parent: QtCore.QObject | None = None, lookup_fn: LookupFn | None = None) -> None:
        super().__init__(parent)
        self._fn = lookup_fn
        self._thread: QtCore.QThread | None = None
        self._worker: HubLookupWorker | None = None
        self._ref = ""
        self._gc_was_enabled = False
        self._gc_timer = QtCore.QTimer(self)
        self._gc_timer.setInterval(250)
        self._gc_timer.timeout.connect(lambda: gc.collect(0))

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def ref(self) -> str:
        """The id being looked up ('' when none)."""
        return self._ref if self._thread is not None else ""

    def start(self, ref: str) -> bool:
        if self._thread is not None:
            return False
        thread = QtCore.QThread()
        thread.setObjectName("vramlab-hub-lookup")
        worker = HubLookupWorker(ref, self._fn)
        worker.moveToThread(thread)
        thread.started.connect(worker.run)
        worker.progress.connect(self._on_progress)
        worker.finished.connect(self._on_finished)
        worker.errored.connect(self._on_errored)  # always connected: a failure is never silent
        worker.cancelled.connect(self._on_cancelled)
        for done in (worker.finished, worker.errored, worker.cancelled):
            done.connect(thread.quit)
        thread.finished.connect(worker.deleteLater)
        thread.finished.connect(thread.deleteLater)
        thread.finished.connect(self._on_thread_finished)
        self._thread, self._worker, self._ref = thread, worker, ref
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._gc_timer.start()
        thread.start()
        self.runningChanged.emit(True)
        self.started.emit(ref)
        return True

    def cancel(self) -> None:
        if self._worker is not None:
            self._worker.abort()

    def shutdown(self, timeout_ms: int = 20000) -> bool:
        """Abort and wait for the thread (window closing). True when no thread is left running."""
        thread = self._thread
        if thread is None:
            return True
        self.cancel()
        thread.quit()
        done = thread.wait(timeout_ms)
        QtCore.QCoreApplication.sendPostedEvents(None, 0)
        if done and self._thread is not None:
            self._on_thread_finished()
        return bool(done)

    # ---- slots (GUI thread) -------------------------------------------------------------------------------
    @QtCore.Slot(str)
    def _on_progress(self, text: str) -> None:
        self.progress.emit(text)

    @QtCore.Slot(object)
    def _on_finished(self, entry: Any) -> None:
        self.succeeded.emit(self._ref, entry)

    @QtCore.Slot(object)
    def _on_errored(self, exc: Any) -> None:
        text = str(exc) if isinstance(exc, SetupError) else f"{type(exc).__name__}: {exc}"
        self.failed.emit(self._ref, text)

    @QtCore.Slot()
    def _on_cancelled(self) -> None:
        self.cancelled.emit(self._ref)

    @QtCore.Slot()
    def _on_thread_finished(self) -> None:
        if self._thread is not None:
            self._thread.wait()
        self._thread = None
        self._worker = None
        self._gc_timer.stop()
        if self._gc_was_enabled:
            gc.enable()
        self.runningChanged.emit(False)
