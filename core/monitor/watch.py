"""The one NVML watcher of a profile run: the run's GPUs only, its processes, and its CUDA context.

A profile run (one child process, or one rank process per GPU) is watched by exactly one
:class:`RunWatch`. Whoever owns the run drives it: ``vramlab profile`` lets it start its own 20 Hz thread
(:meth:`RunWatch.start`); the window's sampler thread calls :meth:`RunWatch.read` on its own beat and
shows each sample, so that one loop polls NVML, never two. What the watch keeps:

- the peak "used" of each GPU the run uses (every process on that GPU, as ``nvidia-smi`` shows it), and
  never of other GPUs on the machine;
- the peak NVML memory of each watched process (a rank, or the single child: key 0);
- the CUDA context of each process, read by :meth:`RunWatch.settle` while the process waits for it at the
  end of its run (nothing else moves then): its NVML memory less its allocator's ``memory_reserved()``;
- each GPU's "used" before the run (:meth:`RunWatch.mark_baseline`, else its first reading). Inside a
  container (Docker, Kubernetes) NVML lists processes by their host PIDs, so matching the run's PID finds
  nothing: the run's memory is then the whole GPU's used less that baseline (``device_delta_peak_bytes``),
  and its context the same delta less its reserved bytes at the settle (``context_source`` says which).

Which NVML device a process uses comes from :func:`~.detect.cuda_devices` (CUDA ordinal → NVML device
by UUID, ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` honoured). Where NVML alone cannot know CUDA's
order (mixed GPU models under the default FASTEST_FIRST order), the watch does not attribute readings
until the run reports its GPU's UUID (:meth:`RunWatch.set_uuid`).

A reading that raises (samplers should not, but a driver can surprise) is counted and logged once; the
loop carries on. Pure Python: no torch, no Qt.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from vramlab.core.monitor.detect import cuda_devices, same_uuid
from vramlab.core.monitor.types import GpuInfo, GpuSampler, Sample

log = logging.getLogger(__name__)

INTERVAL_S = 0.05  # 20 Hz


class RunWatch:
    """NVML readings of one run. ``cuda_indices`` are the CUDA ordinals the run uses (rank r on ``cuda:r``
    for a sharded run); ``sampler`` is a GpuSampler (an :class:`~.nvml.NvmlSampler` when None, closed by
    :meth:`stop`). Thread-safe: :meth:`read`, :meth:`settle` and :meth:`watch` may come from any thread."""

    def __init__(self, sampler: GpuSampler | None = None, cuda_indices: Iterable[int] = (0,),
                 interval_s: float = INTERVAL_S, environ: Mapping[str, str] | None = None,
                 on_sample: Callable[[Sample], None] | None = None) -> None:
        self._own = sampler is None
        self.sampler = sampler
        self.cuda_indices = tuple(cuda_indices)
        self.interval = interval_s
        self._environ = environ
        self._on_sample = on_sample
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._resolved = False
        self.devices: dict[int, GpuInfo] = {}  # CUDA ordinal -> NVML device (once certain)
        self.certain = True
        self._visible: list[GpuInfo] = []
        self.pids: dict[int, int] = {}  # key (rank; 0 for a single process) -> pid
        self.device_peak: dict[int, int] = {}  # CUDA ordinal -> peak used of that GPU
        self.process_peak: dict[int, int] = {}
        self.context: dict[int, int] = {}
        self.context_source: dict[int, str] = {}  # "process" (matched by PID) or "whole-GPU delta"
        self.baseline: dict[int, int] = {}  # CUDA ordinal -> used before the run
        self.errors = 0
        self.last_error = ""
        self.last_sample: Sample | None = None

    # -- which GPUs ------------------------------------------------------------------------------------
    def _resolve(self) -> None:
        if self._resolved:
            return
        self._resolved = True
        if self.sampler is None:
            from vramlab.core.monitor.nvml import NvmlSampler

            self.sampler = NvmlSampler()
        visible, self.certain = cuda_devices(self.sampler, self._environ)
        if self.certain:
            self.devices = {d.index: d for d in visible if d.index in self.cuda_indices}
        self._visible = visible

    def available(self) -> bool:
        """True when NVML answers and at least one of the run's GPUs is known (or awaits the run's UUID)."""
        with self._lock:
            self._resolve()
            return bool(self.devices) or (not self.certain and bool(self._visible))

    def nvml_index(self, cuda_index: int = 0) -> int | None:
        with self._lock:
            self._resolve()
            d = self.devices.get(cuda_index)
            return d.nvml_index if d is not None else None

    def set_uuid(self, cuda_index: int, uuid: str) -> None:
        """The run's own word on which GPU ``cuda:<cuda_index>`` is (``torch.cuda.get_device_properties``):
        it replaces the NVML-order mapping."""
        with self._lock:
            self._resolve()
            match = next((d for d in self._visible if same_uuid(d.uuid, uuid)), None)
            if match is None and self.sampler is not None:
                match = next((d.with_cuda_index(cuda_index) for d in self.sampler.devices()
                              if same_uuid(d.uuid, uuid) or any(same_uuid(m, uuid) for m in d.mig_uuids)), None)
            if match is not None:
                self.devices[cuda_index] = match.with_cuda_index(cuda_index)

    def watch(self, key: int, pid: int) -> None:
        """Follow process ``pid`` as ``key`` (its rank; 0 for a single process)."""
        with self._lock:
            self.pids[key] = int(pid)

    # -- readings --------------------------------------------------------------------------------------
    def read(self) -> Sample | None:
        """One reading of the run's GPUs (None before any is known); updates the peaks. Never raises."""
        with self._lock:
            self._resolve()
            by_nvml = {d.nvml_index: cuda for cuda, d in self.devices.items()}
            pids = dict(self.pids)
        if not by_nvml:
            return None
        try:
            sample = self.sampler.sample(sorted(by_nvml))  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - one failed reading is not the end of the watch
            self._failed(e)
            return None
        with self._lock:
            for reading in sample.readings:
                cuda = by_nvml.get(reading.index)
                if cuda is None or reading.lost:
                    continue
                if reading.memory_used_bytes is not None:
                    self.baseline.setdefault(cuda, reading.memory_used_bytes)
                    self.device_peak[cuda] = max(self.device_peak.get(cuda, 0), reading.memory_used_bytes)
                for key, pid in pids.items():
                    p = reading.process(pid)
                    if p is not None and p.used_bytes:
                        self.process_peak[key] = max(self.process_peak.get(key, 0), p.used_bytes)
            self.last_sample = sample
        return sample

    def mark_baseline(self) -> None:
        """Read each GPU's "used" now, before the run starts: what a whole-GPU delta is measured from."""
        with self._lock:
            self.baseline.clear()
        self.read()

    def whole_gpu_delta(self, cuda_index: int) -> int | None:
        """The GPU's used now less its baseline (a fresh reading; None without either)."""
        sample = self.read()
        with self._lock:
            device = self.devices.get(cuda_index)
            base = self.baseline.get(cuda_index)
        if sample is None or device is None or base is None:
            return None
        reading = sample.get(device.nvml_index)
        if reading is None or reading.lost or reading.memory_used_bytes is None:
            return None
        return max(0, reading.memory_used_bytes - base)

    def _failed(self, e: BaseException) -> None:
        with self._lock:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            first = self.errors == 1
        if first:
            log.warning("GPU reading failed (the watch carries on): %s", e)

    def process_used(self, key: int, cuda_index: int | None = None) -> int | None:
        """A fresh reading of process ``key``'s NVML memory on its GPU (None when NVML does not list it)."""
        sample = self.read()
        with self._lock:
            pid = self.pids.get(key)
            device = self.devices.get(key if cuda_index is None else cuda_index)
        if sample is None or pid is None or device is None:
            return None
        reading = sample.get(device.nvml_index)
        proc = reading.process(pid) if reading is not None and not reading.lost else None
        return proc.used_bytes if proc is not None and proc.used_bytes else None

    def settle(self, key: int, reserved_bytes: int, cuda_index: int | None = None) -> int | None:
        """The CUDA context of process ``key``, read while it waits at the end of its run: its NVML memory
        less its allocator's reserved bytes (everything the allocator holds, cuBLAS workspaces included).
        Where NVML lists no process under its PID (a container's PID namespace), the whole GPU's used less its
        baseline stands for the process's memory. Returns it (None when neither is known)."""
        used = self.process_used(key, cuda_index)
        source = "process"
        if used is None:
            used = self.whole_gpu_delta(key if cuda_index is None else cuda_index)
            source = "whole-GPU delta"
        if used is None:
            return None
        ctx = max(0, used - int(reserved_bytes))
        with self._lock:
            self.context[key] = ctx
            self.context_source[key] = source
        return ctx

    # -- its own thread --------------------------------------------------------------------------------
    def start(self) -> bool:
        """Poll every ``interval_s`` on a thread of its own (False: NVML has nothing to watch)."""
        if not self.available():
            return False
        self._thread = threading.Thread(target=self._loop, name="vramlab-nvml-watch", daemon=True)
        self._thread.start()
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            sample = self.read()
            if sample is not None and self._on_sample is not None:
                try:
                    self._on_sample(sample)
                except Exception as e:  # noqa: BLE001 - a listener's fault is not the watch's end
                    self._failed(e)
            self._stop.wait(self.interval)

    def stop(self) -> dict[int, dict[str, Any]]:
        """End the thread (if any; the sampler is closed when the watch made it) and return, per watched
        key, the ProfileOutcome fields: ``device_used_peak_bytes`` (that key's GPU), ``process_used_peak_bytes``,
        ``device_delta_peak_bytes`` (that GPU's peak used less its baseline), ``context_bytes`` and
        ``context_source``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._own and self.sampler is not None:
            self.sampler.close()
        with self._lock:
            return {key: {"device_used_peak_bytes": self.device_peak.get(key),
                          "process_used_peak_bytes": self.process_peak.get(key),
                          "device_delta_peak_bytes": self._delta_peak(key),
                          "context_bytes": self.context.get(key),
                          "context_source": self.context_source.get(key)} for key in (self.pids or {0: 0})}

    def _delta_peak(self, cuda_index: int) -> int | None:
        peak, base = self.device_peak.get(cuda_index), self.baseline.get(cuda_index)
        return None if peak is None or base is None else max(0, peak - base)

    def gpu(self, cuda_index: int = 0) -> GpuInfo | None:
        with self._lock:
            self._resolve()
            return self.devices.get(cuda_index)
