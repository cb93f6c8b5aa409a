"""Hardware monitoring: GPU readings behind a protocol, with a real and a fake implementation.

- :class:`GpuSampler` (protocol): ``available()``, ``reason()``, ``devices()``, ``sample()``, ``close()``.
- :class:`NvmlSampler`: NVIDIA GPUs via NVML; every NVML call goes through :func:`nvml_query`.
- :class:`FakeSampler`: deterministic readings with named fault :class:`Scenario` values.
- :func:`visible_devices`, :func:`describe_gpus`, :func:`cuda_available_without_context`: which GPUs a
  CUDA process would see, from NVML alone.

Pure Python: this package imports neither Qt nor torch, and imports ``pynvml`` only when an
``NvmlSampler`` first needs it.
"""

from vramlab.core.monitor.detect import (
    GpuListing,
    cuda_available_without_context,
    describe_gpus,
    parse_cuda_visible_devices,
    resolve_visible_devices,
    visible_devices,
)
from vramlab.core.monitor.fake import FakeSampler, Scenario, fake_gpu
from vramlab.core.monitor.nvml import NvmlSampler, nvml_query
from vramlab.core.monitor.types import (
    GpuInfo,
    GpuReading,
    GpuSampler,
    NotAvailable,
    ProcessMemory,
    Sample,
    Unavailable,
)

__all__ = [
    "FakeSampler",
    "GpuInfo",
    "GpuListing",
    "GpuReading",
    "GpuSampler",
    "NotAvailable",
    "NvmlSampler",
    "ProcessMemory",
    "Sample",
    "Scenario",
    "Unavailable",
    "cuda_available_without_context",
    "describe_gpus",
    "fake_gpu",
    "nvml_query",
    "parse_cuda_visible_devices",
    "resolve_visible_devices",
    "visible_devices",
]
