"""core.monitor: the NVML choke point, the fake sampler's scenarios, CUDA_VISIBLE_DEVICES mapping.

There is no GPU (and usually no driver) where these run, so NVML is replaced by a tiny fake binding
(:class:`FakeNvml`) that raises NVML errors by code, the way nvidia-ml-py does. One test calls the real
binding to check that a machine without a driver gets a readable reason instead of an exception.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from vramlab.core.monitor import (
    FakeSampler,
    GpuInfo,
    GpuReading,
    GpuSampler,
    NotAvailable,
    NvmlSampler,
    ProcessMemory,
    Sample,
    Scenario,
    Unavailable,
    cuda_available_without_context,
    describe_gpus,
    fake_gpu,
    nvml_query,
    parse_cuda_visible_devices,
    resolve_visible_devices,
    visible_devices,
)
from vramlab.core.monitor.fake import OTHER_PID, RTX_4090_MEMORY_BYTES
from vramlab.core.monitor.nvml import NO_DRIVER_REASON
from vramlab.core.monitor.types import OPTIONAL_FIELDS

MiB = 1024**2
GiB = 1024**3

NOT_SUPPORTED = 3
NO_PERMISSION = 4
DRIVER_NOT_LOADED = 9
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
LIB_RM_VERSION_MISMATCH = 18
UNKNOWN = 999


# --------------------------------------------------------------------------------------------------------
# A tiny fake of the pynvml module
# --------------------------------------------------------------------------------------------------------
class FakeNVMLError(Exception):
    """Like pynvml.NVMLError: carries the NVML return code in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {
            NOT_SUPPORTED: "Not Supported",
            NO_PERMISSION: "Insufficient Permissions",
            LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
            FUNCTION_NOT_FOUND: "Function Not Found",
            GPU_IS_LOST: "GPU is lost",
        }.get(self.value, f"NVML error {self.value}")


class FakeNvml:
    """Stands in for the ``pynvml`` module. Handles are the NVML indices themselves.

    - ``fail[func_name] = code`` makes that function raise for every device;
      ``fail[(func_name, index)] = code`` for one device.
    - ``lose(index, after_calls)``: that device raises GPU_IS_LOST once it has had ``after_calls`` calls.
    - ``remove(func_name)``: the binding does not have the function at all (an old nvidia-ml-py).
    - ``fail_once[(func_name, index)] = code`` raises once, then works (a transient error).
    """

    NVMLError = FakeNVMLError
    nvmlMemory_v2 = 0x02000028

    def __init__(self, gpus: list[dict[str, Any]] | None = None, init_error: int | None = None) -> None:
        self.gpus = gpus if gpus is not None else [_gpu_dict(0)]
        self.init_error = init_error
        self.fail: dict[Any, int] = {}
        self.fail_once: dict[Any, int] = {}
        self.lost_after: dict[int, int] = {}
        self.device_calls: dict[int, int] = {}
        self.calls: list[str] = []
        self.processes: dict[int, list[SimpleNamespace]] = {0: [SimpleNamespace(pid=1, usedGpuMemory=GiB)]}
        self._lock = threading.Lock()

    def lose(self, index: int, after_calls: int) -> None:
        self.lost_after[index] = after_calls

    def remove(self, func_name: str) -> None:
        setattr(self, func_name, None)

    def _check(self, func_name: str, index: int | None = None) -> None:
        with self._lock:
            self.calls.append(func_name)
            if index is not None:
                self.device_calls[index] = self.device_calls.get(index, 0) + 1
                if index in self.lost_after and self.device_calls[index] > self.lost_after[index]:
                    raise FakeNVMLError(GPU_IS_LOST)
                code = self.fail_once.pop((func_name, index), None)
                if code is not None:
                    raise FakeNVMLError(code)
                code = self.fail.get((func_name, index))
                if code is not None:
                    raise FakeNVMLError(code)
            code = self.fail.get(func_name)
            if code is not None:
                raise FakeNVMLError(code)

    # -- library ---------------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return "550.54.14"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion_v2")
        return 12040

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check("nvmlDeviceGetHandleByIndex", index)
        return index

    # -- static ----------------------------------------------------------------------------------------
    def nvmlDeviceGetName(self, h: int) -> bytes:
        self._check("nvmlDeviceGetName", h)
        return self.gpus[h]["name"].encode()  # old bindings return bytes

    def nvmlDeviceGetUUID(self, h: int) -> str:
        self._check("nvmlDeviceGetUUID", h)
        return self.gpus[h]["uuid"]

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        self._check("nvmlDeviceGetCudaComputeCapability", h)
        return (8, 9)

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        self._check("nvmlDeviceGetPciInfo", h)
        return SimpleNamespace(busId=f"00000000:{h + 1:02X}:00.0")

    def nvmlDeviceGetMigMode(self, h: int) -> tuple[int, int]:
        self._check("nvmlDeviceGetMigMode", h)
        raise FakeNVMLError(NOT_SUPPORTED)  # consumer cards

    # -- live ------------------------------------------------------------------------------------------
    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> SimpleNamespace:
        self._check("nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo", h)
        g = self.gpus[h]
        if version:
            return SimpleNamespace(total=g["total"], used=g["used"], reserved=g["reserved"], free=0)
        return SimpleNamespace(total=g["total"], used=g["used"] + g["reserved"], free=0)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        self._check("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=97, memory=41)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self._check("nvmlDeviceGetPowerUsage", h)
        return 312_000

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        self._check("nvmlDeviceGetEnforcedPowerLimit", h)
        return 450_000

    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        self._check("nvmlDeviceGetPowerManagementLimit", h)
        return 450_000

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature", h)
        return 64

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        self._check("nvmlDeviceGetClockInfo", h)
        return {1: 2520, 2: 10501}[clock]

    def _processes(self, func_name: str, h: int) -> list[SimpleNamespace]:
        self._check(func_name, h)
        return list(self.processes.get(h, []))

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: int) -> list[SimpleNamespace]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v3", h)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: int) -> list[SimpleNamespace]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", h)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses", h)

    def nvmlSystemGetProcessName(self, pid: int) -> bytes:
        self._check("nvmlSystemGetProcessName")
        return b"/usr/bin/python3"


def _gpu_dict(index: int, name: str = "NVIDIA GeForce RTX 4090", uuid: str | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "uuid": uuid or f"GPU-{index:08x}-1111-2222-3333-444444444444",
        "total": 24564 * MiB,
        "used": 2 * GiB,
        "reserved": 400 * MiB,
    }


def _assert_consistent(reading: GpuReading) -> None:
    """``missing`` names exactly the optional fields that are None (processes: by declaration)."""
    for name in OPTIONAL_FIELDS:
        if name == "processes":
            if "processes" in reading.missing:
                assert reading.processes == ()
            continue
        assert (getattr(reading, name) is None) == (name in reading.missing), name


# --------------------------------------------------------------------------------------------------------
# The choke point
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (NOT_SUPPORTED, Unavailable.NOT_SUPPORTED),
        (NO_PERMISSION, Unavailable.NO_PERMISSION),
        (GPU_IS_LOST, Unavailable.GPU_LOST),
        (FUNCTION_NOT_FOUND, Unavailable.FUNCTION_NOT_FOUND),
        (LIBRARY_NOT_FOUND, Unavailable.NO_LIBRARY),
        (DRIVER_NOT_LOADED, Unavailable.DRIVER_NOT_LOADED),
        (UNKNOWN, Unavailable.ERROR),
    ],
)
def test_choke_point_returns_typed_not_available_instead_of_raising(code: int, kind: Unavailable) -> None:
    nvml = FakeNvml()
    nvml.fail["nvmlDeviceGetPowerUsage"] = code
    result = nvml_query(nvml, "nvmlDeviceGetPowerUsage", 0)
    assert isinstance(result, NotAvailable)
    assert result.kind is kind
    assert result.code == code
    assert not result  # falsy
    assert "nvmlDeviceGetPowerUsage" in result.detail


def test_choke_point_passes_values_through_and_handles_missing_functions_and_odd_errors() -> None:
    nvml = FakeNvml()
    assert nvml_query(nvml, "nvmlDeviceGetPowerUsage", 0) == 312_000
    assert nvml_query(nvml, "nvmlDeviceGetPowerUsage", 0) is not None
    missing = nvml_query(nvml, "nvmlDeviceGetSomethingFromTheFuture", 0)
    assert isinstance(missing, NotAvailable) and missing.kind is Unavailable.FUNCTION_NOT_FOUND
    # an old binding with another signature raises TypeError: still no exception escapes
    odd = nvml_query(nvml, "nvmlDeviceGetPowerUsage", 0, "unexpected", "args")
    assert isinstance(odd, NotAvailable) and odd.kind is Unavailable.ERROR and odd.code is None


# --------------------------------------------------------------------------------------------------------
# NvmlSampler over the fake binding
# --------------------------------------------------------------------------------------------------------
def test_nvml_sampler_healthy_reading_and_static_info() -> None:
    nvml = FakeNvml()
    sampler = NvmlSampler(nvml)
    assert isinstance(sampler, GpuSampler)
    assert sampler.available() and sampler.reason() == ""
    (info,) = sampler.devices()
    assert info == GpuInfo(
        index=0,
        nvml_index=0,
        name="NVIDIA GeForce RTX 4090",
        uuid="GPU-00000000-1111-2222-3333-444444444444",
        memory_total_bytes=24564 * MiB,
        driver_version="550.54.14",
        cuda_driver_version="12.4",
        compute_capability=(8, 9),
        pci_bus_id="00000000:01:00.0",
    )
    sample = sampler.sample()
    (r,) = sample.readings
    assert r.missing == frozenset() and not r.lost
    assert r.memory_used_bytes == 2 * GiB  # memory info v2: "used" without the driver's reservation
    assert r.memory_reserved_bytes == 400 * MiB
    assert r.memory_free_bytes == 24564 * MiB - 2 * GiB - 400 * MiB
    assert (r.utilization_gpu_pct, r.utilization_mem_pct) == (97, 41)
    assert (r.power_mw, r.power_limit_mw, r.temperature_c) == (312_000, 450_000, 64)
    assert (r.sm_clock_mhz, r.mem_clock_mhz) == (2520, 10501)
    assert r.processes[0].pid == 1 and r.processes[0].used_bytes == GiB
    assert r.timestamp_s >= sample.timestamp_s
    assert sample.get(0) is r and sample.get(7) is None
    sampler.close()


def test_nvml_not_supported_fields_degrade_without_losing_the_sample() -> None:
    """Old consumer cards answer NOT_SUPPORTED for power and temperature (gpustat's tests): keep the rest."""
    nvml = FakeNvml()
    for func in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature", "nvmlDeviceGetEnforcedPowerLimit",
                 "nvmlDeviceGetPowerManagementLimit"):  # fmt: skip
        nvml.fail[func] = NOT_SUPPORTED
    nvml.fail["nvmlDeviceGetUtilizationRates"] = NO_PERMISSION
    with NvmlSampler(nvml) as sampler:
        (r,) = sampler.sample().readings
    assert r.power_mw is None and r.power_limit_mw is None and r.temperature_c is None
    assert r.utilization_gpu_pct is None and r.utilization_mem_pct is None
    assert r.missing == {"power_mw", "power_limit_mw", "temperature_c", "utilization_gpu_pct",
                         "utilization_mem_pct"}  # fmt: skip
    assert r.memory_used_bytes == 2 * GiB and r.sm_clock_mhz == 2520 and not r.lost
    _assert_consistent(r)


def test_nvml_power_limit_falls_back_to_management_limit() -> None:
    nvml = FakeNvml()
    nvml.remove("nvmlDeviceGetEnforcedPowerLimit")
    with NvmlSampler(nvml) as sampler:
        (r,) = sampler.sample().readings
    assert r.power_limit_mw == 450_000 and "power_limit_mw" not in r.missing


def test_nvml_gpu_lost_mid_run_marks_that_gpu_and_keeps_sampling_the_others() -> None:
    nvml = FakeNvml(gpus=[_gpu_dict(0), _gpu_dict(1)])
    sampler = NvmlSampler(nvml)
    first = sampler.sample()
    assert not first.get(0).lost
    nvml.lose(0, after_calls=nvml.device_calls[0] + 3)  # falls off the bus in the middle of a reading
    second = sampler.sample()
    lost, alive = second.get(0), second.get(1)
    assert lost.lost and lost.memory_used_bytes is None and lost.uuid.startswith("GPU-00000000")
    assert set(OPTIONAL_FIELDS) <= lost.missing
    assert not alive.lost and alive.memory_used_bytes == 2 * GiB and alive.missing == frozenset()
    assert sampler.lost_indices == {0}
    # a lost GPU is not asked again (each call to a lost GPU can take seconds)
    calls = nvml.device_calls[0]
    third = sampler.sample()
    assert nvml.device_calls[0] == calls
    assert third.get(0).lost and not third.get(1).lost
    assert sampler.available()  # the sampler as a whole still works
    sampler.close()


def test_nvml_old_driver_without_v3_process_api_falls_back_to_v2() -> None:
    nvml = FakeNvml()
    nvml.fail["nvmlDeviceGetComputeRunningProcesses_v3"] = FUNCTION_NOT_FOUND
    with NvmlSampler(nvml) as sampler:
        (r,) = sampler.sample().readings
        assert r.processes and "processes" not in r.missing
        sampler.sample()
    assert nvml.calls.count("nvmlDeviceGetComputeRunningProcesses_v3") == 1  # remembered, not retried
    assert nvml.calls.count("nvmlDeviceGetComputeRunningProcesses_v2") == 2


def test_nvml_no_process_api_at_all_marks_processes_missing() -> None:
    nvml = FakeNvml()
    nvml.remove("nvmlDeviceGetComputeRunningProcesses_v3")
    nvml.fail["nvmlDeviceGetComputeRunningProcesses_v2"] = FUNCTION_NOT_FOUND
    nvml.fail["nvmlDeviceGetComputeRunningProcesses"] = NOT_SUPPORTED
    with NvmlSampler(nvml) as sampler:
        (r,) = sampler.sample().readings
    assert r.processes == () and r.missing == {"processes"}
    assert r.memory_used_bytes == 2 * GiB


def test_nvml_processes_without_permission_are_missing_not_empty() -> None:
    nvml = FakeNvml()
    nvml.fail["nvmlDeviceGetComputeRunningProcesses_v3"] = NO_PERMISSION
    with NvmlSampler(nvml) as sampler:
        (r,) = sampler.sample().readings
    assert "processes" in r.missing


def test_nvml_process_names_and_duplicate_pids() -> None:
    nvml = FakeNvml()
    me = os.getpid()
    nvml.processes[0] = [
        SimpleNamespace(pid=me, usedGpuMemory=GiB),
        SimpleNamespace(pid=me, usedGpuMemory=MiB),  # listed twice (MIG): added up
        SimpleNamespace(pid=2**22 + 12345, usedGpuMemory=None),  # WDDM: no per-process number
    ]
    with NvmlSampler(nvml) as sampler:
        (r,) = sampler.sample().readings
    assert r.process(me) == ProcessMemory(me, GiB + MiB, r.process(me).name)
    assert r.process(me).name  # psutil (installed here) names our own process
    assert r.process(2**22 + 12345).used_bytes is None
    with NvmlSampler(nvml, process_names=False) as sampler:
        (r,) = sampler.sample().readings
    assert r.process(me).name is None


def test_nvml_memory_info_v2_missing_falls_back_to_v1() -> None:
    nvml = FakeNvml()
    nvml.fail["nvmlDeviceGetMemoryInfo_v2"] = FUNCTION_NOT_FOUND
    with NvmlSampler(nvml) as sampler:
        (r,) = sampler.sample().readings
        sampler.sample()
    assert r.memory_used_bytes == 2 * GiB + 400 * MiB  # v1 "used" includes the driver's reservation
    assert r.memory_reserved_bytes is None and r.missing == {"memory_reserved_bytes"}
    assert nvml.calls.count("nvmlDeviceGetMemoryInfo_v2") == 1  # not asked again


def test_nvml_transient_error_loses_one_field_once() -> None:
    nvml = FakeNvml()
    with NvmlSampler(nvml) as sampler:
        sampler.devices()
        nvml.fail_once[("nvmlDeviceGetUtilizationRates", 0)] = UNKNOWN
        nvml.fail_once[("nvmlDeviceGetMemoryInfo_v2", 0)] = UNKNOWN
        first = sampler.sample().readings[0]
        second = sampler.sample().readings[0]
    assert first.missing == {"utilization_gpu_pct", "utilization_mem_pct", "memory_reserved_bytes"}
    assert first.memory_used_bytes is not None  # v1 answered this once
    assert second.missing == frozenset()  # v2 was not switched off by a transient error
    _assert_consistent(first)


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (LIBRARY_NOT_FOUND, "no NVIDIA driver found"),
        (DRIVER_NOT_LOADED, "not loaded"),
        (LIB_RM_VERSION_MISMATCH, "do not match"),
        (UNKNOWN, "NVML could not start"),
    ],
)
def test_nvml_init_failure_is_a_reason_not_an_exception(code: int, words: str) -> None:
    nvml = FakeNvml(init_error=code)
    sampler = NvmlSampler(nvml)
    assert sampler.available() is False
    assert words in sampler.reason()
    assert sampler.devices() == []
    assert sampler.sample().readings == ()
    sampler.close()
    sampler.close()
    assert "nvmlShutdown" not in nvml.calls  # never started, so nothing to shut down
    assert nvml.calls.count("nvmlInit") == 1  # the failure is remembered, not retried per call


def test_nvml_gpu_without_handle_is_left_out_and_others_keep_their_index() -> None:
    nvml = FakeNvml(gpus=[_gpu_dict(0), _gpu_dict(1)])
    nvml.fail[("nvmlDeviceGetHandleByIndex", 0)] = NO_PERMISSION
    with NvmlSampler(nvml) as sampler:
        assert [d.nvml_index for d in sampler.devices()] == [1]
        assert [r.index for r in sampler.sample().readings] == [1]
        assert [d.nvml_index for d in visible_devices(sampler, {"CUDA_VISIBLE_DEVICES": "1"})] == [1]


def test_nvml_no_gpus_is_unavailable_with_reason() -> None:
    sampler = NvmlSampler(FakeNvml(gpus=[]))
    assert not sampler.available()
    assert "no GPU" in sampler.reason()
    assert sampler.sample().readings == ()
    sampler.close()


def test_real_nvml_on_a_machine_without_driver_gives_a_readable_reason() -> None:
    """The real nvidia-ml-py binding, on this machine: no exception, a sentence for the user."""
    sampler = NvmlSampler()
    try:
        if sampler.available():
            pytest.skip("this machine has a working NVIDIA driver")
        reason = sampler.reason()
        assert reason and "Traceback" not in reason
        assert "NVIDIA" in reason or "nvidia-ml-py" in reason
        assert sampler.devices() == []
        assert sampler.sample().readings == ()
    finally:
        sampler.close()
        sampler.close()
    assert sampler.reason() == "the GPU sampler is closed"


def test_real_nvml_without_driver_matches_the_no_driver_wording() -> None:
    pytest.importorskip("pynvml")
    sampler = NvmlSampler()
    try:
        if sampler.available():
            pytest.skip("this machine has a working NVIDIA driver")
        import pynvml

        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            assert sampler.reason() == NO_DRIVER_REASON
        except pynvml.NVMLError:
            pass  # a different failure (driver not loaded...): covered by the fake tests
        else:
            pynvml.nvmlShutdown()
    finally:
        sampler.close()


@pytest.mark.gpu
def test_real_nvml_reads_a_real_gpu() -> None:
    sampler = NvmlSampler()
    try:
        if not sampler.available():
            pytest.skip(f"no NVIDIA GPU: {sampler.reason()}")
        devices = sampler.devices()
        assert devices and all(d.uuid.startswith(("GPU-", "MIG-")) for d in devices)
        sample = sampler.sample()
        assert len(sample.readings) == len(devices)
        for r in sample.readings:
            assert r.memory_total_bytes and r.memory_used_bytes is not None
            _assert_consistent(r)
    finally:
        sampler.close()


def test_close_is_idempotent_and_samples_nothing_afterwards() -> None:
    nvml = FakeNvml()
    sampler = NvmlSampler(nvml)
    assert sampler.available()
    sampler.close()
    sampler.close()
    assert nvml.calls.count("nvmlShutdown") == 1
    assert not sampler.available() and sampler.reason() == "the GPU sampler is closed"
    assert sampler.sample().readings == () and sampler.devices() == []
    NvmlSampler(FakeNvml()).close()  # closing a never-started sampler: no NVML call needed
    fake = FakeSampler()
    fake.close()
    fake.close()
    assert not fake.available() and fake.sample().readings == ()


def test_close_during_sampling_from_another_thread_is_safe() -> None:
    nvml = FakeNvml(gpus=[_gpu_dict(0), _gpu_dict(1)])
    sampler = NvmlSampler(nvml)
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            for _ in range(200):
                sample = sampler.sample()
                assert len(sample.readings) in (0, 2)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=loop)
    thread.start()
    sampler.close()
    thread.join(timeout=30)
    assert not thread.is_alive() and not errors
    assert nvml.calls.count("nvmlShutdown") <= 1


# --------------------------------------------------------------------------------------------------------
# FakeSampler scenarios, one test each
# --------------------------------------------------------------------------------------------------------
def _ticks() -> Any:
    t = iter(range(10**6))
    return lambda: float(next(t))


def test_scenario_healthy() -> None:
    fake = FakeSampler(scenario=Scenario.HEALTHY, clock=_ticks())
    assert isinstance(fake, GpuSampler)
    assert fake.available() and fake.reason() == ""
    (info,) = fake.devices()
    assert info.name == "NVIDIA GeForce RTX 4090" and info.memory_total_bytes == 24564 * MiB
    idle = fake.sample().readings[0]
    assert idle.missing == frozenset() and not idle.lost
    assert idle.memory_used_bytes == fake.context_bytes and idle.utilization_gpu_pct == 0
    fake.set_allocated(8 * GiB)
    busy = fake.sample()
    r = busy.readings[0]
    assert r.memory_used_bytes == fake.context_bytes + 8 * GiB
    assert r.process(fake.pid).used_bytes == fake.context_bytes + 8 * GiB
    assert r.utilization_gpu_pct >= 90 and r.power_mw > idle.power_mw
    assert busy.timestamp_s == 1.0  # deterministic clock
    # deterministic: a second fake driven the same way gives the same numbers
    twin = FakeSampler(clock=_ticks())
    twin.sample()
    twin.set_allocated(8 * GiB)
    assert twin.sample() == busy


def test_scenario_no_driver() -> None:
    fake = FakeSampler(scenario=Scenario.NO_DRIVER)
    assert not fake.available()
    assert fake.reason() == NO_DRIVER_REASON
    assert fake.reason().startswith("no NVIDIA driver found (") and "not loadable" in fake.reason()
    assert fake.devices() == [] and fake.sample().readings == ()
    listing = describe_gpus(fake, environ={})
    assert listing.text == f"No NVIDIA GPU found: {NO_DRIVER_REASON}"
    assert not cuda_available_without_context(fake, environ={})


def test_scenario_gpu_lost_mid_run() -> None:
    gpus = [fake_gpu(0), fake_gpu(1)]
    fake = FakeSampler(gpus, Scenario.GPU_LOST_MID_RUN, lost_after_samples=3, fault_index=0)
    before = [fake.sample() for _ in range(3)]
    assert not any(r.lost for s in before for r in s.readings)
    after = fake.sample()
    assert after.get(0).lost and after.get(0).memory_used_bytes is None
    assert set(OPTIONAL_FIELDS) <= after.get(0).missing
    assert not after.get(1).lost and after.get(1).memory_used_bytes is not None
    assert fake.available()


def test_scenario_field_not_supported() -> None:
    fake = FakeSampler(scenario=Scenario.FIELD_NOT_SUPPORTED)
    fake.set_allocated(GiB)
    r = fake.sample().readings[0]
    assert r.missing == {"power_mw", "power_limit_mw", "temperature_c"}
    assert r.power_mw is None and r.temperature_c is None
    assert r.memory_used_bytes == fake.context_bytes + GiB and r.utilization_gpu_pct is not None
    _assert_consistent(r)


def test_scenario_other_process_allocating() -> None:
    fake = FakeSampler(scenario=Scenario.OTHER_PROCESS_ALLOCATING, ramp_bytes_per_sample=GiB)
    fake.set_allocated(4 * GiB)
    used = []
    for n in range(5):
        r = fake.sample().readings[0]
        other = r.process(OTHER_PID)
        assert other is not None and other.used_bytes == (n + 1) * GiB
        assert r.process(fake.pid).used_bytes == fake.context_bytes + 4 * GiB  # ours does not move
        used.append(r.memory_used_bytes)
    assert used == sorted(used) and used[-1] - used[0] == 4 * GiB
    # the ramp stops where the GPU is full
    for _ in range(40):
        r = fake.sample().readings[0]
    assert r.memory_used_bytes == RTX_4090_MEMORY_BYTES


def test_scenario_old_driver() -> None:
    fake = FakeSampler(scenario=Scenario.OLD_DRIVER)
    r = fake.sample().readings[0]
    assert r.missing == {"processes", "memory_reserved_bytes"}
    assert r.processes == () and r.memory_used_bytes is not None
    assert fake.devices()[0].driver_version.startswith("470.")


def test_scenario_nvml_error_transient() -> None:
    fake = FakeSampler(scenario=Scenario.NVML_ERROR_TRANSIENT, transient_at_sample=2)
    readings = [fake.sample().readings[0] for _ in range(4)]
    assert [bool(r.missing) for r in readings] == [False, False, True, False]
    broken = readings[2]
    assert broken.memory_used_bytes is not None and not broken.lost  # the sample is still there
    assert {"utilization_gpu_pct", "power_mw", "temperature_c", "sm_clock_mhz"} <= broken.missing
    _assert_consistent(broken)


@pytest.mark.parametrize("scenario", list(Scenario), ids=lambda s: s.value)
def test_every_scenario_keeps_the_protocol(scenario: Scenario) -> None:
    """Whatever the scenario: no exception, consistent `missing`, frozen snapshots."""
    fake = FakeSampler([fake_gpu(0), fake_gpu(1)], scenario, lost_after_samples=2, transient_at_sample=1)
    for _ in range(6):
        sample = fake.sample()
        assert isinstance(sample, Sample)
        for r in sample.readings:
            _assert_consistent(r)
            with pytest.raises(AttributeError):
                r.memory_used_bytes = 0  # type: ignore[misc]
    assert isinstance(fake.reason(), str)
    fake.close()


def test_scenarios_combine() -> None:
    fake = FakeSampler(scenario=[Scenario.FIELD_NOT_SUPPORTED, Scenario.OLD_DRIVER])
    r = fake.sample().readings[0]
    assert {"power_mw", "temperature_c", "processes", "memory_reserved_bytes"} <= r.missing


def test_fake_allocation_callback_drives_our_memory() -> None:
    fake = FakeSampler([fake_gpu(0), fake_gpu(1)])
    steps = iter([GiB, 3 * GiB, 2 * GiB])
    fake.set_allocation_source(lambda index: next(steps) if index == 0 else 0)
    used = [fake.sample([0]).readings[0].memory_used_bytes - fake.context_bytes for _ in range(3)]
    assert used == [GiB, 3 * GiB, 2 * GiB]
    assert fake.sample([1]).readings[0].memory_used_bytes == fake.context_bytes
    fake.set_allocation_source(None)
    fake.set_allocated(5 * GiB, index=1)
    s = fake.sample()
    assert s.get(0).memory_used_bytes == fake.context_bytes
    assert s.get(1).memory_used_bytes == fake.context_bytes + 5 * GiB
    assert fake.sample([9]).readings == ()  # unknown index: skipped
    with pytest.raises(ValueError, match=">= 0"):
        fake.set_allocated(-1)


def test_reading_build_computes_missing() -> None:
    r = GpuReading.build(index=0, uuid="GPU-x", name="x", timestamp_s=0.0, memory_used_bytes=1,
                         memory_total_bytes=2, processes=())  # fmt: skip
    assert "memory_used_bytes" not in r.missing and "power_mw" in r.missing and "processes" not in r.missing
    with pytest.raises(TypeError, match="unknown"):
        GpuReading.build(index=0, uuid="GPU-x", name="x", timestamp_s=0.0, used_mb=1)


# --------------------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------------------
def test_two_threads_sampling_a_fake_sampler() -> None:
    fake = FakeSampler([fake_gpu(0), fake_gpu(1)], Scenario.OTHER_PROCESS_ALLOCATING)
    errors: list[BaseException] = []
    counts = [0, 0]
    start = threading.Barrier(3)

    def loop(slot: int) -> None:
        try:
            start.wait()
            for i in range(200):
                fake.set_allocated(i * MiB)
                sample = fake.sample()
                assert len(sample.readings) == 2
                counts[slot] += 1
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=loop, args=(slot,)) for slot in range(2)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join(timeout=30)
    assert not errors and counts == [200, 200]
    assert fake.samples_taken == 400


def test_two_threads_sampling_an_nvml_sampler() -> None:
    sampler = NvmlSampler(FakeNvml(gpus=[_gpu_dict(0), _gpu_dict(1)]))
    results: list[int] = []
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            for _ in range(200):
                results.append(len(sampler.sample().readings))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    sampler.close()
    assert not errors and results == [2] * 400


# --------------------------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES and detection
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("0", [0]),
        ("1,0", [1, 0]),
        (" 2 , 0 ", [2, 0]),
        ("", []),
        ("-1", []),
        ("NoDevFiles", []),
        ("0,1,-1,2", [0, 1]),
        ("0,abc,1", [0]),
        ("0,,1", [0]),
        ("1gpu,2", [1, 2]),  # CUDA reads numbers like strtoul
        ("0,0", []),  # a repeated device hides every device
        ("GPU-aaa,GPU-bbb", ["GPU-aaa", "GPU-bbb"]),
        ("GPU-aaa,1", ["GPU-aaa"]),  # a different kind of entry ends the list
        ("GPU-aaa,GPU-aaa", []),
        ("MIG-1234,MIG-5678", ["MIG-1234", "MIG-5678"]),
    ],
)
def test_parse_cuda_visible_devices(value: str | None, expected: list[Any] | None) -> None:
    assert parse_cuda_visible_devices(value) == expected


THREE_GPUS = [
    fake_gpu(0, uuid="GPU-aaaa1111-0000-0000-0000-000000000000"),
    fake_gpu(1, uuid="GPU-bbbb2222-0000-0000-0000-000000000000"),
    fake_gpu(2, uuid="GPU-bbbb3333-0000-0000-0000-000000000000", mig_uuids=("MIG-cccc4444-0000",)),
]


def _visible(value: str | None) -> list[tuple[int, int]]:
    """(cuda index, nvml index) pairs."""
    return [(d.index, d.nvml_index) for d in resolve_visible_devices(value, THREE_GPUS)]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [(0, 0), (1, 1), (2, 2)]),
        ("1,0", [(0, 1), (1, 0)]),  # reordering: cuda:0 is the second GPU
        ("2", [(0, 2)]),
        ("0,5,1", [(0, 0)]),  # an ordinal past the last GPU ends the list
        ("-1", []),
        ("", []),
        ("NoDevFiles", []),
        ("GPU-bbbb2222-0000-0000-0000-000000000000,GPU-aaaa", [(0, 1), (1, 0)]),  # full and prefix
        ("GPU-bbbb3", [(0, 2)]),
        ("GPU-aaaa,GPU-bbbb", [(0, 0)]),  # ambiguous prefix ends the list
        ("GPU-ffff,GPU-aaaa", []),  # unknown uuid first: nothing visible
        ("GPU-aaaa,GPU-aaaa1111", []),  # the same GPU twice: none
        ("MIG-cccc", [(0, 2)]),
        ("MIG-GPU-bbbb2222-0000-0000-0000-000000000000/1/0", [(0, 1)]),  # CUDA 11.0 MIG form
        ("MIG-dddd", []),
    ],
)
def test_resolve_visible_devices_by_uuid(value: str | None, expected: list[tuple[int, int]]) -> None:
    assert _visible(value) == expected


def test_visible_devices_keep_uuids_and_mark_the_mig_instance() -> None:
    (mig,) = resolve_visible_devices("MIG-cccc", THREE_GPUS)
    assert mig.uuid == THREE_GPUS[2].uuid and mig.visible_mig_uuid == "MIG-cccc4444-0000"
    first, second = resolve_visible_devices("1,0", THREE_GPUS)
    assert first.uuid == THREE_GPUS[1].uuid and first.index == 0 and first.nvml_index == 1
    assert second.uuid == THREE_GPUS[0].uuid


def test_visible_devices_reads_the_environment_of_the_sampler_machine() -> None:
    fake = FakeSampler(THREE_GPUS)
    assert [d.nvml_index for d in visible_devices(fake, {"CUDA_VISIBLE_DEVICES": "2,0"})] == [2, 0]
    assert len(visible_devices(fake, {})) == 3
    assert visible_devices(FakeSampler(scenario=Scenario.NO_DRIVER), {}) == []


def test_visible_devices_uses_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [d.nvml_index for d in visible_devices(FakeSampler(THREE_GPUS))] == [1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert len(visible_devices(FakeSampler(THREE_GPUS))) == 3


def test_cuda_available_without_context() -> None:
    assert cuda_available_without_context(FakeSampler(), environ={})
    assert not cuda_available_without_context(FakeSampler(), environ={"CUDA_VISIBLE_DEVICES": "-1"})
    assert not cuda_available_without_context(FakeSampler(scenario=Scenario.NO_DRIVER), environ={})
    # the real check on this machine: a plain bool, never an exception
    assert cuda_available_without_context() in (True, False)


def test_describe_gpus_for_the_cli() -> None:
    fake = FakeSampler(THREE_GPUS)
    fake.set_allocated(GiB, index=0)
    listing = describe_gpus(fake, environ={"CUDA_VISIBLE_DEVICES": "2,0"})
    assert listing.available and listing.visible_count == 2
    data = json.loads(json.dumps(listing.as_dict()))  # plain data only
    gpus = data["gpus"]
    assert [g["cuda_index"] for g in gpus] == [1, None, 0]
    assert gpus[0]["memory_used_bytes"] == fake.context_bytes + GiB
    assert gpus[0]["memory_total_bytes"] == 24564 * MiB and gpus[0]["compute_capability"] == "8.9"
    assert gpus[0]["uuid"] == THREE_GPUS[0].uuid and gpus[0]["driver_version"] == "550.54.14"
    first_line = listing.text.splitlines()[0]
    assert first_line.startswith("cuda:1 (nvml 0): NVIDIA GeForce RTX 4090, 23.99 GiB total")
    assert "hidden" in listing.text.splitlines()[1]
    assert fake.available()  # a sampler passed in stays open


def test_describe_gpus_when_none_found() -> None:
    listing = describe_gpus(FakeSampler(scenario=Scenario.NO_DRIVER), environ={})
    assert not listing.available and listing.gpus == ()
    assert listing.text == f"No NVIDIA GPU found: {NO_DRIVER_REASON}"
    assert "\n" not in listing.text
    assert listing.as_dict()["reason"] == NO_DRIVER_REASON
    hidden = describe_gpus(FakeSampler(), environ={"CUDA_VISIBLE_DEVICES": "-1"})
    assert not hidden.available and len(hidden.gpus) == 1
    assert hidden.text == "No NVIDIA GPU found: CUDA_VISIBLE_DEVICES='-1' hides all 1 GPU(s)"


def test_describe_gpus_warns_about_cuda_device_order_on_mixed_machines() -> None:
    mixed = [fake_gpu(0), fake_gpu(1, name="NVIDIA A100-SXM4-80GB", memory_total_bytes=81920 * MiB)]
    assert describe_gpus(FakeSampler(mixed), environ={}).notes
    assert not describe_gpus(FakeSampler(mixed), environ={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}).notes
    assert not describe_gpus(FakeSampler(THREE_GPUS), environ={}).notes


def test_describe_gpus_on_this_machine_never_raises() -> None:
    listing = describe_gpus()
    assert isinstance(listing.text, str) and listing.text
    json.dumps(listing.as_dict())


# --------------------------------------------------------------------------------------------------------
# Import hygiene
# --------------------------------------------------------------------------------------------------------
def test_monitor_imports_neither_torch_nor_qt_nor_pynvml() -> None:
    code = (
        "import sys; import vramlab.core.monitor as m; "
        "m.FakeSampler().sample(); m.describe_gpus(m.FakeSampler()); "
        "bad = [n for n in ('torch', 'PySide6', 'pyqtgraph', 'pynvml') if n in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
