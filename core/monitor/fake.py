"""A deterministic GPU sampler for tests, demos and machines without a GPU.

:class:`FakeSampler` implements the ``GpuSampler`` protocol with synthetic readings and named fault
scenarios, each named after the real-world failure it reproduces (see :class:`Scenario`).

Memory model of one fake GPU, in bytes::

    used = context_bytes + our allocation + other processes      (clipped to memory_total_bytes)

"Our" process (``pid``, default ``os.getpid()``) always holds a CUDA context of ``context_bytes``;
its allocation is driven by :meth:`FakeSampler.set_allocated` or by a callback
(:meth:`FakeSampler.set_allocation_source`) that is asked on every sample. Utilisation, power,
temperature and clocks follow from the allocation, so a demo looks alive when memory is in use.
Timestamps come from ``clock`` (``time.monotonic`` unless a test passes its own).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum

from vramlab.core.monitor.nvml import NO_DRIVER_REASON
from vramlab.core.monitor.types import (
    GpuInfo,
    GpuReading,
    ProcessMemory,
    Sample,
    Unavailable,
)

MiB = 1024**2

RTX_4090_NAME = "NVIDIA GeForce RTX 4090"
RTX_4090_MEMORY_BYTES = 24564 * MiB  # what NVML reports as total for a 24 GB RTX 4090

OTHER_PID = 4242
OTHER_PROCESS_NAME = "other_training_job"
OLD_DRIVER_VERSION = "470.57.02"
HOST_PID_OFFSET = 100_000  # Scenario.PID_NAMESPACE: the host's number for our process


class Scenario(StrEnum):
    """Named situations the fake reproduces. Scenarios combine (pass several)."""

    HEALTHY = "healthy"
    """Everything reported, every sample."""

    NO_DRIVER = "no_driver"
    """A laptop or CI runner without an NVIDIA driver: nvmlInit fails with LibraryNotFound, so
    ``available()`` is False with a reason, ``devices()`` is empty and samples have no readings."""

    GPU_LOST_MID_RUN = "gpu_lost_mid_run"
    """The GPU falls off the bus (Xid 79) during a run: after ``lost_after_samples`` samples the
    ``fault_index`` GPU reads as ``lost`` with every live field None; other GPUs keep working."""

    FIELD_NOT_SUPPORTED = "field_not_supported"
    """Old or consumer cards that answer NOT_SUPPORTED for power and temperature: ``power_mw``,
    ``power_limit_mw`` and ``temperature_c`` are None and listed in ``missing``; memory is intact."""

    OTHER_PROCESS_ALLOCATING = "other_process_allocating"
    """Someone else's job shares the GPU: pid ``OTHER_PID`` grows by ``ramp_bytes_per_sample`` every
    sample on the ``fault_index`` GPU, so device-level "used" rises although our allocation does not."""

    OLD_DRIVER = "old_driver"
    """A driver older than R510: no ``nvmlDeviceGetComputeRunningProcesses_v3`` and no memory info v2,
    so ``processes`` and ``memory_reserved_bytes`` are missing."""

    PID_NAMESPACE = "pid_namespace"
    """Inside Docker or Kubernetes the process sees its own PID namespace while NVML lists processes by their
    host PIDs: our process is listed, but under ``pid + HOST_PID_OFFSET``, so matching by PID finds nothing
    (the device's "used" is intact)."""

    NVML_ERROR_TRANSIENT = "nvml_error_transient"
    """One NVML call fails with an unknown error once: sample number ``transient_at_sample``
    (0-based) of the ``fault_index`` GPU lacks utilisation, power, temperature and clocks; memory
    survives and the next sample is complete again."""


class _FakeNvmlError(Exception):
    """Raised inside the fake where the real driver would return an error code."""

    def __init__(self, kind: Unavailable, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def fake_gpu(
    index: int = 0,
    *,
    name: str = RTX_4090_NAME,
    memory_total_bytes: int = RTX_4090_MEMORY_BYTES,
    uuid: str | None = None,
    driver_version: str = "550.54.14",
    cuda_driver_version: str = "12.4",
    compute_capability: tuple[int, int] = (8, 9),
    pci_bus_id: str | None = None,
    mig_uuids: tuple[str, ...] = (),
) -> GpuInfo:
    """Static info for one fake GPU; defaults describe an RTX 4090 with a deterministic UUID."""
    return GpuInfo(
        index=index,
        nvml_index=index,
        name=name,
        uuid=uuid or f"GPU-f4e5a000-0000-4000-8000-{index:012d}",
        memory_total_bytes=memory_total_bytes,
        driver_version=driver_version,
        cuda_driver_version=cuda_driver_version,
        compute_capability=compute_capability,
        pci_bus_id=pci_bus_id or f"00000000:{index + 1:02X}:00.0",
        mig_uuids=mig_uuids,
    )


class FakeSampler:
    """A ``GpuSampler`` with synthetic, deterministic readings and named fault scenarios.

    ``gpus`` defaults to one RTX 4090 (24564 MiB). ``sample()`` calls are counted from 0 per sampler;
    scenarios that depend on time use that count. Thread-safe.
    """

    def __init__(
        self,
        gpus: Sequence[GpuInfo] | None = None,
        scenario: Scenario | Iterable[Scenario] = Scenario.HEALTHY,
        *,
        context_bytes: int = 512 * MiB,
        lost_after_samples: int = 5,
        transient_at_sample: int = 3,
        ramp_bytes_per_sample: int = 256 * MiB,
        fault_index: int = 0,
        pid: int | None = None,
        power_limit_mw: int = 450_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scenarios: frozenset[Scenario] = (
            frozenset({Scenario(scenario)}) if isinstance(scenario, str) else frozenset(scenario)
        )
        gpus = list(gpus) if gpus is not None else [fake_gpu(0)]
        if Scenario.OLD_DRIVER in self.scenarios:
            gpus = [_replace_driver(g) for g in gpus]
        self._gpus = gpus
        self.context_bytes = context_bytes
        self.lost_after_samples = lost_after_samples
        self.transient_at_sample = transient_at_sample
        self.ramp_bytes_per_sample = ramp_bytes_per_sample
        self.fault_index = fault_index
        self.pid = os.getpid() if pid is None else pid
        self.power_limit_mw = power_limit_mw
        self._clock = clock
        self._lock = threading.RLock()  # re-entrant: an allocation callback may call set_allocated
        self._allocated: dict[int, int] = {}
        self._source: Callable[[int], int] | None = None
        self._samples_taken = 0
        self._closed = False

    # -- driving the fake -----------------------------------------------------------------------------
    def set_allocated(self, nbytes: int, index: int | None = None) -> None:
        """Set "our" process's allocation on GPU ``index`` (NVML index; None: every GPU)."""
        if nbytes < 0:
            raise ValueError(f"allocation must be >= 0 bytes, got {nbytes}")
        with self._lock:
            for gpu in self._gpus:
                if index is None or gpu.nvml_index == index:
                    self._allocated[gpu.nvml_index] = int(nbytes)

    def set_allocation_source(self, source: Callable[[int], int] | None) -> None:
        """Ask ``source(nvml_index) -> bytes`` for our allocation on every sample (None: stop)."""
        with self._lock:
            self._source = source

    @property
    def samples_taken(self) -> int:
        with self._lock:
            return self._samples_taken

    # -- the protocol ---------------------------------------------------------------------------------
    def available(self) -> bool:
        return not self._closed and Scenario.NO_DRIVER not in self.scenarios and bool(self._gpus)

    def reason(self) -> str:
        if self._closed:
            return "the GPU sampler is closed"
        if Scenario.NO_DRIVER in self.scenarios:
            return NO_DRIVER_REASON
        if not self._gpus:
            return "the NVIDIA driver reports no GPU"
        return ""

    def devices(self) -> list[GpuInfo]:
        return list(self._gpus) if self.available() else []

    def sample(self, indices: Sequence[int] | None = None) -> Sample:
        with self._lock:
            now = self._clock()
            if not self.available():
                return Sample(now, ())
            n = self._samples_taken
            self._samples_taken += 1
            wanted = [g.nvml_index for g in self._gpus] if indices is None else list(indices)
            by_index = {g.nvml_index: g for g in self._gpus}
            readings = tuple(self._reading(by_index[i], n, now) for i in wanted if i in by_index)
            return Sample(now, readings)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def __enter__(self) -> FakeSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- synthesis ------------------------------------------------------------------------------------
    def _our_allocation(self, index: int) -> int:
        if self._source is not None:
            return max(0, int(self._source(index)))
        return self._allocated.get(index, 0)

    def _query(self, values: dict[str, int | None], field: str, read: Callable[[], int]) -> None:
        """The fake's choke point: a fake driver error leaves the field None, never loses the sample."""
        try:
            values[field] = read()
        except _FakeNvmlError:
            values[field] = None

    def _reading(self, gpu: GpuInfo, n: int, now: float) -> GpuReading:
        faulty = gpu.nvml_index == self.fault_index
        has = self.scenarios.__contains__
        if has(Scenario.GPU_LOST_MID_RUN) and faulty and n >= self.lost_after_samples:
            return GpuReading.build(
                index=gpu.nvml_index, uuid=gpu.uuid, name=gpu.name, timestamp_s=now, lost=True
            )

        total = gpu.memory_total_bytes or 0
        ours = self._our_allocation(gpu.nvml_index)
        listed_pid = self.pid + HOST_PID_OFFSET if has(Scenario.PID_NAMESPACE) else self.pid
        processes = [ProcessMemory(listed_pid, self.context_bytes + ours, "python")]
        if has(Scenario.OTHER_PROCESS_ALLOCATING) and faulty:
            room = max(0, total - self.context_bytes - ours)
            other = min(self.ramp_bytes_per_sample * (n + 1), room)
            processes.append(ProcessMemory(OTHER_PID, other, OTHER_PROCESS_NAME))
        used = min(total, sum(p.used_bytes or 0 for p in processes))

        busy = ours > 0 or len(processes) > 1
        util = 90 + (n % 10) if busy else 0
        transient = has(Scenario.NVML_ERROR_TRANSIENT) and faulty and n == self.transient_at_sample
        unsupported = has(Scenario.FIELD_NOT_SUPPORTED)

        def live(value: int) -> Callable[[], int]:
            def read() -> int:
                if transient:
                    raise _FakeNvmlError(Unavailable.ERROR, "Unknown Error")
                return value

            return read

        def powered(value: int) -> Callable[[], int]:
            def read() -> int:
                if unsupported:
                    raise _FakeNvmlError(Unavailable.NOT_SUPPORTED, "Not Supported")
                return live(value)()

            return read

        values: dict[str, int | None] = {
            "memory_used_bytes": used,
            "memory_total_bytes": total,
            "memory_reserved_bytes": None if has(Scenario.OLD_DRIVER) else min(512 * MiB, total // 48),
        }
        idle_power_mw = 30_000
        power_mw = idle_power_mw + util * (self.power_limit_mw - idle_power_mw) // 100
        self._query(values, "utilization_gpu_pct", live(util))
        self._query(values, "utilization_mem_pct", live(used * 100 // total if total and busy else 0))
        self._query(values, "power_mw", powered(power_mw))
        self._query(values, "power_limit_mw", powered(self.power_limit_mw))
        self._query(values, "temperature_c", powered(35 + util * 40 // 100))
        self._query(values, "sm_clock_mhz", live(2520 if busy else 210))
        self._query(values, "mem_clock_mhz", live(10501 if busy else 405))
        return GpuReading.build(
            index=gpu.nvml_index,
            uuid=gpu.uuid,
            name=gpu.name,
            timestamp_s=now,
            processes=None if has(Scenario.OLD_DRIVER) else tuple(processes),
            **values,
        )


def _replace_driver(gpu: GpuInfo) -> GpuInfo:
    return dataclasses.replace(gpu, driver_version=OLD_DRIVER_VERSION, cuda_driver_version="11.4")
