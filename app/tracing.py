"""Running a first trace (``core.traced``) off the GUI thread.

An architecture without a hand-written program (or a model set to the traced source) is estimated from a
trace of transformers' own training step: seconds the first time for a recipe, then from the cache. The
window never waits for it: :class:`TraceController` runs it on a :class:`~vramlab.app.workers.Runner` (one
at a time), relays its progress (text, fraction done), cancels it between runs of the model (the trace
checks the abort flag between phases), and says when it is done so that the estimate is made again. The
job imports torch and transformers itself, in the worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vramlab.app.qt import QtCore
from vramlab.app.workers import JobController, Worker
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

TraceFn = Callable[..., Any]


def _core_trace() -> TraceFn:
    from vramlab.core.traced import traced_tape

    return traced_tape


class TraceController(JobController):
    """Starts traces on a worker thread and hands their outcome back on the GUI thread."""

    started = QtCore.Signal(object)  # (ModelSpec, TrainingSetup)
    progress = QtCore.Signal(str, float)  # what is being traced, fraction done
    succeeded = QtCore.Signal(object)  # (ModelSpec, TrainingSetup)
    failed = QtCore.Signal(object, str)  # (ModelSpec, TrainingSetup), the reason
    cancelled = QtCore.Signal()

    def __init__(self, parent: QtCore.QObject | None = None, trace_fn: TraceFn | None = None) -> None:
        super().__init__("vramlab-trace", parent)
        self._fn = trace_fn
        self._runner.progress.connect(self._on_progress)
        self._runner.finished.connect(self.succeeded)
        self._runner.errored.connect(self._on_errored)
        self._runner.cancelled.connect(self.cancelled)

    def set_trace_fn(self, fn: TraceFn | None) -> None:
        """Use another trace function (tests use a fast fake); None restores the core's."""
        self._fn = fn

    def start(self, spec: ModelSpec, setup: TrainingSetup) -> bool:
        """Trace ``setup`` on ``spec``; False while another trace runs (it is asked again when that ends)."""
        fn = self._fn

        def job(worker: Worker) -> tuple[ModelSpec, TrainingSetup]:
            trace = fn or _core_trace()
            trace(spec, setup, progress=lambda text, done: worker.report((text, float(done))),
                  should_abort=worker.aborted)
            return spec, setup

        return self._begin(job, (spec, setup))

    @QtCore.Slot(object)
    def _on_progress(self, value: Any) -> None:
        text, done = value
        self.progress.emit(str(text), float(done))

    @QtCore.Slot(object)
    def _on_errored(self, exc: Any) -> None:
        self.failed.emit(self._job, f"{exc}" or type(exc).__name__)
