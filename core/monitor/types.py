"""Typed records for GPU monitoring: what a sampler reports, and what it says when it cannot.

Everything here is a frozen dataclass (or an enum), so a reading can cross from a sampling thread to the
GUI thread as a snapshot. Units are in the field names: ``_bytes``, ``_mw`` (milliwatts, what NVML
reports), ``_c`` (degrees Celsius), ``_mhz``, ``_pct`` (0-100), ``_s`` (seconds on the
``time.monotonic`` clock).

One unsupported field never loses a sample (the gpustat rule): a field the device did not report is
``None`` and its name is in :attr:`GpuReading.missing`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable


class Unavailable(StrEnum):
    """Why a value (or the whole sampler) is not available. NVML's error codes, grouped."""

    NOT_SUPPORTED = "not_supported"  # the device or driver does not implement this query
    NO_PERMISSION = "no_permission"  # e.g. per-process info for other users' processes
    GPU_LOST = "gpu_lost"  # fell off the bus, needs a reset; the other GPUs keep working
    FUNCTION_NOT_FOUND = "function_not_found"  # the driver is older than this API (or pynvml lacks it)
    NOT_FOUND = "not_found"  # e.g. an empty MIG slot
    NO_LIBRARY = "no_library"  # libnvidia-ml.so / nvml.dll cannot be loaded: no driver installed
    DRIVER_NOT_LOADED = "driver_not_loaded"  # library present, kernel module not loaded
    VERSION_MISMATCH = "version_mismatch"  # driver/library mismatch, usually a reboot after an update
    UNINITIALIZED = "uninitialized"  # NVML not started (or already shut down)
    ERROR = "error"  # anything else (timeouts, unknown errors, a broken binding)


@dataclass(frozen=True, slots=True)
class NotAvailable:
    """A typed "not available" value, returned instead of raising.

    It is falsy, so ``value = query(...) or default`` works, but prefer
    ``isinstance(value, NotAvailable)`` when 0 is a legitimate value.
    """

    kind: Unavailable
    detail: str = ""
    code: int | None = None  # the raw NVML error code, when there was one

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}" if self.detail else self.kind.value


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """One process's device memory on one GPU, as the driver accounts it.

    ``used_bytes`` is None where the driver does not report it (Windows WDDM). ``name`` is None when the
    process cannot be inspected (another user, another PID namespace, already exited, psutil missing).
    """

    pid: int
    used_bytes: int | None
    name: str | None = None


# The fields of GpuReading that a device may fail to report; ``missing`` holds a subset of these names.
OPTIONAL_FIELDS: tuple[str, ...] = (
    "memory_used_bytes",
    "memory_total_bytes",
    "memory_reserved_bytes",
    "utilization_gpu_pct",
    "utilization_mem_pct",
    "power_mw",
    "power_limit_mw",
    "temperature_c",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "processes",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuReading:
    """One GPU at one moment.

    ``index`` is the NVML index (PCI bus order), not the CUDA ordinal: map the two by ``uuid`` (see
    ``detect.visible_devices``).

    ``memory_used_bytes`` is the device-level "used" of ``nvidia-smi``: every process's CUDA context,
    allocator pools and library workspaces. Where the driver reports its own reservation separately
    (NVML memory info v2, drivers >= 510) that part is in ``memory_reserved_bytes`` and *not* in
    ``memory_used_bytes``; on older drivers ``memory_reserved_bytes`` is None and "used" includes it.

    ``processes`` is the per-process breakdown (compute processes only); it is ``()`` both when no
    process uses the GPU and when the driver cannot say, so check ``"processes" in missing``.

    ``lost`` is True once the GPU reported "GPU is lost"; every live field is then None.
    """

    index: int
    uuid: str
    name: str
    timestamp_s: float
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    utilization_gpu_pct: int | None = None
    utilization_mem_pct: int | None = None
    power_mw: int | None = None
    power_limit_mw: int | None = None
    temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    processes: tuple[ProcessMemory, ...] = ()
    missing: frozenset[str] = frozenset()
    lost: bool = False

    @classmethod
    def build(
        cls,
        *,
        index: int,
        uuid: str,
        name: str,
        timestamp_s: float,
        processes: Sequence[ProcessMemory] | None = None,
        lost: bool = False,
        **values: int | None,
    ) -> GpuReading:
        """Make a reading whose ``missing`` lists exactly the optional fields given as None (or left out).

        ``processes=None`` means "the driver could not say"; pass ``()`` for "no processes".
        """
        unknown = set(values) - set(OPTIONAL_FIELDS)
        if unknown:
            raise TypeError(f"unknown GpuReading fields: {sorted(unknown)}")
        missing = {name for name in OPTIONAL_FIELDS if name != "processes" and values.get(name) is None}
        if processes is None:
            missing.add("processes")
        return cls(
            index=index,
            uuid=uuid,
            name=name,
            timestamp_s=timestamp_s,
            processes=tuple(processes or ()),
            missing=frozenset(missing),
            lost=lost,
            **values,
        )

    @property
    def memory_free_bytes(self) -> int | None:
        """total - used - reserved (what a new allocation could still get), None if unknown."""
        if self.memory_total_bytes is None or self.memory_used_bytes is None:
            return None
        return self.memory_total_bytes - self.memory_used_bytes - (self.memory_reserved_bytes or 0)

    def process(self, pid: int) -> ProcessMemory | None:
        """The entry for ``pid`` (e.g. ``os.getpid()`` or a profiling child), or None."""
        return next((p for p in self.processes if p.pid == pid), None)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuInfo:
    """Static facts about one GPU, read once.

    ``nvml_index`` is the device's position in NVML's enumeration (PCI bus order). ``index`` is the
    CUDA ordinal the training process will see: equal to ``nvml_index`` from ``sampler.devices()``,
    renumbered by ``detect.visible_devices`` according to ``CUDA_VISIBLE_DEVICES``.

    ``cuda_driver_version`` is the highest CUDA version the driver supports, as text ("12.4").
    ``compute_capability`` is (major, minor), e.g. (8, 9) for Ada. ``mig_uuids`` lists the MIG
    instances when MIG mode is on; ``visible_mig_uuid`` is set when CUDA_VISIBLE_DEVICES selected one
    of them (readings stay whole-GPU: NVML memory readings are per physical GPU).
    """

    index: int
    uuid: str
    name: str
    memory_total_bytes: int | None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    compute_capability: tuple[int, int] | None = None
    pci_bus_id: str | None = None
    nvml_index: int = 0
    mig_uuids: tuple[str, ...] = ()
    visible_mig_uuid: str | None = None

    def with_cuda_index(self, cuda_index: int, visible_mig_uuid: str | None = None) -> GpuInfo:
        return dataclasses.replace(self, index=cuda_index, visible_mig_uuid=visible_mig_uuid)


@dataclass(frozen=True, slots=True)
class Sample:
    """All requested GPUs at one moment. Empty ``readings`` when no GPU is available."""

    timestamp_s: float
    readings: tuple[GpuReading, ...] = field(default_factory=tuple)

    def get(self, index: int) -> GpuReading | None:
        """The reading for NVML index ``index``, or None."""
        return next((r for r in self.readings if r.index == index), None)


@runtime_checkable
class GpuSampler(Protocol):
    """What the rest of the app needs from GPU hardware. Implementations never raise to callers.

    ``sample(indices)`` takes NVML indices (``GpuInfo.nvml_index``); None samples every device. Unknown
    indices are skipped. All methods are safe to call from any thread and after ``close()`` (a closed
    sampler is unavailable and samples nothing); ``close()`` may be called any number of times.
    """

    def available(self) -> bool: ...

    def reason(self) -> str: ...

    def devices(self) -> list[GpuInfo]: ...

    def sample(self, indices: Sequence[int] | None = None) -> Sample: ...

    def close(self) -> None: ...
