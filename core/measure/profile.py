"""`vramlab profile`: real training steps on this machine's GPU (or CPU), measured.

The run happens in a child process (:mod:`.child`) so that running out of memory, a driver fault or a
hang is a result the caller can show, never a crash, and the GPU memory is returned when the child
exits. The caller streams the child's phase events and, on CUDA, samples NVML at a fixed interval for
the device-used level (the whole GPU as ``nvidia-smi`` shows it, and this run's own process share).

On CUDA the allocator's own counters give the tensor and reserved levels per phase
(``max_memory_allocated`` / ``max_memory_reserved``, reset at every phase boundary); the run is not
traced by the dispatch tracker unless asked (tracing changes how torch accumulates gradients, see
``estimator.engine``). On the CPU the tracker is the measurement.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..kinds import Kind
from ..result import AliveTensor, Level, MemLevel, MemoryResult, Overhead, PhasePeak
from ..spec import GpuSpec, ModelSpec, SetupError, TrainingSetup
from ..units import Unit, fmt_bytes
from .processes import end_tree, popen_isolated

EventCallback = Callable[[dict[str, Any]], None]


@dataclass
class ProfileOutcome:
    """What a profile run produced: a result, or a failure with the phase and memory where it happened."""

    ok: bool
    kind: str  # ok | oom | error | crashed | timeout | cancelled | no_gpu
    message: str
    device: str
    result: MemoryResult | None = None
    info: dict[str, Any] = field(default_factory=dict)
    failed_phase: str | None = None
    memory_at_failure: int | None = None
    device_used_peak_bytes: int | None = None
    process_used_peak_bytes: int | None = None
    context_bytes: int | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object: the measured result's keys of the CLI contract (``peak_allocated_bytes``,
        ``components``, ``phases``, ... as ``estimate`` prints them; absent when the run failed) and beside
        them what only a profile has: the outcome, NVML readings, the CUDA context, speed, environment."""
        out: dict[str, Any] = self.result.to_json() if self.result is not None else {}
        out |= {
            "ok": self.ok, "kind": self.kind, "message": self.message, "device": self.device,
            "failed_phase": self.failed_phase, "memory_at_failure_bytes": self.memory_at_failure,
            "device_used_peak_bytes": self.device_used_peak_bytes,
            "process_used_peak_bytes": self.process_used_peak_bytes, "context_bytes": self.context_bytes,
            "tokens_per_s": self.tokens_per_s, "step_time_s": self.step_time_s, "environment": self.info,
        }
        return out

    def render(self, unit: str = "GiB") -> str:
        u = Unit(unit)
        if not self.ok:
            where = f" in {self.failed_phase}" if self.failed_phase else ""
            mem = f" with {fmt_bytes(self.memory_at_failure, u)} allocated" if self.memory_at_failure else ""
            return f"profile on {self.device}: {self.kind}{where}{mem}: {self.message}"
        from ..cli import render_table

        lines = [render_table(self.result, unit)]
        if self.context_bytes is not None:
            lines.append(f"Measured CUDA context: {fmt_bytes(self.context_bytes, u)}")
        if self.device_used_peak_bytes is not None:
            lines.append(f"NVML device used at peak: {fmt_bytes(self.device_used_peak_bytes, u)}")
        if self.tokens_per_s:
            lines.append(f"Step time {self.step_time_s:.3f} s, {self.tokens_per_s:,.0f} tokens/s")
        return "\n".join(lines)


def child_command() -> list[str]:
    """How to start the child: the frozen app runs itself with a hidden flag."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "--profile-child"]
    return [sys.executable, "-m", "vramlab.core.measure.child"]


def profile(
    spec: ModelSpec,
    setup: TrainingSetup,
    device: str = "cuda",
    gpu: GpuSpec | None = None,
    steps: int = 2,
    snapshot: str | None = None,
    isolate: bool = True,
    timeout_s: float = 1800.0,
    on_event: EventCallback | None = None,
    should_abort: Callable[[], bool] | None = None,
    fault: str | None = None,
    tracked: bool = False,
    sampler: Any = None,
    launcher: str = "auto",
) -> ProfileOutcome:
    """Run ``steps`` real training steps; returns a :class:`ProfileOutcome` (never raises for a failed
    run). ``on_event`` first gets ``{"event": "started", "pid": ...}`` (the child's process id), then every
    line the child prints (see :mod:`.child`), on a reader thread. ``should_abort`` is polled; ``sampler``
    is a GpuSampler used for NVML readings (a real NvmlSampler by default on CUDA). With ``setup.gpus > 1``
    ``launcher`` chooses: ``auto`` runs one process per GPU under torchrun (:mod:`.distributed`, a
    :class:`~.distributed.DistributedOutcome`) when the setup can run so, else rank 0 emulated in one
    process; ``torchrun`` insists (SetupError when it cannot); ``emulate`` never launches."""
    setup.validate(spec)
    if device == "cpu":
        check_host_memory(spec, setup)
    emulated = None  # why a sharded setup runs as rank 0 emulated in one process
    if launcher != "emulate" and setup.gpus > 1:
        # several GPUs: one real process per GPU under torchrun (see .distributed) where the setup can run
        # faithfully; otherwise ("emulate", or a refusal under "auto") rank 0 emulated in one process
        from .distributed import launch_refusal, profile_distributed

        emulated = None if launcher == "torchrun" else launch_refusal(spec, setup, device)
        if emulated is None:
            return profile_distributed(spec, setup, device=device, gpu=gpu, steps=steps, timeout_s=timeout_s,
                                       on_event=on_event, should_abort=should_abort, fault=fault,
                                       tracked=tracked, sampler=sampler)
    elif setup.gpus > 1:
        emulated = "the emulated launcher was asked for"
    outcome = _one_process(spec, setup, device, gpu, steps, snapshot, isolate, timeout_s, on_event, should_abort,
                           fault, tracked, sampler)
    if emulated is not None:
        outcome = dataclasses.replace(outcome, info={**outcome.info, "emulated_rank0": emulated})
    return outcome


HOST_PROCESS_BYTES = 768 * 2**20  # torch imported in a process, before any tensor
HOST_SHARE = 0.8  # of the memory available now: the desktop and the caller keep the rest


def check_host_memory(spec: ModelSpec, setup: TrainingSetup, available: int | None = None) -> None:
    """A CPU profile allocates every tensor for real: refuse (SetupError) before starting when the estimate
    of its tensors, per process, does not fit the host's available memory, instead of swapping the machine
    to a halt or being killed by the OOM killer halfway."""
    from ..estimate import estimate

    ranks = setup.gpus if setup.gpus > 1 else 1  # torchrun on the CPU: every rank on this host
    need = ranks * (estimate(spec, setup, match_simulation=True).peak_allocated_bytes + HOST_PROCESS_BYTES)
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    if need > HOST_SHARE * available:
        raise SetupError(f"a CPU profile of this setup allocates about {fmt_bytes(need)} for real and this machine "
                         f"has {fmt_bytes(available)} available: choose a smaller model, batch or sequence, or "
                         "use `vramlab simulate` (the same step on fake tensors, no memory)")


def _one_process(spec: ModelSpec, setup: TrainingSetup, device: str, gpu: GpuSpec | None, steps: int,
                 snapshot: str | None, isolate: bool, timeout_s: float, on_event: EventCallback | None,
                 should_abort: Callable[[], bool] | None, fault: str | None, tracked: bool,
                 sampler: Any) -> ProfileOutcome:
    """The profile in one process: the child, its events, and the outcome (rank 0 of a sharded setup)."""
    request = {"spec": spec.to_dict(), "setup": setup.to_dict(), "device": device, "steps": steps,
               "snapshot": snapshot, "fault": fault, "tracked": tracked}
    if not isolate:
        return _in_process(spec, setup, device, gpu, request, on_event)
    nvml = _NvmlWatch(sampler) if device == "cuda" else None
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = popen_isolated(child_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env)
    try:
        return _watch_child(proc, spec, setup, device, gpu, request, timeout_s, on_event, should_abort, nvml)
    finally:  # an exception, Ctrl-C or SIGTERM in the caller (see stop_signals_raise): leave nothing behind
        if proc.poll() is None:
            terminate(proc)
        if nvml is not None:
            nvml.stop()


def _watch_child(proc: subprocess.Popen, spec: ModelSpec, setup: TrainingSetup, device: str, gpu: GpuSpec | None,
                 request: dict[str, Any], timeout_s: float, on_event: EventCallback | None,
                 should_abort: Callable[[], bool] | None, nvml: _NvmlWatch | None) -> ProfileOutcome:
    if nvml is not None:
        nvml.start(proc.pid)
    if on_event is not None:  # not from the child: lets a caller watch the process (RSS, NVML share)
        on_event({"event": "started", "pid": proc.pid})
    lines: list[dict[str, Any]] = []
    reader_done = threading.Event()
    stderr_tail: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            raw = line.strip()
            if not raw.startswith("{"):
                continue
            try:
                msg = json.loads(raw)
            except json.JSONDecodeError:
                continue
            lines.append(msg)
            if nvml is not None:
                nvml.on_event(msg)
            if on_event is not None:
                on_event(msg)
        reader_done.set()

    def read_err() -> None:
        for raw in proc.stderr:  # type: ignore[union-attr]
            stderr_tail.append(raw.rstrip())
            del stderr_tail[:-20]

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=read_err, daemon=True).start()
    proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    t0 = time.monotonic()
    outcome_kind = None
    while proc.poll() is None:
        if should_abort is not None and should_abort():
            outcome_kind = "cancelled"
            break
        if time.monotonic() - t0 > timeout_s:
            outcome_kind = "timeout"
            break
        time.sleep(0.05)
    if outcome_kind is not None:
        terminate(proc)
    proc.wait()
    reader_done.wait(timeout=5)
    watch = nvml.stop() if nvml is not None else {}
    final = next((m for m in reversed(lines) if m.get("event") in ("result", "failure")), None)
    if outcome_kind == "cancelled":
        return ProfileOutcome(False, "cancelled", "cancelled by the user", device, events=lines, **watch)
    if outcome_kind == "timeout":
        last = next((m["key"] for m in reversed(lines) if m.get("event") == "phase"), None)
        return ProfileOutcome(False, "timeout", f"no result after {timeout_s:.0f} s; the run was ended",
                              device, failed_phase=last, events=lines, **watch)
    if final is None:
        last = next((m["key"] for m in reversed(lines) if m.get("event") == "phase"), None)
        err = stderr_tail[-1] if stderr_tail else ""
        return ProfileOutcome(False, "crashed", f"the run ended with exit code {proc.returncode} {err}".strip(),
                              device, failed_phase=last, events=lines, **watch)
    return _outcome(spec, setup, device, gpu, final, lines, watch)


def terminate(proc: subprocess.Popen) -> None:
    """End the child and everything it started, on POSIX and Windows (see :func:`.processes.end_tree`)."""
    end_tree(proc)


def _in_process(spec: ModelSpec, setup: TrainingSetup, device: str, gpu: GpuSpec | None,
                request: dict[str, Any], on_event: EventCallback | None) -> ProfileOutcome:
    import contextlib
    import io

    from . import child

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        child.run(request, request.get("fault"))
    lines = [json.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
    if on_event is not None:
        for m in lines:
            on_event(m)
    final = next(m for m in reversed(lines) if m.get("event") in ("result", "failure"))
    return _outcome(spec, setup, device, gpu, final, lines, {})


def _outcome(spec: ModelSpec, setup: TrainingSetup, device: str, gpu: GpuSpec | None, final: dict[str, Any],
             lines: list[dict[str, Any]], watch: dict[str, Any]) -> ProfileOutcome:
    if final["event"] == "failure":
        return ProfileOutcome(False, final.get("kind", "error"), final.get("message", ""), device,
                              info=final.get("info", {}), failed_phase=final.get("phase"),
                              memory_at_failure=final.get("allocated_at_failure"), events=lines, **watch)
    info = final.get("info", {})
    tracked = final.get("tracked")
    phases_raw = final.get("phases") or {}
    if device == "cuda":
        phases = tuple(PhasePeak(k, int(v["allocated"]), {}) for k, v in phases_raw.items())
    else:
        phases = tuple(PhasePeak(k, int(v), {Kind(kk): vv for kk, vv in tracked["phase_kinds"].get(k, {}).items()})
                       for k, v in tracked["phases"].items())
    components: dict[Kind, int] = {}
    alive: tuple[AliveTensor, ...] = ()
    if tracked:
        components = {Kind(k): int(v) for k, v in tracked["kinds"].items()}
        alive = tuple(AliveTensor(t[0], Kind(t[1]), t[2], tuple(t[3]), t[4], t[5]) for t in tracked["top"])
    peak = int(final["peak_allocated_bytes"])
    reserved = int(final["peak_reserved_bytes"])
    peak_phase = max(phases, key=lambda p: p.bytes).key if phases else "load"
    overheads: list[Overhead] = []
    device_used = reserved
    context = watch.get("context_bytes")
    if context is not None:
        overheads.append(Overhead("CUDA context (measured)", context, MemLevel.DEVICE, "NVML: the run's own memory "
                                  "at its first phase boundary, less what its allocator had reserved then."))
    if watch.get("process_used_peak_bytes"):
        device_used = int(watch["process_used_peak_bytes"])
    elif device != "cuda" and final.get("max_rss_bytes"):
        overheads.append(Overhead("Process resident memory (RSS)", int(final["max_rss_bytes"]), MemLevel.DEVICE,
                                  "No GPU: the run's peak resident memory on the CPU."))
    notes = [f"measured on {info.get('gpu', device)}"]
    if device == "cuda" and not watch.get("process_used_peak_bytes"):
        notes.append("NVML listed no per-process memory for the run: the device level shown is the allocator's "
                     "reserved level")
    timing = final.get("timing", {})
    step_time = sum(v for k, v in timing.items() if k.endswith("@2"))
    tokens = setup.micro_batch * setup.seq_len * setup.grad_accum
    result = MemoryResult(
        level=Level.PROFILE, model=spec, setup=setup, peak_allocated_bytes=peak, peak_reserved_bytes=reserved,
        device_used_bytes=device_used, components=components or {Kind.TEMPORARIES: 0}, peak_phase=peak_phase,
        phases=phases, total_params=int(final.get("total_params", 0)),
        trainable_params=int(final.get("trainable_params", 0)), overheads=tuple(overheads),
        warnings=tuple(setup.warnings(spec)), alive_at_peak=alive, gpu=gpu, timing=timing,
        notes=tuple(notes),
    )
    return ProfileOutcome(True, "ok", "", device, result=result, info=info, events=lines,
                          step_time_s=step_time or None, tokens_per_s=(tokens / step_time) if step_time else None,
                          **watch)


class _NvmlWatch:
    """Samples NVML in the caller while the child runs, on the GPU the child uses (CUDA device 0 of the
    visible ones, matched to NVML by UUID): that GPU's peak "used" (every process, as nvidia-smi shows it),
    the child's own peak, and the CUDA context: the child's NVML usage less what its allocator had reserved
    at its first phase boundary ('load', right after it created the context and before the model)."""

    def __init__(self, sampler: Any = None, interval_s: float = 0.05) -> None:
        self.sampler = sampler
        self.interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.device_peak: int | None = None
        self.process_peak: int | None = None
        self.context: int | None = None
        self.index: int | None = None
        self.pid = 0

    def start(self, pid: int) -> None:
        if self.sampler is None:
            from ..monitor import NvmlSampler

            self.sampler = NvmlSampler()
        if not self.sampler.available():
            return
        from ..monitor import visible_devices

        try:
            devices = visible_devices(self.sampler)
        except Exception:  # noqa: BLE001 - NVML trouble: no readings rather than a failed run
            return
        first = next((d for d in devices if d.index == 0), devices[0] if devices else None)
        if first is None:
            return
        self.index = first.nvml_index
        self.pid = pid
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _read(self) -> int | None:
        """One reading of the run's GPU; returns the child's own usage (None when NVML does not list it)."""
        if self.index is None:
            return None
        reading = self.sampler.sample([self.index]).get(self.index)
        if reading is None or reading.lost:
            return None
        with self._lock:
            if reading.memory_used_bytes is not None:
                self.device_peak = max(self.device_peak or 0, reading.memory_used_bytes)
            proc = reading.process(self.pid)
            if proc is not None and proc.used_bytes:
                self.process_peak = max(self.process_peak or 0, proc.used_bytes)
                return proc.used_bytes
        return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._read()
            except Exception:  # noqa: BLE001 - the sampler should not raise; a reading is not worth a crash
                pass
            self._stop.wait(self.interval)

    def on_event(self, event: dict[str, Any]) -> None:
        """The child's events (on the reader thread): its first phase boundary fixes the context."""
        if self.context is not None or event.get("event") != "phase" or event.get("key") != "load":
            return
        try:
            used = self._read()
        except Exception:  # noqa: BLE001
            used = None
        if used is not None:
            self.context = max(0, used - int(event.get("reserved") or 0))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        return {"device_used_peak_bytes": self.device_peak, "process_used_peak_bytes": self.process_peak,
                "context_bytes": self.context}
