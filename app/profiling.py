"""Live profiling off the GUI thread: ``core.measure.profile`` in a child process, watched from two QThreads.

* :class:`ProfileWorker` (thread ``vramlab-profile``) calls ``profile()``, which starts the child process
  and blocks until it ends. The child's JSON events arrive on a reader thread inside ``profile()``; they
  are queued and re-emitted by the worker's own thread whenever ``profile()`` polls ``should_abort``
  (every 50 ms), so every signal leaves from a QThread we started.
* :class:`SamplerWorker` (thread ``vramlab-sampler``) reads the GPU sampler (NVML, or the fake one that
  tests inject) and the child's resident memory and CPU time (psutil) every ``SAMPLE_INTERVAL_S``
  (20 Hz) and emits one frozen :class:`LiveSample` per reading.
* :class:`ProfileController` owns at most one run, relays both workers' signals to the GUI thread and
  reports exactly one :class:`~vramlab.core.measure.profile.ProfileOutcome` per run through
  ``finished`` (a failure inside the worker becomes an outcome of kind ``error``), after both threads
  have ended. ``cancel()`` works at any moment: ``profile()`` ends the child's whole process group.
  ``shutdown()`` does the same and waits (window closing).

The thread-safety rules are those of :mod:`vramlab.app.simulation`: each worker moves itself back to the
GUI thread when its loop ends (its ``deleteLater`` and the release of its Python wrapper both happen
there), and while a worker thread runs Python's automatic garbage collection is off and the GUI thread
collects on a timer (:class:`GcPause`, shared by all runs).

Everything that crosses a thread is a frozen dataclass: :class:`RunStarted`, :class:`PhaseMark`,
:class:`LiveSample`. Times are seconds since the run started (``time.monotonic``); memory is in bytes.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import shiboken6

from vramlab.app.qt import QtCore
from vramlab.app.simulation import hand_back
from vramlab.core.measure.profile import ProfileOutcome
from vramlab.core.monitor.watch import RunWatch
from vramlab.core.result import MemoryResult
from vramlab.core.spec import GpuSpec, ModelSpec, SetupError, TrainingSetup

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.05  # 20 Hz
DEFAULT_TIMEOUT_S = 1800.0
DEVICES = ("cuda", "cpu")

ProfileFn = Callable[..., ProfileOutcome]
SamplerFactory = Callable[[], Any]  # () -> GpuSampler (core.monitor protocol) or None


# ---- what crosses threads ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunRequest:
    """One profile run: what runs where, and the estimate it is compared with (fixed at start)."""

    spec: ModelSpec
    setup: TrainingSetup
    device: str  # 'cuda' | 'cpu'
    gpu: GpuSpec | None  # the GPU the run uses (for the estimate and the fit verdict); None on the CPU
    predicted: MemoryResult | None
    steps: int = 2
    timeout_s: float = DEFAULT_TIMEOUT_S
    fault: str | None = None  # core.measure.child fault scenarios: oom | crash | hang | slow
    tracked: bool = False  # CUDA: also run the tensor tracker (split by kind; slower)
    nvml_index: int | None = None  # NVML index of CUDA device 0 when the run started (shown; the watch maps it)

    @property
    def phase_count(self) -> int:
        """Phase events a complete run emits after 'load': forward/backward per micro-batch (at most two,
        see core.measure.step) and one optimizer step, per step; plus 'end'."""
        micro = min(self.setup.grad_accum, 2)
        return self.steps * (2 * micro + 1) + 1


@dataclass(frozen=True)
class RunStarted:
    pid: int
    t_s: float


@dataclass(frozen=True)
class PhaseMark:
    """A phase boundary reported by the child: the phase entered, the allocator's readings at that moment
    and the peaks of the phase that just ended (tensor level and allocator-reserved level)."""

    t_s: float
    key: str  # 'load', 'forward@1', ..., 'end'
    allocated_bytes: int
    reserved_bytes: int
    ended: str | None = None
    ended_peak_allocated_bytes: int | None = None
    ended_peak_reserved_bytes: int | None = None
    rank: int | None = None  # a sharded run under torchrun: the rank (one process per GPU) that reported it

    @classmethod
    def from_event(cls, event: dict[str, Any], t_s: float) -> PhaseMark:
        def opt(name: str) -> int | None:
            v = event.get(name)
            return int(v) if v is not None else None

        return cls(t_s, str(event.get("key", "?")), int(event.get("allocated") or 0),
                   int(event.get("reserved") or 0), event.get("ended"), opt("ended_peak_allocated"),
                   opt("ended_peak_reserved"), opt("rank"))

    @property
    def leads(self) -> bool:
        """Whether this mark drives the plot's phase bands and the progress bar: a single-process run's
        marks, or rank 0's of a sharded run (the other ranks run the same phases at about the same time)."""
        return self.rank is None or self.rank == 0


@dataclass(frozen=True, slots=True)
class AllocatorReading:
    """The child's allocator between phase boundaries (10 Hz): ``torch.cuda.memory_allocated`` /
    ``memory_reserved`` on CUDA, the tracker's live bytes (both) on the CPU."""

    t_s: float
    allocated_bytes: int
    reserved_bytes: int
    rank: int | None = None

    @classmethod
    def from_event(cls, event: dict[str, Any], t_s: float) -> AllocatorReading:
        rank = event.get("rank")
        return cls(t_s, int(event.get("allocated") or 0), int(event.get("reserved") or 0),
                   int(rank) if rank is not None else None)

    @property
    def leads(self) -> bool:
        return self.rank is None or self.rank == 0


@dataclass(frozen=True, slots=True)
class LiveSample:
    """One reading of the sampler thread. None: not available (no GPU, field not supported, process gone).

    GPU fields are NVML's for the GPU the run uses: ``device_used_bytes`` is the whole device as
    ``nvidia-smi`` shows it (every process), ``process_used_bytes`` this run's child alone. Host fields are
    psutil's for the child process: ``rss_bytes`` (resident memory) and ``cpu_pct`` (share of the whole
    machine, 0-100)."""

    t_s: float
    device_used_bytes: int | None = None
    device_total_bytes: int | None = None
    process_used_bytes: int | None = None
    util_pct: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    rss_bytes: int | None = None
    cpu_pct: float | None = None
    gpu_lost: bool = False
    missing: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class GpuProbe:
    """What the GPU sampler says about this machine, read once (NVML init is not free)."""

    available: bool
    reason: str  # why not, when not available (NVML init failure)
    name: str | None = None
    memory_total_bytes: int | None = None
    nvml_index: int | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    count: int = 0
    compute_capability: tuple[int, int] | None = None
    order_certain: bool = True  # False: CUDA's fastest-first order on mixed GPUs; cuda:0 is NVML's first guess


# ---- garbage collection while worker threads run ---------------------------------------------------------------

class GcPause(QtCore.QObject):
    """Automatic gc off while any of our worker threads runs; the GUI thread collects on a timer instead
    (see :mod:`vramlab.app.simulation`). Counted, so overlapping runs do not re-enable it early."""

    _instance: GcPause | None = None

    def __init__(self) -> None:
        super().__init__()
        self._count = 0
        self._was_enabled = False
        self._timer = QtCore.QTimer(self)
        self._timer.setInterval(250)
        self._timer.timeout.connect(self._collect)

    @classmethod
    def shared(cls) -> GcPause:
        if cls._instance is None:
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

    def _collect(self) -> None:
        """Python's own generational thresholds, applied from the GUI thread."""
        if gc.isenabled():  # someone else (a simulation that ended) turned it back on: our threads still run
            gc.disable()
        counts, thresholds = gc.get_count(), gc.get_threshold()
        for generation in (2, 1, 0):
            if all(counts[g] > thresholds[g] for g in range(generation + 1)):
                gc.collect(generation)
                return


# ---- workers ---------------------------------------------------------------------------------------------------

def _core_profile() -> ProfileFn:
    from vramlab.core.measure.profile import profile

    return profile


class ProfileWorker(QtCore.QObject):
    """Runs one profile. Emits ``started`` (the child's pid), ``phase`` per boundary, then exactly one
    ``finished(ProfileOutcome)`` or ``errored(exception)``."""

    started = QtCore.Signal(object)  # RunStarted
    phase = QtCore.Signal(object)  # PhaseMark
    memory = QtCore.Signal(object)  # AllocatorReading
    finished = QtCore.Signal(object)  # ProfileOutcome
    errored = QtCore.Signal(object)  # Exception

    def __init__(self, request: RunRequest, t0: float, profile_fn: ProfileFn | None, sampler: Any,
                 on_pid: Callable[[int], None] | None = None, watch: RunWatch | None = None) -> None:
        super().__init__()
        self._watch = watch
        self._request = request
        self._t0 = t0
        self._fn = profile_fn
        self._sampler = sampler
        self._on_pid = on_pid
        self._abort = threading.Event()
        self._events: queue.SimpleQueue[tuple[float, dict[str, Any]]] = queue.SimpleQueue()

    def abort(self) -> None:
        """Ask the run to stop now (safe from any thread): the child is ended at the next poll (50 ms)."""
        self._abort.set()

    def _on_event(self, event: dict[str, Any]) -> None:
        """Called on profile()'s reader thread: never emit from there, only queue (and pass the pid on)."""
        if event.get("event") == "started" and self._on_pid is not None:
            self._on_pid(int(event["pid"]))
        self._events.put((time.monotonic() - self._t0, event))

    def _drain(self) -> None:
        while True:
            try:
                t_s, event = self._events.get_nowait()
            except queue.Empty:
                return
            kind = event.get("event")
            if kind == "started":
                self.started.emit(RunStarted(int(event["pid"]), t_s))
            elif kind == "phase":
                self.phase.emit(PhaseMark.from_event(event, t_s))
            elif kind == "mem":
                self.memory.emit(AllocatorReading.from_event(event, t_s))

    def _should_abort(self) -> bool:
        self._drain()
        return self._abort.is_set()

    @QtCore.Slot()
    def run(self) -> None:
        r = self._request
        outcome: ProfileOutcome | None = None
        error: BaseException | None = None
        try:
            fn = self._fn or _core_profile()
            outcome = fn(r.spec, r.setup, device=r.device, gpu=r.gpu, steps=r.steps, isolate=True,
                         timeout_s=r.timeout_s, on_event=self._on_event, should_abort=self._should_abort,
                         fault=r.fault, tracked=r.tracked,
                         sampler=self._sampler if r.device == "cuda" else None,
                         **({"watch": self._watch} if self._watch is not None else {}))
        except Exception as e:  # reported through `errored`, which the controller always listens to
            error = e
        self._drain()
        hand_back(self, ("finished", outcome) if outcome is not None else ("errored", error))


class SamplerWorker(QtCore.QObject):
    """Reads the run's GPU through the core's :class:`~vramlab.core.monitor.watch.RunWatch` (the run's one
    NVML loop: the profile itself reads the same watch for its peaks and context) and the child process
    every ``interval_s`` until ``stop()``; one ``sampled(LiveSample)`` per reading, then ``finished``."""

    sampled = QtCore.Signal(object)  # LiveSample
    finished = QtCore.Signal()

    def __init__(self, watch: RunWatch | None, t0: float, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        super().__init__()
        self._watch = watch
        self._t0 = t0
        self._interval = interval_s
        self._stop = threading.Event()
        self._pid = 0
        self._proc: Any = None
        self._known: dict[int, Any] = {}  # psutil processes of the run, by pid (their CPU counters)
        self._lost = False
        self._ncpu = max(1, os.cpu_count() or 1)

    def set_pid(self, pid: int) -> None:
        """The child to watch (safe from any thread)."""
        self._pid = int(pid)

    def stop(self) -> None:
        """Safe from any thread; the loop ends within one interval."""
        self._stop.set()

    @QtCore.Slot()
    def run(self) -> None:
        next_t = time.monotonic()
        try:
            while not self._stop.is_set():
                self.sampled.emit(self.read())
                next_t += self._interval
                now = time.monotonic()
                if next_t < now - self._interval:  # fell behind (a slow NVML call): do not burst to catch up
                    next_t = now
                self._stop.wait(max(0.0, next_t - now))
        finally:
            app = QtCore.QCoreApplication.instance()
            if app is not None:
                self.moveToThread(app.thread())
            self.finished.emit()

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
        empty before the child started or once it is gone."""
        if not self._pid:
            return []
        import psutil

        try:
            if self._proc is None or self._proc.pid != self._pid:
                self._proc = psutil.Process(self._pid)
                self._known = {}
            return [self._proc, *self._proc.children(recursive=True)]
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


def gpu_spec_for(probe: GpuProbe) -> GpuSpec | None:
    """The GpuSpec of the detected GPU (core.catalog.detected_gpu: the catalogue's entry, the driver's memory)."""
    if not probe.available or not probe.name or not probe.memory_total_bytes:
        return None
    from vramlab.core.catalog import detected_gpu

    return detected_gpu(probe.name, int(probe.memory_total_bytes), 0, probe.compute_capability)


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
        self._threads: dict[str, QtCore.QThread] = {}
        self._profile_worker: ProfileWorker | None = None
        self._sampler_worker: SamplerWorker | None = None
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
        return bool(self._threads)

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
        if self._threads:
            return False
        t0 = self._t0 = time.monotonic()
        gpu_sampler = self.gpu_sampler() if self.probe().available else None
        # the run's one NVML loop: the sampler thread drives this watch, the profile reads its peaks and context
        watch = (RunWatch(gpu_sampler, cuda_indices=range(max(1, request.setup.gpus)))
                 if gpu_sampler is not None else None)
        sampler_worker = SamplerWorker(watch, t0)
        worker = ProfileWorker(request, t0, self._fn, gpu_sampler, on_pid=sampler_worker.set_pid, watch=watch)

        pthread = QtCore.QThread()
        pthread.setObjectName("vramlab-profile")
        worker.moveToThread(pthread)
        pthread.started.connect(worker.run)
        worker.started.connect(self._on_child_started)
        worker.phase.connect(self._on_phase)
        worker.memory.connect(self._on_memory)
        worker.finished.connect(self._on_finished)
        worker.errored.connect(self._on_errored)  # always connected: a failure is never silent
        for done in (worker.finished, worker.errored):
            done.connect(pthread.quit)
        pthread.finished.connect(self._on_profile_thread_finished)  # first: queued before the deletions
        pthread.finished.connect(worker.deleteLater)
        pthread.finished.connect(pthread.deleteLater)

        sthread = QtCore.QThread()
        sthread.setObjectName("vramlab-sampler")
        sampler_worker.moveToThread(sthread)
        sthread.started.connect(sampler_worker.run)
        sampler_worker.sampled.connect(self._on_sample)
        sampler_worker.finished.connect(sthread.quit)
        sthread.finished.connect(self._on_sampler_thread_finished)
        sthread.finished.connect(sampler_worker.deleteLater)
        sthread.finished.connect(sthread.deleteLater)

        self._threads = {"profile": pthread, "sampler": sthread}
        self._profile_worker, self._sampler_worker = worker, sampler_worker
        self._request, self._outcome, self._cancelled = request, None, False
        GcPause.shared().acquire()
        sthread.start()
        pthread.start()
        self.runningChanged.emit(True)
        self.runStarted.emit(request)
        return True

    def cancel(self) -> None:
        """End the run now: the child process group is ended within 50 ms; the outcome is 'cancelled'."""
        if self._profile_worker is not None:
            self._cancelled = True
            self._profile_worker.abort()

    def shutdown(self, timeout_ms: int = 20000) -> bool:
        """Cancel, wait for both threads (window closing) and close the GPU sampler. True when no thread
        is left running."""
        threads = dict(self._threads)
        if self._profile_worker is not None:
            self._profile_worker.abort()
        if self._sampler_worker is not None:
            self._sampler_worker.stop()
        done = True
        for thread in threads.values():
            thread.quit()  # honoured once the worker's loop returns (exec() sees the earlier exit)
            done = thread.wait(timeout_ms) and done
        QtCore.QCoreApplication.sendPostedEvents(None, 0)  # the workers' last signals and `finished`
        for name in list(self._threads):
            if done:
                self._thread_ended(name)
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
    def _on_child_started(self, started: Any) -> None:
        self.childStarted.emit(started)

    @QtCore.Slot(object)
    def _on_phase(self, mark: Any) -> None:
        self.phase.emit(mark)

    @QtCore.Slot(object)
    def _on_memory(self, reading: Any) -> None:
        self.memory.emit(reading)

    @QtCore.Slot(object)
    def _on_sample(self, sample: Any) -> None:
        self.sample.emit(sample)

    @QtCore.Slot(object)
    def _on_finished(self, outcome: Any) -> None:
        self._outcome = outcome
        if self._sampler_worker is not None:
            self._sampler_worker.stop()

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
        self._outcome = ProfileOutcome(False, "cancelled" if self._cancelled else "error", text, device)
        if self._sampler_worker is not None:
            self._sampler_worker.stop()

    @QtCore.Slot()
    def _on_profile_thread_finished(self) -> None:
        self._thread_ended("profile")

    @QtCore.Slot()
    def _on_sampler_thread_finished(self) -> None:
        self._thread_ended("sampler")

    def _thread_ended(self, name: str) -> None:
        thread = self._threads.pop(name, None)
        if thread is None:
            return
        if shiboken6.isValid(thread):
            thread.wait()  # `finished` is emitted just before the thread ends: let it end
        if name == "profile":
            self._profile_worker = None
            if self._sampler_worker is not None:  # e.g. the worker was deleted without its signals
                self._sampler_worker.stop()
        else:
            self._sampler_worker = None
        if self._threads:
            return
        GcPause.shared().release()
        request = self._request
        outcome = self._outcome or ProfileOutcome(
            False, "cancelled" if self._cancelled else "error",
            "cancelled by the user" if self._cancelled else "the run ended without a result",
            request.device if request else "?")
        self._request, self._outcome = None, None
        self.runningChanged.emit(False)
        self.finished.emit(outcome)
