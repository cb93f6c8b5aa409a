"""Running ``core.simulation.simulate`` off the GUI thread.

:class:`SimulationController` owns at most one simulation, run by a :class:`~vramlab.app.workers.Runner`
(the window's one way of running background work: its thread, the garbage-collection pause, the hand-back
and shutdown are described there). The job imports torch itself, in the worker thread, so the GUI never
waits for it; the abort flag is checked by the simulation between phases. ``shutdown()`` stops a run when the
window closes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vramlab.app.qt import QtCore
from vramlab.app.workers import JobController, Worker
from vramlab.core.checks import SetupError
from vramlab.core.result import MemoryResult
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

SimulateFn = Callable[..., MemoryResult]


def _core_simulate() -> SimulateFn:
    from vramlab.core.simulation.simulate import simulate  # imports torch: only ever in the worker thread

    return simulate


class SimulationController(JobController):
    """Starts simulations on a worker thread and hands their outcome back on the GUI thread."""

    started = QtCore.Signal(object)  # (ModelSpec, TrainingSetup)
    progress = QtCore.Signal(str, object)  # phase key, live tensor bytes (object: bytes exceed 2**31)
    succeeded = QtCore.Signal(object)  # MemoryResult
    failed = QtCore.Signal(str)
    cancelled = QtCore.Signal()

    def __init__(self, parent: QtCore.QObject | None = None, simulate_fn: SimulateFn | None = None) -> None:
        super().__init__("vramlab-simulate", parent)
        self._fn = simulate_fn
        self._runner.progress.connect(self._on_progress)
        self._runner.finished.connect(self.succeeded)
        self._runner.errored.connect(self._on_errored)
        self._runner.cancelled.connect(self.cancelled)

    def set_simulate_fn(self, fn: SimulateFn | None) -> None:
        """Use another simulate function (tests use a fast fake); None restores the core's."""
        self._fn = fn

    def start(self, spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None) -> bool:
        fn = self._fn

        def job(worker: Worker) -> MemoryResult:
            simulate = fn or _core_simulate()
            return simulate(spec, setup, gpu, on_phase=lambda key, live: worker.report((key, int(live))),
                            should_abort=worker.aborted)

        return self._begin(job, (spec, setup))

    # ---- slots (GUI thread) -------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_progress(self, value: Any) -> None:
        key, live_bytes = value
        self.progress.emit(key, live_bytes)

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
