"""Looking up a Hugging Face Hub id off the GUI thread (config.json and safetensors headers; never weights).

:class:`HubLookupController` owns at most one lookup, run by a :class:`~vramlab.app.workers.Runner` (the
window's one way of running background work: thread, garbage-collection pause, hand-back, shutdown). The
lookup checks the abort flag before each request (a request already sent ends within the Hub timeout). It
relays progress to the GUI thread and hands back the :class:`~vramlab.core.catalog.ModelEntry` (with the
adapter config of an adapter repository, if any).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vramlab.app.qt import QtCore
from vramlab.app.workers import JobController, Worker
from vramlab.core.catalog import ModelEntry, hub_entry
from vramlab.core.checks import SetupError

LookupFn = Callable[..., ModelEntry]


class HubLookupController(JobController):
    """Starts Hub lookups on a worker thread and hands their outcome back on the GUI thread."""

    started = QtCore.Signal(str)  # the id
    progress = QtCore.Signal(object)  # a core.sources.hub.LookupStep
    succeeded = QtCore.Signal(str, object)  # the id, ModelEntry
    failed = QtCore.Signal(str, str)  # the id, one line
    cancelled = QtCore.Signal(str)

    def __init__(self, parent: QtCore.QObject | None = None, lookup_fn: LookupFn | None = None) -> None:
        super().__init__("vramlab-hub-lookup", parent)
        self._fn = lookup_fn
        self._runner.progress.connect(self.progress.emit)
        self._runner.finished.connect(lambda entry: self.succeeded.emit(self.ref, entry))
        self._runner.errored.connect(self._on_errored)
        self._runner.cancelled.connect(lambda: self.cancelled.emit(self.ref))

    @property
    def ref(self) -> str:
        """The id being looked up ('' when none)."""
        return self._job or ""

    def start(self, ref: str, fn: LookupFn | None = None) -> bool:
        """Look ``ref`` up with ``fn`` (default: the Hub lookup; the window also reads a local model whose
        first import builds it in transformers this way)."""
        fn = fn or self._fn or hub_entry

        def job(worker: Worker) -> ModelEntry | None:
            from vramlab.core.sources.hub import LookupCancelled

            try:
                return fn(ref, progress=worker.report, cancelled=worker.aborted)
            except LookupCancelled:
                if worker.aborted():
                    return None  # asked to stop: the runner reports `cancelled`
                raise

        return self._begin(job, ref)

    @QtCore.Slot(object)
    def _on_errored(self, exc: Any) -> None:
        text = str(exc) if isinstance(exc, SetupError) else f"{type(exc).__name__}: {exc}"
        self.failed.emit(self.ref, text)
