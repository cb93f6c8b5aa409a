"""Background work in the window: the one way a job is started, cancelled, handed back and shut down.

Every job of the window (a simulation, a profile run and its sampler, the advice, the allocator replay, a Hub
lookup, a calibration being saved) is a plain Python function ``fn(worker)`` run by a :class:`Runner` on a
QThread of its own (ARCHITECTURE.md, the rule that the window never blocks):

* :class:`Worker` is the QObject moved to the thread. ``thread.started`` runs it; it calls ``fn(self)``,
  which may ``report(value)`` any number of times (``progress``) and checks ``aborted()`` between steps.
  The run ends with exactly one of ``finished(value)``, ``errored(exception)`` or ``cancelled()``: a job
  asked to stop ends ``cancelled`` whatever it returned (a lookup or a simulation that completed just as
  the user cancelled is not shown), unless it was started with ``keep_on_abort`` and returned a value (a
  profile's own cancelled outcome, the rows replayed so far).
* Two rules keep Python and Qt from touching the same object from two threads. When the run ends, the
  worker moves itself back to the GUI thread (:func:`hand_back`), so its ``deleteLater`` and the release of
  its Python wrapper both happen there. And while any worker thread runs, Python's automatic garbage
  collection is off and the GUI thread collects on a timer instead (:class:`GcPause`, pyqtgraph's
  GarbageCollector idea): a collection triggered inside a worker thread could destroy Qt objects of the GUI
  from the wrong thread. The pause is counted and shared by every runner, so overlapping jobs neither turn
  collection back on while one still runs nor leave it off once all have ended.
* :class:`Runner` owns at most one job at a time. Its signals are re-emitted on the GUI thread (every
  connection goes to a slot of a QObject living there, so Qt queues them); ``errored`` is always connected.
  ``ended`` follows the job's one outcome once its thread has stopped. ``shutdown()`` aborts and waits
  (window closing), so no thread outlives the window.

Controllers (:mod:`.simulation`, :mod:`.tracing` and :mod:`.hub_lookup` on :class:`JobController`;
:mod:`.profiling`, :mod:`.advice`, the replay in :mod:`.state`, the calibration in the Live tab) turn their
domain calls into such functions and their outcomes into domain signals; none starts a thread itself.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import shiboken6

from vramlab.app.qt import QtCore

JobFn = Callable[["Worker"], Any]

GC_INTERVAL_MS = 250


class GcPause(QtCore.QObject):
    """Automatic gc off while any worker thread runs; the GUI thread collects on a timer instead. Counted:
    the first ``acquire`` remembers whether gc was on and the last ``release`` restores it."""

    _instance: GcPause | None = None

    def __init__(self) -> None:
        super().__init__()
        self._count = 0
        self._was_enabled = False
        self._timer = QtCore.QTimer(self)
        self._timer.setInterval(GC_INTERVAL_MS)
        self._timer.timeout.connect(self._collect)

    @classmethod
    def shared(cls) -> GcPause:
        """The process's one pause (made on first use, living in the GUI thread)."""
        if cls._instance is None or not shiboken6.isValid(cls._instance):
            cls._instance = cls()
            app = QtCore.QCoreApplication.instance()
            if app is not None:
                cls._instance.moveToThread(app.thread())
        return cls._instance

    @property
    def active(self) -> bool:
        return self._count > 0

    def acquire(self) -> None:
        if self._count == 0:
            self._was_enabled = gc.isenabled()
            self._timer.start()
        self._count += 1
        gc.disable()

    def release(self) -> None:
        if self._count == 0:
            return
        self._count -= 1
        if self._count == 0:
            self._timer.stop()
            if self._was_enabled:
                gc.enable()

    @staticmethod
    def _collect() -> None:
        """Python's own generational thresholds, applied from the GUI thread."""
        counts, thresholds = gc.get_count(), gc.get_threshold()
        for generation in (2, 1, 0):
            if all(counts[g] > thresholds[g] for g in range(generation + 1)):
                gc.collect(generation)
                return


_settled = False


def settle_collector() -> bool:
    """Once per process, when the window is up and idle after start-up (:func:`.main_window.after_start_idle`):
    collect the young generations (what start-up left in reference cycles), then move everything alive to the
    collector's permanent generation (``gc.freeze``): the modules, the window, the catalogs and the prefetched
    tapes live as long as the app does, and no later collection (Python's own, or :class:`GcPause`'s timer) walks
    them again. A full collection of a started window walks 80,000 objects (25-60 ms on the GUI thread, the live
    view's hitch), and a young one grown by the workers' pause and the idle prefetch landed inside the next
    estimate (0.4-0.5 ms: a traced model's first estimate after a restart). Whether the collector is on is left as
    found. Returns whether it settled now (False: it had already)."""
    global _settled
    if _settled:
        return False
    _settled = True
    gc.collect(1)
    gc.freeze()
    return True


def hand_back(worker: QtCore.QObject, outcome: tuple[str, Any]) -> None:
    """End a worker's run: move it back to the GUI thread, then emit its one ending signal,
    ``finished(value)``, ``errored(exception)`` or ``cancelled()``, as ``outcome`` = (kind, value) says."""
    app = QtCore.QCoreApplication.instance()
    if app is not None:
        worker.moveToThread(app.thread())
    kind, value = outcome
    if kind == "finished":
        worker.finished.emit(value)
    elif kind == "errored":
        worker.errored.emit(value)
    else:
        worker.cancelled.emit()


class Worker(QtCore.QObject):
    """Runs ``fn(self)`` once on the thread it was moved to (see the module docstring)."""

    progress = QtCore.Signal(object)
    finished = QtCore.Signal(object)
    errored = QtCore.Signal(object)
    cancelled = QtCore.Signal()

    def __init__(self, fn: JobFn, keep_on_abort: bool = False) -> None:
        super().__init__()
        self._fn = fn
        self._keep = keep_on_abort
        self._abort = threading.Event()

    def abort(self) -> None:
        """Ask the job to stop at its next check (safe from any thread)."""
        self._abort.set()

    def aborted(self) -> bool:
        return self._abort.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` or until aborted (a loop's pause between readings). True when aborted."""
        return self._abort.wait(seconds)

    def report(self, value: Any) -> None:
        """Hand a partial result to the GUI thread (``progress``); call it from the job's own thread."""
        self.progress.emit(value)

    @QtCore.Slot()
    def run(self) -> None:
        outcome: tuple[str, Any] = ("cancelled", None)
        try:
            if not self.aborted():
                value = self._fn(self)
                kept = self._keep and value is not None
                outcome = ("finished", value) if kept or not self.aborted() else ("cancelled", None)
        except BaseException as e:  # noqa: BLE001 - even SystemExit: the thread must end and the pause be released
            outcome = ("cancelled", None) if self.aborted() else ("errored", e)
        hand_back(self, outcome)


class Runner(QtCore.QObject):
    """At most one job at a time, each on a new QThread named ``name``; outcomes arrive on the GUI thread."""

    progress = QtCore.Signal(object)
    finished = QtCore.Signal(object)
    errored = QtCore.Signal(object)
    cancelled = QtCore.Signal()
    ended = QtCore.Signal()  # the job's thread has stopped (after its one outcome)
    runningChanged = QtCore.Signal(bool)

    def __init__(self, name: str, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self._name = name
        self._thread: QtCore.QThread | None = None
        self._worker: Worker | None = None
        self.jobs_started = 0

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, fn: JobFn, keep_on_abort: bool = False) -> bool:
        """Run ``fn(worker)`` on a new thread; False (and nothing started) while a job runs. ``keep_on_abort``:
        a value the job returns after an abort is still its outcome (see :class:`Worker`)."""
        if self._thread is not None:
            return False
        thread = QtCore.QThread()
        thread.setObjectName(self._name)
        worker = Worker(fn, keep_on_abort)
        worker.moveToThread(thread)
        thread.started.connect(worker.run)
        worker.progress.connect(self._on_progress)
        worker.finished.connect(self._on_finished)
        worker.errored.connect(self._on_errored)  # always connected: a failure is never silent
        worker.cancelled.connect(self._on_cancelled)
        for done in (worker.finished, worker.errored, worker.cancelled):
            done.connect(thread.quit)
        thread.finished.connect(self._on_thread_finished)  # first: queued before the deletions
        thread.finished.connect(worker.deleteLater)
        thread.finished.connect(thread.deleteLater)
        self._thread, self._worker = thread, worker
        GcPause.shared().acquire()
        self.jobs_started += 1
        thread.start()
        self.runningChanged.emit(True)
        return True

    def abort(self) -> None:
        """Ask the running job to stop (it ends ``cancelled`` at its next check)."""
        if self._worker is not None:
            self._worker.abort()

    def shutdown(self, timeout_ms: int = 20000) -> bool:
        """Abort and wait for the thread (window closing). True when no thread is left running."""
        thread = self._thread
        if thread is None:
            return True
        self.abort()
        thread.quit()  # honoured once the worker's run returns (exec() sees the earlier exit)
        done = thread.wait(timeout_ms)
        QtCore.QCoreApplication.sendPostedEvents(None, 0)  # the worker's last signals and `finished`
        if done and self._thread is not None:
            self._on_thread_finished()
        return bool(done)

    # ---- slots (GUI thread) -------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_progress(self, value: Any) -> None:
        self.progress.emit(value)

    @QtCore.Slot(object)
    def _on_finished(self, value: Any) -> None:
        self.finished.emit(value)

    @QtCore.Slot(object)
    def _on_errored(self, exc: Any) -> None:
        self.errored.emit(exc)

    @QtCore.Slot()
    def _on_cancelled(self) -> None:
        self.cancelled.emit()

    @QtCore.Slot()
    def _on_thread_finished(self) -> None:
        thread = self._thread
        if thread is None:
            return
        if shiboken6.isValid(thread):
            thread.wait()  # `finished` is emitted just before the thread ends: let it end
        self._thread = None
        self._worker = None
        GcPause.shared().release()
        self.runningChanged.emit(False)
        self.ended.emit()


class JobController(QtCore.QObject):
    """A window controller of one background job at a time (a simulation, a trace, a Hub lookup): its
    :class:`Runner`, whether it runs, the job it runs, and the start / cancel / shutdown every such
    controller has. A subclass declares ``started`` (its job's key) and its domain signals, turns its domain
    call into a job with :meth:`_begin`, and connects the runner's outcomes to them."""

    runningChanged = QtCore.Signal(bool)

    def __init__(self, name: str, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self._job: Any = None
        self._runner = Runner(name, self)
        self._runner.ended.connect(self._on_ended)

    @property
    def running(self) -> bool:
        return self._runner.running

    @property
    def job(self) -> Any:
        """The key of the job that runs (None when none does)."""
        return self._job

    def _begin(self, fn: JobFn, key: Any, keep_on_abort: bool = False) -> bool:
        """Start ``fn`` for ``key``; False while another job runs."""
        if not self._runner.start(fn, keep_on_abort=keep_on_abort):
            return False
        self._job = key
        self.runningChanged.emit(True)
        self.started.emit(key)  # type: ignore[attr-defined] - each subclass declares it with its key's type
        return True

    def cancel(self) -> None:
        self._runner.abort()

    def shutdown(self, timeout_ms: int = 20000) -> bool:
        """Abort and wait for the thread (window closing). True when no thread is left running."""
        return self._runner.shutdown(timeout_ms)

    @QtCore.Slot()
    def _on_ended(self) -> None:
        self._job = None
        self.runningChanged.emit(False)
