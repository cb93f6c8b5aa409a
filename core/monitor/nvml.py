"""GPU readings from NVML (the ``nvidia-ml-py`` package, module ``pynvml``).

Every NVML call goes through one choke point, :func:`nvml_query`, which returns a typed
:class:`~vramlab.core.monitor.types.NotAvailable` instead of raising. The sampler builds on that:

- NVML starts lazily, once, under a lock, on the first call that needs it; if it cannot start (no
  driver, driver not loaded, library/driver mismatch) the sampler is simply unavailable and
  :meth:`NvmlSampler.reason` says why. Nothing is raised to callers.
- One field the device does not support (power on many consumer cards, per-process memory on old
  drivers) leaves that field None and names it in ``GpuReading.missing``; the rest of the sample stays.
- A GPU that reports "GPU is lost" is marked ``lost`` from then on and not queried again; the other
  GPUs keep being sampled.

``pynvml`` is imported on first use, not at import time, and torch is never imported.

Known limitations: per-process memory covers compute processes only (not graphics); process names
come from psutil (optional) or NVML and can be wrong for PIDs from another PID namespace (containers
report host PIDs); MIG instances are listed but readings are for the whole physical GPU.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from enum import Enum
from types import ModuleType
from typing import Any

from vramlab.core.monitor.types import (
    GpuInfo,
    GpuReading,
    NotAvailable,
    ProcessMemory,
    Sample,
    Unavailable,
)

log = logging.getLogger(__name__)

# NVML return codes (nvml.h). They are part of NVML's ABI, so we keep our own copy rather than rely on
# the binding (or a test's fake binding) defining every name.
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_GPU_NOT_FOUND = 28

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2

_CODE_TO_KIND: dict[int, Unavailable] = {
    NVML_ERROR_UNINITIALIZED: Unavailable.UNINITIALIZED,
    NVML_ERROR_NOT_SUPPORTED: Unavailable.NOT_SUPPORTED,
    NVML_ERROR_NO_PERMISSION: Unavailable.NO_PERMISSION,
    NVML_ERROR_NOT_FOUND: Unavailable.NOT_FOUND,
    NVML_ERROR_DRIVER_NOT_LOADED: Unavailable.DRIVER_NOT_LOADED,
    NVML_ERROR_LIBRARY_NOT_FOUND: Unavailable.NO_LIBRARY,
    NVML_ERROR_FUNCTION_NOT_FOUND: Unavailable.FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST: Unavailable.GPU_LOST,
    NVML_ERROR_RESET_REQUIRED: Unavailable.GPU_LOST,
    NVML_ERROR_GPU_NOT_FOUND: Unavailable.GPU_LOST,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: Unavailable.VERSION_MISMATCH,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: Unavailable.FUNCTION_NOT_FOUND,
}

_LIBRARY_FILE = "nvml.dll" if sys.platform.startswith("win") else "libnvidia-ml.so"
NO_DRIVER_REASON = f"no NVIDIA driver found ({_LIBRARY_FILE} not loadable)"
DRIVER_NOT_LOADED_REASON = "the NVIDIA driver is installed but not loaded (nvmlInit: Driver Not Loaded)"
VERSION_MISMATCH_REASON = (
    "the NVIDIA driver and its NVML library do not match (nvmlInit: version mismatch; reboot after a "
    "driver update?)"
)
NO_GPU_REASON = "the NVIDIA driver reports no GPU"
NO_BINDING_REASON = "the nvidia-ml-py package (module pynvml) is not installed"
CLOSED_REASON = "the GPU sampler is closed"


def init_failure_reason(na: NotAvailable) -> str:
    """A sentence for the user explaining why NVML could not start."""
    if na.kind is Unavailable.NO_LIBRARY:
        return NO_DRIVER_REASON
    if na.kind is Unavailable.DRIVER_NOT_LOADED:
        return DRIVER_NOT_LOADED_REASON
    if na.kind is Unavailable.VERSION_MISMATCH:
        return VERSION_MISMATCH_REASON
    if na.kind is Unavailable.NO_PERMISSION:
        return "no permission to use the NVIDIA driver (nvmlInit: Insufficient Permissions)"
    return f"NVML could not start ({na.detail or na.kind.value})"


def nvml_query(nvml: ModuleType | Any, func_name: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``nvml.<func_name>(*args, **kwargs)``; on failure return a :class:`NotAvailable`.

    This is the only place where NVML is called. NVML errors are mapped by their return code
    (NOT_SUPPORTED, NO_PERMISSION, GPU_IS_LOST, FUNCTION_NOT_FOUND, ...). A function the binding does
    not have counts as FUNCTION_NOT_FOUND. Any other exception from the binding (a ctypes problem, an
    old binding's different signature) becomes ``Unavailable.ERROR``: a monitor must not take down the
    thread that samples it.
    """
    fn: Callable[..., Any] | None = getattr(nvml, func_name, None)
    if fn is None:
        return NotAvailable(Unavailable.FUNCTION_NOT_FOUND, f"pynvml has no {func_name}")
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the choke point: nothing escapes
        nvml_error = getattr(nvml, "NVMLError", None)
        if isinstance(nvml_error, type) and isinstance(err, nvml_error):
            code = getattr(err, "value", None)
            kind = _CODE_TO_KIND.get(code, Unavailable.ERROR) if isinstance(code, int) else Unavailable.ERROR
            try:
                text = str(err)
            except Exception:  # noqa: BLE001 - str() of an NVMLError calls into NVML
                text = f"NVML error {code}"
            return NotAvailable(kind, f"{func_name}: {text}", code)
        return NotAvailable(Unavailable.ERROR, f"{func_name}: {type(err).__name__}: {err}")


def _text(value: Any) -> str:
    """NVML strings are bytes in old bindings and str in new ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _int_or_none(value: Any) -> int | None:
    return None if isinstance(value, NotAvailable) or value is None else int(value)


def format_cuda_driver_version(version: int) -> str:
    """NVML's integer CUDA version (12040) as text ("12.4")."""
    return f"{version // 1000}.{(version % 1000) // 10}"


class _State(Enum):
    NEW = "new"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


_PROCESS_FUNCS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)


def _is_permanent(na: NotAvailable) -> bool:
    """Will this call keep failing for the rest of the session? (Missing API, or a binding that does
    not accept the call at all; an NVML error with a code such as UNKNOWN or TIMEOUT may pass.)"""
    if na.kind in (Unavailable.FUNCTION_NOT_FOUND, Unavailable.NOT_SUPPORTED):
        return True
    return na.kind is Unavailable.ERROR and na.code is None


class NvmlSampler:
    """The :class:`~vramlab.core.monitor.types.GpuSampler` for NVIDIA GPUs.

    ``nvml`` is the binding module; None imports ``pynvml`` on first use (tests pass a fake).
    ``process_names`` looks process names up (psutil if installed, else NVML).

    Thread-safe: one re-entrant lock guards start, sampling and shutdown, so ``close()`` from the GUI
    thread never races a sample in a worker thread.
    """

    def __init__(self, nvml: ModuleType | Any | None = None, *, process_names: bool = True) -> None:
        self._nvml = nvml
        self._process_names = process_names
        self._lock = threading.RLock()
        self._state = _State.NEW
        self._reason = ""
        self._handles: dict[int, Any] = {}
        self._infos: list[GpuInfo] = []
        self._lost: set[int] = set()
        self._memory_v2 = True  # switched off once the driver shows it lacks memory info v2
        self._process_func: str | None = None  # the first of _PROCESS_FUNCS that worked
        self._process_funcs_dead: set[str] = set()
        self._psutil: ModuleType | None = None
        self._psutil_checked = False

    # -- the choke point, bound to our binding --------------------------------------------------------
    def _q(self, func_name: str, *args: Any, **kwargs: Any) -> Any:
        return nvml_query(self._nvml, func_name, *args, **kwargs)

    # -- lifecycle ------------------------------------------------------------------------------------
    def _ensure_started(self) -> bool:
        with self._lock:
            if self._state is _State.NEW:
                self._start()
            return self._state is _State.READY

    def _start(self) -> None:
        if self._nvml is None:
            try:
                import pynvml  # nvidia-ml-py
            except ImportError:
                self._fail(NO_BINDING_REASON)
                return
            self._nvml = pynvml
        result = self._q("nvmlInit")
        if isinstance(result, NotAvailable):
            self._fail(init_failure_reason(result))
            return
        self._state = _State.READY  # from here on close() must shut NVML down
        count = self._q("nvmlDeviceGetCount")
        if isinstance(count, NotAvailable):
            self._reason = f"NVML cannot count GPUs ({count.detail})"
            return
        driver = self._q("nvmlSystemGetDriverVersion")
        driver_version = None if isinstance(driver, NotAvailable) else _text(driver)
        cuda = self._q("nvmlSystemGetCudaDriverVersion_v2")
        if isinstance(cuda, NotAvailable):
            cuda = self._q("nvmlSystemGetCudaDriverVersion")
        cuda_version = None if isinstance(cuda, NotAvailable) else format_cuda_driver_version(int(cuda))
        for index in range(int(count)):
            handle = self._q("nvmlDeviceGetHandleByIndex", index)
            if isinstance(handle, NotAvailable):
                # Left out; the others keep their NVML indices, so CUDA ordinals still map right.
                log.warning("GPU %d skipped: %s", index, handle)
                continue
            self._handles[index] = handle
            self._infos.append(self._read_info(index, handle, driver_version, cuda_version))
        if not self._infos:
            self._reason = NO_GPU_REASON

    def _fail(self, reason: str) -> None:
        self._state = _State.FAILED
        self._reason = reason
        log.info("GPU monitoring unavailable: %s", reason)

    def close(self) -> None:
        """Shut NVML down (once). Safe to call again, from any thread, or without ever starting."""
        with self._lock:
            if self._state is _State.READY:
                result = self._q("nvmlShutdown")
                if isinstance(result, NotAvailable):
                    log.debug("nvmlShutdown: %s", result)
            self._state = _State.CLOSED
            self._reason = CLOSED_REASON
            self._handles.clear()
            self._infos = []

    def __enter__(self) -> NvmlSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the protocol ---------------------------------------------------------------------------------
    def available(self) -> bool:
        """True when NVML started and sees at least one GPU."""
        return self._ensure_started() and bool(self._infos)

    def reason(self) -> str:
        """Why :meth:`available` is False, for people; "" when it is True."""
        self._ensure_started()
        with self._lock:
            return "" if self._state is _State.READY and self._infos else self._reason

    def devices(self) -> list[GpuInfo]:
        """Static info of every GPU NVML sees, in NVML order (``index == nvml_index``)."""
        if not self._ensure_started():
            return []
        with self._lock:
            return list(self._infos)

    def sample(self, indices: Sequence[int] | None = None) -> Sample:
        """Read the GPUs with these NVML indices (all when None). Never raises."""
        now = time.monotonic()
        if not self._ensure_started():
            return Sample(now, ())
        with self._lock:
            if self._state is not _State.READY:  # closed while we waited for the lock
                return Sample(now, ())
            wanted = [i.nvml_index for i in self._infos] if indices is None else list(indices)
            by_index = {i.nvml_index: i for i in self._infos}
            readings = tuple(self._read(by_index[i]) for i in wanted if i in by_index)
            return Sample(now, readings)

    @property
    def lost_indices(self) -> frozenset[int]:
        """NVML indices of GPUs that reported "GPU is lost" during this session."""
        with self._lock:
            return frozenset(self._lost)

    # -- reading one device ---------------------------------------------------------------------------
    def _read_info(self, index: int, handle: Any, driver: str | None, cuda: str | None) -> GpuInfo:
        name = self._q("nvmlDeviceGetName", handle)
        uuid = self._q("nvmlDeviceGetUUID", handle)
        memory = self._q("nvmlDeviceGetMemoryInfo", handle)
        capability = self._q("nvmlDeviceGetCudaComputeCapability", handle)
        pci = self._q("nvmlDeviceGetPciInfo", handle)
        return GpuInfo(
            index=index,
            nvml_index=index,
            name="unknown NVIDIA GPU" if isinstance(name, NotAvailable) else _text(name),
            uuid="" if isinstance(uuid, NotAvailable) else _text(uuid),
            memory_total_bytes=None if isinstance(memory, NotAvailable) else int(memory.total),
            driver_version=driver,
            cuda_driver_version=cuda,
            compute_capability=(
                None if isinstance(capability, NotAvailable) else (int(capability[0]), int(capability[1]))
            ),
            pci_bus_id=None if isinstance(pci, NotAvailable) else _text(pci.busId),
            mig_uuids=self._read_mig_uuids(handle),
        )

    def _read_mig_uuids(self, handle: Any) -> tuple[str, ...]:
        mode = self._q("nvmlDeviceGetMigMode", handle)
        if isinstance(mode, NotAvailable) or not mode or int(mode[0]) != 1:
            return ()
        count = self._q("nvmlDeviceGetMaxMigDeviceCount", handle)
        if isinstance(count, NotAvailable):
            return ()
        uuids = []
        for slot in range(int(count)):
            mig = self._q("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            if isinstance(mig, NotAvailable):
                continue  # empty slot (NOT_FOUND)
            uuid = self._q("nvmlDeviceGetUUID", mig)
            if not isinstance(uuid, NotAvailable):
                uuids.append(_text(uuid))
        return tuple(uuids)

    def _lost_reading(self, info: GpuInfo) -> GpuReading:
        return GpuReading.build(
            index=info.nvml_index,
            uuid=info.uuid,
            name=info.name,
            timestamp_s=time.monotonic(),
            lost=True,
        )

    def _mark_lost(self, info: GpuInfo, na: NotAvailable) -> GpuReading:
        if info.nvml_index not in self._lost:
            log.warning("GPU %d (%s) is lost: %s", info.nvml_index, info.name, na.detail)
            self._lost.add(info.nvml_index)
        return self._lost_reading(info)

    def _read(self, info: GpuInfo) -> GpuReading:
        if info.nvml_index in self._lost:
            return self._lost_reading(info)
        handle = self._handles[info.nvml_index]
        values: dict[str, int | None] = {}

        # Each step returns a NotAvailable or a value; a lost GPU ends the reading at once.
        memory = self._read_memory(handle)
        if isinstance(memory, NotAvailable) and memory.kind is Unavailable.GPU_LOST:
            return self._mark_lost(info, memory)
        if not isinstance(memory, NotAvailable):
            values.update(memory)

        utilization = self._q("nvmlDeviceGetUtilizationRates", handle)
        if isinstance(utilization, NotAvailable):
            if utilization.kind is Unavailable.GPU_LOST:
                return self._mark_lost(info, utilization)
        else:
            values["utilization_gpu_pct"] = int(utilization.gpu)
            values["utilization_mem_pct"] = int(utilization.memory)

        scalar_queries: list[tuple[str, str, tuple[Any, ...]]] = [
            ("power_mw", "nvmlDeviceGetPowerUsage", ()),
            ("power_limit_mw", "nvmlDeviceGetEnforcedPowerLimit", ()),
            ("temperature_c", "nvmlDeviceGetTemperature", (NVML_TEMPERATURE_GPU,)),
            ("sm_clock_mhz", "nvmlDeviceGetClockInfo", (NVML_CLOCK_SM,)),
            ("mem_clock_mhz", "nvmlDeviceGetClockInfo", (NVML_CLOCK_MEM,)),
        ]
        for field_name, func_name, extra in scalar_queries:
            value = self._q(func_name, handle, *extra)
            if field_name == "power_limit_mw" and isinstance(value, NotAvailable):
                if value.kind is not Unavailable.GPU_LOST:
                    value = self._q("nvmlDeviceGetPowerManagementLimit", handle)
            if isinstance(value, NotAvailable) and value.kind is Unavailable.GPU_LOST:
                return self._mark_lost(info, value)
            values[field_name] = _int_or_none(value)

        processes = self._read_processes(handle)
        if isinstance(processes, NotAvailable):
            if processes.kind is Unavailable.GPU_LOST:
                return self._mark_lost(info, processes)
            processes = None

        return GpuReading.build(
            index=info.nvml_index,
            uuid=info.uuid,
            name=info.name,
            timestamp_s=time.monotonic(),
            processes=processes,
            **values,
        )

    def _read_memory(self, handle: Any) -> dict[str, int | None] | NotAvailable:
        """used/total/reserved: memory info v2 where the driver has it (used excludes the driver's
        reservation, as in ``nvidia-smi`` since R510), else v1 (used includes it, reserved unknown)."""
        version = getattr(self._nvml, "nvmlMemory_v2", None)
        if self._memory_v2 and version is not None:
            memory = self._q("nvmlDeviceGetMemoryInfo", handle, version=version)
            if not isinstance(memory, NotAvailable):
                return {
                    "memory_used_bytes": int(memory.used),
                    "memory_total_bytes": int(memory.total),
                    "memory_reserved_bytes": int(memory.reserved),
                }
            if memory.kind is Unavailable.GPU_LOST:
                return memory
            if _is_permanent(memory):
                log.debug("memory info v2 unavailable, using v1: %s", memory)
                self._memory_v2 = False
        memory = self._q("nvmlDeviceGetMemoryInfo", handle)
        if isinstance(memory, NotAvailable):
            return memory
        return {"memory_used_bytes": int(memory.used), "memory_total_bytes": int(memory.total)}

    def _read_processes(self, handle: Any) -> tuple[ProcessMemory, ...] | NotAvailable:
        """Compute processes via the newest API the driver has (v3, then v2, then the unversioned name).

        An old driver lacks ``_v3`` (FUNCTION_NOT_FOUND): we fall back and remember what worked.
        """
        candidates = [self._process_func] if self._process_func else list(_PROCESS_FUNCS)
        last: NotAvailable = NotAvailable(Unavailable.NOT_SUPPORTED, "no process query available")
        for func_name in candidates:
            if func_name in self._process_funcs_dead:
                continue
            result = self._q(func_name, handle)
            if not isinstance(result, NotAvailable):
                self._process_func = func_name
                return self._to_processes(result)
            last = result
            if result.kind is Unavailable.FUNCTION_NOT_FOUND or (
                result.kind is Unavailable.ERROR and result.code is None
            ):
                self._process_funcs_dead.add(func_name)  # missing in this driver: try the next one
                continue
            return result  # NOT_SUPPORTED, NO_PERMISSION, GPU_LOST, ...: an older version says the same
        return last

    def _to_processes(self, entries: Any) -> tuple[ProcessMemory, ...]:
        used_by_pid: dict[int, int | None] = {}
        for entry in entries:
            pid = int(entry.pid)
            used = getattr(entry, "usedGpuMemory", None)
            used = None if used is None else int(used)
            if pid in used_by_pid:  # the same process listed twice (e.g. MIG): add up
                before = used_by_pid[pid]
                used = None if before is None and used is None else (before or 0) + (used or 0)
            used_by_pid[pid] = used
        return tuple(
            ProcessMemory(pid=pid, used_bytes=used, name=self._process_name(pid))
            for pid, used in used_by_pid.items()
        )

    def _process_name(self, pid: int) -> str | None:
        if not self._process_names:
            return None
        if not self._psutil_checked:
            self._psutil_checked = True
            try:
                import psutil  # optional: better names, no NVML call
            except ImportError:
                log.debug("psutil not installed; process names come from NVML")
            else:
                self._psutil = psutil
        if self._psutil is not None:
            try:
                return str(self._psutil.Process(pid).name())
            except Exception:  # noqa: BLE001 - gone, another user, another PID namespace
                return None
        name = self._q("nvmlSystemGetProcessName", pid)
        return None if isinstance(name, NotAvailable) else _text(name).rsplit("/", 1)[-1] or None
