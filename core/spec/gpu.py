"""A GPU model: :class:`GpuSpec`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vramlab.core.checks import SetupError, check_float, check_int

# A GPU's memory: at least a small laptop GPU, at most far above any single device made.
MIN_GPU_BYTES = 256 * 2**20
MAX_GPU_BYTES = 64 * 2**40


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model: memory as the driver reports it (bytes) and dense bf16 peak TFLOP/s."""

    id: str
    name: str
    memory_bytes: int
    bf16_tflops: float = 0.0
    vendor: str = "nvidia"
    arch: str = ""  # e.g. ampere, ada, hopper, blackwell, cdna3
    compute_capability: str = ""
    memory_bandwidth_gbps: float = 0.0
    tier: str = ""  # consumer, workstation, datacenter
    notes: str = ""

    def __post_init__(self) -> None:
        where = f"GPU {str(self.name)[:40]!r}"
        try:
            check_int("memory_bytes", self.memory_bytes, MIN_GPU_BYTES, MAX_GPU_BYTES, "memory (bytes)")
            check_float("bf16_tflops", self.bf16_tflops, 0.0, 1e7, "bf16 TFLOP/s")
            check_float("memory_bandwidth_gbps", self.memory_bandwidth_gbps, 0.0, 1e9, "memory bandwidth")
        except SetupError as e:
            raise SetupError(f"{where}: {e}") from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SetupError(f"unknown GPU fields: {', '.join(sorted(unknown))}")
        return cls(**dict(data))
