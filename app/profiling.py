"""Live profiling off the GUI thread: ``core.profiling.profile`` in a child process, watched from two jobs.

Both jobs run on :class:`~vramlab.app.workers.Runner` threads (the window's one way of running background
work: the thread, the garbage-collection pause, the hand-back and shutdown are described there).

* The profile job (thread ``vramlab-profile``) calls ``profile()``, which starts the child process and
  blocks until it ends. The child's JSON events arrive on a reader thread inside ``profile()``; they are
  queued and reported by the job's own thread whenever ``profile()`` polls ``should_abort`` (every 50 ms),
  so every signal leaves from a QThread we started.
* :class:`LiveSampler` (thread ``vramlab-sampler``) reads the GPU sampler (NVML, or the fake one that tests
  inject) and the child's resident memory and CPU time (psutil) every ``SAMPLE_INTERVAL_S`` (20 Hz) and
  reports one frozen :class:`LiveSample` per reading.
* :class:`ProfileController` owns at most one run, relays both jobs' readings to the GUI thread and
  reports exactly one :class:`~vramlab.core.profiling.outcomes.ProfileOutcome` per run through ``finished``
  (a failure inside the job becomes an outcome of kind ``error``), after both threads have ended.
  ``cancel()`` works at any moment: ``profile()`` ends the child's whole process group. ``shutdown()`` does
  the same and waits (window closing).

Everything that crosses a thread is a frozen record of :mod:`vramlab.core.live` (:class:`RunStarted`,
:class:`PhaseMark`, :class:`AllocatorReading`, :class:`LiveSample`), which holds the numbers behind the
view too, so that they are tested without Qt.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from typing import Any

from vramlab.app.qt import QtCore
from vramlab.app.workers import Runner, Worker
from vramlab.core.checks import SetupError
from vramlab.core.live import (
    SAMPLE_INTERVAL_S,
    AllocatorReading,
    GpuProbe,
    LiveSample,
    PhaseMark,
    RunRequest,
    RunStarted,
)
from vramlab.core.monitor.watch import RunWatch
from vramlab.core.profiling.outcomes import OutcomeKind, ProfileOutcome

log = logging.getLogger(__name__)


ProfileFn = Callable[..., ProfileOutcome]
SamplerFactory = Callable[[], Any]  # () -> GpuSampler (core.monitor protocol) or None
TREE_RESCAN_S = 5.0  # how often the run's process tree is searched for new processes (torchrun's ranks)
TREE_FIRST_S = 0.25  # the first searches' interval, doubling up to TREE_RESCAN_S: ranks start just after the launcher


# ---- what crosses threads ------------------------------------------------------------------------------------

# ---- workers ---------------------------------------------------------------------------------------------------

def _core_profile() -> ProfileFn:
    from vramlab.core.profiling.profile import profile

    return profile


def profile_job(request: RunRequest, t0: float, profile_fn: ProfileFn | None, sampler: Any,
                on_pid: Callable[[int], None] | None = None,
                watch: RunWatch | None = None) -> Callable[[Worker], ProfileOutcome]:
    """The job that runs one profile: it reports :class:`RunStarted`, then a :class:`PhaseMark` per boundary
    and :class:`AllocatorReading` between them, and returns the :class:`ProfileOutcome`."""
    events: queue.SimpleQueue[tuple[float, dict[str, Any]]] = queue.SimpleQueue()

    def on_event(event: dict[str, Any]) -> None:
        """Called on profile()'s reader thread: never emit from there, only queue (and pass the pid on)."""
        if event.get("event") == "started" and on_pid is not None:
            on_pid(int(event["pid"]))
        events.put((time.monotonic() - t0, event))

    def job(worker: Worker) -> ProfileOutcome:
        def drain() -> None:
            while True:
                try:
                    t_s, event = events.get_nowait()
                except queue.Empty:
                    return
                kind = event.get("event")
                if kind == "started":
                    worker.report(RunStarted(int(event["pid"]), t_s))
                elif kind == "phase":
                    worker.report(PhaseMark.from_event(event, t_s))
                elif kind == "mem":
                    worker.report(AllocatorReading.from_event(event, t_s))

        def should_abort() -> bool:
            drain()
            return worker.aborted()

        r = request
        fn = profile_fn or _core_profile()
        try:
            return fn(r.spec, r.setup, device=r.device, gpu=r.gpu, steps=r.steps, isolate=True,
                      timeout_s=r.timeout_s, on_event=on_event, should_abort=should_abort, fault=r.fault,
                      tracked=r.tracked, sampler=sampler if r.device == "cuda" else None,
                      **({"watch": watch} if watch is not None else {}))
        finally:
            drain()

    return job


class LiveSampler:
    """Reads the run's GPU through the core's :class:`~vramlab.core.monitor.watch.RunWatch` (the run's one
    NVML loop: the profile itself reads the same watch for its peaks and context) and the child process:
    :meth:`read` once, :meth:`loop` every ``interval_s`` until its job is aborted, reporting one
    :class:`LiveSample` per reading."""

    def __init__(self, watch: RunWatch | None, t0: float, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self._watch = watch
        self._t0 = t0
        self._interval = interval_s
        self._pid = 0
        self._proc: Any = None
        self._known: dict[int, Any] = {}  # psutil processes of the run, by pid (their CPU counters)
        self._children: list[Any] = []  # the child's descendants at the last search
        self._searched = -float("inf")  # time.monotonic() of that search
        self._searches = 0  # searches of this child's tree so far
        self._lost = False
        self._ncpu = max(1, os.cpu_count() or 1)

    def set_pid(self, pid: int) -> None:
        """The child to watch (safe from any thread)."""
        self._pid = int(pid)

    def loop(self, worker: Worker) -> None:
        """The sampler job: a reading every interval until the job is aborted (within one interval)."""
        next_t = time.monotonic()
        while not worker.aborted():
            worker.report(self.read())
            next_t += self._interval
            now = time.monotonic()
            if next_t < now - self._interval:  # fell behind (a slow NVML call): do not burst to catch up
                next_t = now
            worker.wait(max(0.0, next_t - now))

    def read(self) -> LiveSample:
        """One reading (runs on the sampler thread; also callable directly in tests)."""
        t_s = time.monotonic() - self._t0
        values: dict[str, Any] = {}
        missing: set[str] = set()
        procs = self._tree()  # once per reading: NVML's per-process memory and psutil's both use it
        if self._watch is not None and not self._lost:
            sample = self._watch.read()  # never raises; None before the run's GPU is known
            index = self._watch.nvml_index(0)
            reading = sample.get(index) if sample is not None and index is not None else None
            if reading is None:
                missing.add("gpu")
            elif reading.lost:
                self._lost = True
            else:
                mine = [x for x in (reading.process(p.pid) for p in procs) if x is not None]
                used = [x.used_bytes for x in mine if x.used_bytes is not None]
                values.update(
                    device_used_bytes=reading.memory_used_bytes, device_total_bytes=reading.memory_total_bytes,
                    process_used_bytes=sum(used) if used else None,
                    util_pct=float(reading.utilization_gpu_pct) if reading.utilization_gpu_pct is not None else None,
                    power_w=reading.power_mw / 1000 if reading.power_mw is not None else None,
                    power_limit_w=reading.power_limit_mw / 1000 if reading.power_limit_mw is not None else None,
                )
                missing |= set(reading.missing)
        values.update(self._host(procs))
        return LiveSample(t_s, gpu_lost=self._lost, missing=frozenset(missing), **values)

    def _tree(self) -> list[Any]:
        """The run's processes (psutil): the child and, for a sharded run, torchrun's rank processes under it;
        empty before the child started or once it is gone. Finding the descendants reads every process of
        the machine (psutil scans /proc: a millisecond here, more on a desktop with hundreds of processes:
        most of a reading), so it is done once every ``TREE_RESCAN_S`` (torchrun starts its ranks once, at the
        start; the first searches come sooner, from ``TREE_FIRST_S`` doubling, since the launcher starts them a
        moment after it starts: a run of a few seconds was sampled as the launcher alone) and at the next reading
        after a process of the tree ended (:meth:`_host`)."""
        if not self._pid:
            return []
        import psutil

        try:
            if self._proc is None or self._proc.pid != self._pid:
                self._proc = psutil.Process(self._pid)
                self._known = {}
                self._searched, self._searches = -float("inf"), 0
            now = time.monotonic()
            if now - self._searched >= min(TREE_RESCAN_S, TREE_FIRST_S * 2 ** self._searches):
                self._children = self._proc.children(recursive=True)
                self._searched = now
                self._searches += 1
            return [self._proc, *self._children]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return []

    def _host(self, procs: list[Any]) -> dict[str, Any]:
        """Resident memory and CPU share of the run's whole process tree (psutil)."""
        if not procs:
            return {}
        import psutil

        rss = 0
        cpu = 0.0
        first = False
        for p in procs:
            try:
                with p.oneshot():
                    rss += int(p.memory_info().rss)
                    if p.pid not in self._known:  # the first call only starts the CPU measurement
                        p.cpu_percent(None)
                        self._known[p.pid] = p
                        first = first or p.pid == self._pid
                    else:
                        cpu += self._known[p.pid].cpu_percent(None)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                if p.pid != self._pid:  # a rank ended (torchrun may start another): search the tree again
                    self._searched = -float("inf")
                continue
        if not rss:  # an exited child awaiting its parent reads as 0: not a reading
            return {}
        if first:
            return {"rss_bytes": rss}
        return {"rss_bytes": rss, "cpu_pct": cpu / self._ncpu}


# ---- the controller ----------------------------------------------------------------------------------------------

def default_sampler_factory() -> Any:
    from vramlab.core.monitor import NvmlSampler

    return NvmlSampler()


def probe_sampler(sampler: Any) -> GpuProbe:
    """Which GPU CUDA device 0 is, by NVML (no torch, no CUDA context), or why there is none."""
    if sampler is None:
        return GpuProbe(False, "no GPU sampler")
    from vramlab.core.monitor.detect import cuda_devices

    try:
        if not sampler.available():
            return GpuProbe(False, sampler.reason() or "NVML is not available")
        devices, certain = cuda_devices(sampler)
    except Exception as e:  # noqa: BLE001 - detection is optional; say why
        return GpuProbe(False, f"GPU detection failed: {e}")
    if not devices:
        return GpuProbe(False, "no GPU is visible to CUDA here (CUDA_VISIBLE_DEVICES hides them all)"
                        if sampler.devices() else (sampler.reason() or "the NVIDIA driver reports no GPU"))
    first = devices[0]  # cuda:0 (by NVML's order; a run reports its own UUID and the watch follows it)
    return GpuProbe(True, "", first.name, first.memory_total_bytes, first.nvml_index, first.driver_version,
                    first.cuda_driver_version, len(devices), first.compute_capability, certain)


class ProfileController(QtCore.QObject):
    """Starts profile runs and hands their readings and outcome to the GUI thread. One run at a time."""

    runningChanged = QtCore.Signal(bool)
    runStarted = QtCore.Signal(object)  # RunRequest, when start() accepted it
    childStarted = QtCore.Signal(object)  # RunStarted (the child process exists)
    phase = QtCore.Signal(object)  # PhaseMark
    memory = QtCore.Signal(object)  # AllocatorReading
    sample = QtCore.Signal(object)  # LiveSample
    finished = QtCore.Signal(object)  # ProfileOutcome, after both threads ended

    def __init__(self, parent: QtCore.QObject | None = None, profile_fn: ProfileFn | None = None,
                 sampler_factory: SamplerFactory | None = None) -> None:
        super().__init__(parent)
        self._fn = profile_fn
        self._factory = sampler_factory or default_sampler_factory
        self._sampler: Any = None
        self._probe: GpuProbe | None = None
        self._request: RunRequest | None = None
        self._profiler = Runner("vramlab-profile", self)
        self._profiler.progress.connect(self._on_progress)
        self._profiler.finished.connect(self._on_finished)
        self._profiler.errored.connect(self._on_errored)
        self._profiler.cancelled.connect(self._on_finished_without_outcome)
        self._profiler.ended.connect(self._on_ended)
        self._sampling = Runner("vramlab-sampler", self)
        self._sampling.progress.connect(self.sample)
        self._sampling.errored.connect(lambda e: log.warning("live sampling stopped: %s: %s", type(e).__name__, e))
        self._sampling.ended.connect(self._on_ended)
        self._outcome: ProfileOutcome | None = None
        self._cancelled = False
        self._t0 = 0.0

    # ---- configuration -------------------------------------------------------------------------------------------
    def set_profile_fn(self, fn: ProfileFn | None) -> None:
        """Use another profile function (benchmarks use a fake one); None restores the core's."""
        self._fn = fn

    def set_sampler_factory(self, factory: SamplerFactory | None) -> None:
        """Use another GPU sampler (tests inject core.monitor.FakeSampler); None restores NVML. The sampler
        is made on the next probe() and reused by every run until the next change."""
        if self._sampler is not None and self._request is None:
            self._close_sampler()
        self._factory = factory or default_sampler_factory
        self._probe = None

    def gpu_sampler(self) -> Any:
        if self._sampler is None:
            try:
                self._sampler = self._factory()
            except Exception as e:  # noqa: BLE001 - no sampler is a state the view explains
                log.warning("GPU sampler could not be made: %s", e)
                self._sampler = None
        return self._sampler

    def probe(self, refresh: bool = False) -> GpuProbe:
        if self._probe is None or refresh:
            self._probe = probe_sampler(self.gpu_sampler())
        return self._probe

    # ---- state ---------------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._profiler.running or self._sampling.running

    @property
    def t0(self) -> float:
        """``time.monotonic()`` when the current (or last) run started: time zero of its readings."""
        return self._t0

    @property
    def request(self) -> RunRequest | None:
        """The run in progress (None when idle)."""
        return self._request

    # ---- control -------------------------------------------------------------------------------------------------
    def start(self, request: RunRequest) -> bool:
        """Start ``request``; False if a run is already in progress."""
        if self.running:
            return False
        t0 = self._t0 = time.monotonic()
        gpu_sampler = self.gpu_sampler() if self.probe().available else None
        # the run's one NVML loop: the sampler thread drives this watch, the profile reads its peaks and context
        watch = (RunWatch(gpu_sampler, cuda_indices=range(max(1, request.setup.gpus)))
                 if gpu_sampler is not None else None)
        live = LiveSampler(watch, t0)
        self._request, self._outcome, self._cancelled = request, None, False
        self._sampling.start(live.loop)
        job = profile_job(request, t0, self._fn, gpu_sampler, on_pid=live.set_pid, watch=watch)
        self._profiler.start(job, keep_on_abort=True)  # a cancelled run's own outcome is its result
        self.runningChanged.emit(True)
        self.runStarted.emit(request)
        return True

    def cancel(self) -> None:
        """End the run now: the child process group is ended within 50 ms; the outcome is 'cancelled'."""
        if self._profiler.running:
            self._cancelled = True
            self._profiler.abort()

    def shutdown(self, timeout_ms: int = 20000) -> bool:
        """Cancel, wait for both threads (window closing) and close the GPU sampler. True when no thread
        is left running."""
        self._profiler.abort()
        self._sampling.abort()
        done = self._profiler.shutdown(timeout_ms)
        done = self._sampling.shutdown(timeout_ms) and done
        if done:
            self._close_sampler()
        return bool(done)

    def _close_sampler(self) -> None:
        if self._sampler is not None:
            try:
                self._sampler.close()
            except Exception as e:  # noqa: BLE001
                log.warning("closing the GPU sampler failed: %s", e)
            self._sampler = None
            self._probe = None

    # ---- slots (GUI thread) --------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_progress(self, value: Any) -> None:
        if isinstance(value, PhaseMark):
            self.phase.emit(value)
        elif isinstance(value, AllocatorReading):
            self.memory.emit(value)
        elif isinstance(value, RunStarted):
            self.childStarted.emit(value)

    @QtCore.Slot(object)
    def _on_finished(self, outcome: Any) -> None:
        self._outcome = outcome
        self._sampling.abort()

    @QtCore.Slot()
    def _on_finished_without_outcome(self) -> None:
        self._sampling.abort()

    @QtCore.Slot(object)
    def _on_errored(self, exc: Any) -> None:
        r = self._request
        device = r.device if r is not None else "?"
        if isinstance(exc, SetupError):
            text = str(exc)
        elif isinstance(exc, OSError):
            text = f"the profiling process could not be started ({exc.strerror or exc})"
        else:
            text = f"{type(exc).__name__}: {exc}"
        kind = OutcomeKind.CANCELLED if self._cancelled else OutcomeKind.ERROR
        self._outcome = ProfileOutcome(False, kind, text, device)
        self._sampling.abort()

    @QtCore.Slot()
    def _on_ended(self) -> None:
        if not self._profiler.running:
            self._sampling.abort()  # e.g. the job ended without its signals
        if self.running or self._request is None:
            return
        request = self._request
        outcome = self._outcome or ProfileOutcome(
            False, OutcomeKind.CANCELLED if self._cancelled else OutcomeKind.ERROR,
            "cancelled by the user" if self._cancelled else "the run ended without a result",
            request.device if request else "?")
        self._request, self._outcome = None, None
        self.runningChanged.emit(False)
        self.finished.emit(outcome)
