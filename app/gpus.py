"""The GPU choices: GPUs detected on this machine (NVML, no torch, no CUDA context) first, then the catalogue."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from vramlab.core.catalog import gpus, match_gpu
from vramlab.core.spec import GpuSpec, SetupError
from vramlab.core.units import GiB

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Detection:
    """Detected GPUs as specs (memory as the driver reports it) and a line for people."""

    gpus: tuple[GpuSpec, ...]
    text: str


def detect() -> Detection:
    """Never raises: a machine without a driver gets an empty list and the reason."""
    try:
        from vramlab.core.monitor import describe_gpus

        listing = describe_gpus()
    except Exception as e:  # NVML can fail in ways the core does not foresee; detection is optional
        log.warning("GPU detection failed: %s", e)
        return Detection((), f"GPU detection failed: {e}")
    found: list[GpuSpec] = []
    for g in listing.gpus:
        if g.get("cuda_index") is None or not g.get("memory_total_bytes") or g.get("lost"):
            continue
        name = str(g.get("name") or "NVIDIA GPU")
        base = match_gpu(name) or GpuSpec(id="", name=name, memory_bytes=GiB)
        try:
            found.append(replace(base, id=f"detected-{g['cuda_index']}", name=f"{name} (cuda:{g['cuda_index']})",
                                 memory_bytes=int(g["memory_total_bytes"]), notes="detected on this machine"))
        except SetupError as e:  # a reading no GPU can have (a driver fault): not offered as a choice
            log.warning("ignoring detected GPU %s: %s", name, e)
    return Detection(tuple(found), listing.text)


def catalogue() -> tuple[GpuSpec, ...]:
    return gpus()
