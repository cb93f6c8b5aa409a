"""A GPU model: :class:`GpuSpec`, and the key under which two spellings of one GPU's name are equal."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vramlab.core.checks import SetupError, check_float, check_int, known_fields

# A GPU's memory: at least a small laptop GPU, at most far above any single device made.
MIN_GPU_BYTES = 256 * 2**20
MAX_GPU_BYTES = 64 * 2**40
# Words that name a vendor or a product line rather than a GPU: "NVIDIA GeForce RTX 4090" (the driver),
# "GeForce RTX 4090" (the catalogue) and "rtx 4090" (a user) are one GPU.
VENDOR_WORDS = ("nvidia", "geforce", "tesla", "amd", "radeon", "instinct")


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

    def capability(self) -> tuple[int, int] | None:
        """(major, minor) of the compute capability, None where unknown (an AMD GPU's gfx name too)."""
        major, _, minor = self.compute_capability.partition(".")
        return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuSpec:
        return cls(**known_fields(cls, data, "GPU"))


def gpu_key(name: str) -> str:
    """A GPU's name without vendor words, the app's "(cuda:N)" suffix, case and punctuation. Two names
    are the same GPU exactly when their keys are equal: an A10 is not an A100, 4GB is not the H100 NVL."""
    name = re.sub(r"\s*\(cuda:\d+\)\s*$", "", str(name).lower())
    words = [w for w in re.split(r"[^0-9a-z.]+", name) if w and w not in VENDOR_WORDS]
    return "".join(words)
