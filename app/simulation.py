"""Running ``core.measure.simulate`` off the GUI thread.

:class:`SimulateWorker` is a plain QObject moved to a QThread (STYLE.md §5): ``thread.started`` runs it,
its ``finished`` / ``errored`` / ``cancelled`` signals quit the thread, and the thread's ``finished``
deletes both. ``abort()`` sets a flag that the simulation checks between phases. The worker imports
torch itself, in the worker thread, so the GUI never waits for it.

Two rules keep Python and Qt from touching the same object from two threads:

* When its run ends, the worker moves itself back to the GUI thread, so its ``deleteLater`` and the
  release of its Python wrapper both happen there (never a C++ delete in the worker thread racing the
  wrapper's release in the GUI thread).
* While a worker thread runs, Python's automatic garbage collection is off and the GUI thread collects
  on a timer instead (pyqtgraph's GarbageCollector idea): a collection triggered inside the worker thread
  could otherwise destroy Qt objects of the GUI from the wrong thread.

:class:`SimulationController` owns at most one run at a time, relays its signals to the GUI thread
(every connection goes to a slot of a QObject living in the GUI thread, so Qt queues them), and
``shutdown()`` stops a run when the window closes.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

from vramlab.app.qt import QtCore
from vramlab.core.result import MemoryResult
from vramlab.core.spec import GpuSpec, ModelSpec, SetupError, TrainingSetup

SimulateFn = Callable[..., MemoryResult]


def _core_simulate() -> SimulateFn:
    from vramlab.core.measure.simulate import simulate  # imports torch: only ever in the worker thread

    return simulate


def _is_abort(exc: BaseException) -> bool:
    import sys

    step = sys.modules.get("vramlab.core.measure.step")
    aborted = getattr(step, "Aborted", None)
    return aborted is not None and isinstance(exc, aborted)


class SimulateWorker(QtCore.QObject):
    """One simulation. Emits exactly one of ``finished(result)``, ``errored(exception)``, ``cancelled()``."""

    progress = QtCore.Signal(str, object)  # phase key, live tensor bytes (object: bytes exceed 2**31)
    finished = QtCore.Signal(object)
    errored = QtCore.Signal(object)
    cancelled = QtCore.Signal()

    def __init__(self, spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None,
                 simulate_fn: SimulateFn | None = None) -> None:
        super().__init__()
        self._spec, self._setup, self._gpu = spec, setup, gpu
        self._fn = simulate_fn
        self._abort = threading.Event()

    def abort(self) -> None:
        """Ask the run to stop at the next phase boundary (safe from any thread)."""
        self._abort.set()

    def aborted(self) -> bool:
        return self._abort.is_set()

    def _on_phase(self, key: str, live_bytes: int) -> None:
        self.progress.emit(key, int(live_bytes))

    @QtCore.Slot()
    def run(self) -> None:
        outcome: tuple[str, Any] = ("cancelled", None)
        try:
            fn = self._fn or _core_simulate()
            if not self._abort.is_set():
                result = fn(self._spec, self._setup, self._gpu, on_phase=self._on_phase,
                            should_abort=self.aborted)
                outcome = ("cancelled", None) if self._abort.is_set() else ("finished", result)
        except Exception as e:  # reported through `errored`, which the controller always listens to
            outcome = ("cancelled", None) if self._abort.is_set() or _is_abort(e) else ("errored", e)
        hand_back(self, outcome)


def hand_back(worker: QtCore.QObject, outcome: tuple[str, Any]) -> None:
    """End a worker's ``run``: move it back to the GUI thread (its ``deleteLater`` and the release of its
    Python wrapper happen there, see the module docstring), then emit its one ending signal, ``finished(value)``,
    ``errored(exception)`` or ``cancelled()``, as ``outcome`` = (kind, value) says."""
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


class SimulationController(QtCore.QObject):
    """Starts simulations on a QThread and hands their outcome back on the GUI thread."""

    started = QtCore.Signal(object)  # (ModelSpec, TrainingSetup)
    progress = QtCore.Signal(str, object)
    succeeded = QtCore.Signal(object)  # MemoryResult
    failed = QtCore.Signal(str)
    cancelled = QtCore.Signal()
    runningChanged = QtCore.Signal(bool)

    def __init__(self, parent: QtCore.QObject | None = None, simulate_fn: SimulateFn | None = None) -> None:
        super().__init__(parent)
        self._fn = simulate_fn
        self._thread: QtCore.QThread | None = None
        self._worker: SimulateWorker | None = None
        self._job: tuple[ModelSpec, TrainingSetup] | None = None
        self._gc_was_enabled = False
        self._gc_timer = QtCore.QTimer(self)
        self._gc_timer.setInterval(250)
        self._gc_timer.timeout.connect(self._collect)

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def job(self) -> tuple[ModelSpec, TrainingSetup] | None:
        return self._job

    def set_simulate_fn(self, fn: SimulateFn | None) -> None:
        """Use another simulate function (tests use a fast fake); None restores the core's."""
        self._fn = fn

    def start(self, spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None) -> bool:
        if self._thread is not None:
            return False
        thread = QtCore.QThread()
        thread.setObjectName("vramlab-simulate")
        worker = SimulateWorker(spec, setup, gpu, self._fn)
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
        self._thread, self._worker, self._job = thread, worker, (spec, setup)
        self._gc_was_enabled = gc.isenabled()
        gc.disable()  # collections happen on the GUI thread's timer while the worker runs
        self._gc_timer.start()
        thread.start()
        self.runningChanged.emit(True)
        self.started.emit((spec, setup))
        return True

    def cancel(self) -> None:
        if self._worker is not None:
            self._worker.abort()

    def shutdown(self, timeout_ms: int = 20000) -> bool:
        """Abort and wait for the thread (window closing). True when no thread is left running."""
        thread = self._thread
        if thread is None:
            return True
        if self._worker is not None:
            self._worker.abort()
        thread.quit()
        done = thread.wait(timeout_ms)
        QtCore.QCoreApplication.sendPostedEvents(None, 0)  # the worker's last signals and `finished`
        if done and self._thread is not None:
            self._on_thread_finished()
        return bool(done)

    # ---- slots (GUI thread) -------------------------------------------------------------------------------
    @QtCore.Slot(str, object)
    def _on_progress(self, key: str, live_bytes: Any) -> None:
        self.progress.emit(key, live_bytes)

    @QtCore.Slot(object)
    def _on_finished(self, result: Any) -> None:
        self.succeeded.emit(result)

    @QtCore.Slot(object)
    def _on_errored(self, exc: Any) -> None:
        if isinstance(exc, SetupError):
            self.failed.emit(str(exc))
        elif isinstance(exc, MemoryError):
            self.failed.emit("The simulation ran out of host memory.")
        elif isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch":
            # the estimator-only build, or an environment without torch: say what to do, not the exception
            self.failed.emit("Simulation needs PyTorch, which this installation lacks: use the full build "
                             "or install torch. Estimates work without it.")
        else:
            self.failed.emit(f"{type(exc).__name__}: {exc}")

    @QtCore.Slot()
    def _on_cancelled(self) -> None:
        self.cancelled.emit()

    @QtCore.Slot()
    def _on_thread_finished(self) -> None:
        if self._thread is not None:
            self._thread.wait()  # `finished` is emitted just before the thread ends: let it end
        self._thread = None
        self._worker = None
        self._job = None
        self._gc_timer.stop()
        if self._gc_was_enabled:
            gc.enable()
        self.runningChanged.emit(False)

    @staticmethod
    def _collect() -> None:
        """Python's own generational thresholds, applied from the GUI thread."""
        counts, thresholds = gc.get_count(), gc.get_threshold()
        for generation in (2, 1, 0):
            if all(counts[g] > thresholds[g] for g in range(generation + 1)):
                gc.collect(generation)
                return
