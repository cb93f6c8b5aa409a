"""Computing the advice off the GUI thread.

The advisor's core calls are fast for most setups (a few ms once the estimator has recorded the setup's
structure), but not always: a structure the estimator has not seen costs 15-50 ms to record, and setups
whose token counts cannot stay symbolic (chunked loss, mixture-of-experts models) record one per probed
size. Measured here (2 shared cores): Llama-2-7B LoRA with chunked loss, per edit of the sequence length:
savings 200-270 ms, fit search 100-370 ms; Mixtral-8x7B QLoRA: savings ~320 ms, fit search 0.4-1.0 s.
That would freeze typing, so the advice is computed here:

* :func:`compute_advice` is the plain function: one :class:`AdviceRequest` in, one frozen
  :class:`AdviceAnswer` out, parts computed in order (checklist, savings, fit search, sweep) with an abort
  check between parts. It is tested without threads.
* :class:`AdviceController` runs it on a worker thread (:class:`vramlab.app.workers.Runner`, the window's
  one way of running background work), reports a partial answer after each part, so the savings appear
  while the fit search still runs, and runs at most one job: a new request aborts the running one (it stops
  at the next part boundary) and starts when it has ended. ``shutdown()`` waits for the job when the
  window closes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vramlab.app.qt import QtCore
from vramlab.app.workers import Runner, Worker
from vramlab.core.advisor import (
    FitAnswer,
    Saving,
    Sweep,
    allocator_advice,
    checklist,
    fit_search,
    savings,
    sweep_around,
)
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.report import gui_message
from vramlab.core.result import MemoryResult
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

log = logging.getLogger(__name__)

PARTS = ("checks", "savings", "fit", "sweep")  # computation order: cheapest and most wanted first


@dataclass(frozen=True)
class AdviceRequest:
    """What to compute advice for. ``parts`` picks which of :data:`PARTS`."""

    model: ModelSpec
    setup: TrainingSetup
    result: MemoryResult  # the estimate of ``setup`` (the snapshot's), for the allocator advice and checklist
    gpu: GpuSpec | None
    margin: float
    target_batch: int | None
    sweep_field: str
    parts: frozenset[str] = frozenset(PARTS)
    generation: int = 0
    allocator: bool = False  # device levels from the allocator replay (as the main view shows them)


@dataclass(frozen=True)
class AdviceAnswer:
    """The parts computed so far (None: not computed) and, per part, the core's message when it failed."""

    request: AdviceRequest
    savings: tuple[Saving, ...] | None = None
    fit: FitAnswer | None = None
    suggestion: MemoryResult | None = None  # the estimate of the fit search's suggested setup
    sweep: Sweep | None = None
    advice: tuple[str, ...] | None = None
    checklist: tuple[tuple[str, str], ...] | None = None
    errors: Mapping[str, str] = field(default_factory=dict)
    seconds: Mapping[str, float] = field(default_factory=dict)

    @property
    def done(self) -> frozenset[str]:
        have = {"savings": self.savings, "fit": self.fit, "sweep": self.sweep, "checks": self.checklist}
        return frozenset(k for k, v in have.items() if v is not None) | frozenset(self.errors)


def _message(e: Exception) -> str:
    if isinstance(e, SetupError):
        return gui_message(str(e))
    log.exception("advisor part failed")
    return f"The advisor failed unexpectedly ({type(e).__name__}: {e}). Please report this setup."


def _part(req: AdviceRequest, name: str) -> dict[str, Any]:
    """The fields of :class:`AdviceAnswer` that one part fills in."""
    if name == "checks":
        return {"advice": tuple(allocator_advice(req.result)),
                "checklist": tuple(checklist(req.model, req.setup, req.result))}
    if name == "savings":
        return {"savings": tuple(savings(req.model, req.setup, req.gpu, allocator=req.allocator))}
    if name == "fit":
        if req.gpu is None:
            raise SetupError("choose a GPU in the setup panel to search for the largest batch and sequence")
        ans = fit_search(req.model, req.setup, req.gpu, margin=req.margin, target_batch=req.target_batch,
                         allocator=req.allocator)
        sugg = (estimate(req.model, ans.suggestion, req.gpu, allocator=req.allocator)
                if ans.suggestion is not None else None)
        return {"fit": ans, "suggestion": sugg}
    if name == "sweep":
        return {"sweep": sweep_around(req.model, req.setup, req.sweep_field, gpu=req.gpu, allocator=req.allocator)}
    raise ValueError(f"unknown advice part {name!r}")


def compute_advice(req: AdviceRequest, should_abort: Callable[[], bool] = lambda: False,
                   on_part: Callable[[AdviceAnswer], None] | None = None) -> AdviceAnswer | None:
    """Compute the requested parts in :data:`PARTS` order. ``on_part`` receives the answer so far after each
    part. Returns None when aborted (between parts). A core error is kept per part, never raised."""
    ans = AdviceAnswer(req)
    for name in PARTS:
        if name not in req.parts:
            continue
        if should_abort():
            return None
        t0 = time.perf_counter()
        try:
            ans = replace(ans, **_part(req, name))
        except Exception as e:  # a core bug in one part must not lose the others
            ans = replace(ans, errors={**ans.errors, name: _message(e)})
        ans = replace(ans, seconds={**ans.seconds, name: time.perf_counter() - t0})
        if on_part is not None:
            on_part(ans)
    return ans


class AdviceController(QtCore.QObject):
    """At most one advice job on a worker thread; the latest request wins."""

    answered = QtCore.Signal(object)  # AdviceAnswer, partial or complete (GUI thread)
    failed = QtCore.Signal(str)
    runningChanged = QtCore.Signal(bool)

    def __init__(self, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self._pending: AdviceRequest | None = None
        self._runner = Runner("vramlab-advisor", self)
        self._runner.progress.connect(self.answered)
        self._runner.finished.connect(self.answered)
        self._runner.errored.connect(self._on_errored)
        self._runner.ended.connect(self._on_ended)

    @property
    def running(self) -> bool:
        return self._runner.running

    @property
    def jobs_started(self) -> int:
        return self._runner.jobs_started

    def request(self, req: AdviceRequest) -> None:
        """Compute ``req`` next: now if idle, else when the running job (asked to stop) has ended."""
        if not self._runner.running:
            self._start(req)
            return
        self._pending = req
        self._runner.abort()

    def cancel(self) -> None:
        self._pending = None
        self._runner.abort()

    def _start(self, req: AdviceRequest, announce: bool = True) -> None:
        def job(worker: Worker) -> AdviceAnswer | None:
            return compute_advice(req, worker.aborted, worker.report)

        self._runner.start(job)
        if announce:  # a pending request started when the last ended: still running, nothing to announce
            self.runningChanged.emit(True)

    def shutdown(self, timeout_ms: int = 10000) -> bool:
        """Abort and wait (window closing). True when no thread is left running."""
        self._pending = None
        return self._runner.shutdown(timeout_ms)

    # ---- slots (GUI thread) -------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_errored(self, exc: Any) -> None:
        self.failed.emit(f"The advisor failed: {type(exc).__name__}: {exc}")

    @QtCore.Slot()
    def _on_ended(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._start(pending, announce=False)
        else:
            self.runningChanged.emit(False)
