"""The answer every level gives: peak memory at three levels, what is alive at the peak, phase peaks.

The estimate, the simulation and a real profile all return a :class:`MemoryResult`, so views, reports and
tests compare them field by field. All numbers are bytes per GPU.

Levels (see docs/levels.md):

* ``peak_allocated_bytes`` — live tensor bytes at the peak (``torch.cuda.max_memory_allocated``);
  ``components`` splits exactly this number by :class:`Kind`.
* ``peak_reserved_bytes`` — what the caching allocator holds then (``max_memory_reserved``): tensors plus
  block rounding, split-block slack and fragmentation.
* ``device_used_bytes`` — what ``nvidia-smi`` shows: reserved plus the CUDA context, library workspaces,
  NCCL buffers and managed (paged) optimizer memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from vramlab.core.kinds import KIND_ORDER, Kind, LiveTensor, Phase, parse_phase_key
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup


class Level(StrEnum):
    ESTIMATE = "estimate"
    SIMULATE = "simulate"
    PROFILE = "profile"


class MemLevel(StrEnum):
    """Which memory a number is: shown beside every number in the UI."""

    ALLOCATED = "allocated"
    RESERVED = "reserved"
    DEVICE = "device"

    @property
    def label(self) -> str:
        return {
            MemLevel.ALLOCATED: "Tensor peak (max_memory_allocated)",
            MemLevel.RESERVED: "Allocator reserved (max_memory_reserved)",
            MemLevel.DEVICE: "Device used (nvidia-smi)",
        }[self]

    @property
    def short(self) -> str:
        return {MemLevel.ALLOCATED: "tensors", MemLevel.RESERVED: "reserved", MemLevel.DEVICE: "device"}[self]


@dataclass(frozen=True)
class PhasePeak:
    """The highest live-tensor moment of one phase of one step, with its breakdown."""

    key: str  # 'load', 'forward@1', 'backward@2', 'optimizer@1'
    bytes: int
    components: Mapping[Kind, int]

    @property
    def phase(self) -> Phase:
        return parse_phase_key(self.key)[0]

    @property
    def step(self) -> int:
        return parse_phase_key(self.key)[1]


@dataclass(frozen=True)
class Overhead:
    """A named amount above the tensor level, with the level it belongs to and why."""

    name: str
    bytes: int
    level: MemLevel
    why: str


@dataclass(frozen=True)
class MemoryResult:
    level: Level
    model: ModelSpec
    setup: TrainingSetup
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int
    components: Mapping[Kind, int]
    peak_phase: str
    phases: tuple[PhasePeak, ...]
    total_params: int
    trainable_params: int
    overheads: tuple[Overhead, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    alive_at_peak: tuple[LiveTensor, ...] = ()
    gpu: GpuSpec | None = None
    calibration: str = ""  # "calibrated on <GPU>" when measured overheads were used
    # where the tensor-level step came from: "hand-written" (the estimator's program), "simulated (built-in
    # builder)", "simulated (transformers + peft)", "measured"
    source: str = ""
    timing: Mapping[str, float] = field(default_factory=dict)
    timeline: tuple[tuple[int, int], ...] = ()  # (event, live bytes), simulate/profile only
    phase_marks: tuple[tuple[int, str], ...] = ()

    # ---- derived ---------------------------------------------------------------------------------------
    def bytes_at(self, level: MemLevel) -> int:
        return {
            MemLevel.ALLOCATED: self.peak_allocated_bytes,
            MemLevel.RESERVED: self.peak_reserved_bytes,
            MemLevel.DEVICE: self.device_used_bytes,
        }[level]

    def phase_peak(self, phase: Phase) -> int:
        """The highest peak of a phase over all steps (0 if the phase did not occur)."""
        return max((p.bytes for p in self.phases if p.phase is phase), default=0)

    def phase_summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ph in Phase:
            v = self.phase_peak(ph)
            if v or ph is Phase.LOAD:
                out[ph.value] = v
        return out

    def fits(self, gpu: GpuSpec | None = None, level: MemLevel = MemLevel.DEVICE) -> bool | None:
        gpu = gpu or self.gpu
        if gpu is None:
            return None
        return self.bytes_at(level) <= gpu.memory_bytes

    def headroom_bytes(self, gpu: GpuSpec | None = None, level: MemLevel = MemLevel.DEVICE) -> int | None:
        gpu = gpu or self.gpu
        if gpu is None:
            return None
        return gpu.memory_bytes - self.bytes_at(level)

    def ordered_components(self) -> list[tuple[Kind, int]]:
        return [(k, self.components.get(k, 0)) for k in KIND_ORDER if self.components.get(k, 0)]

    def models_versions(self) -> dict[str, Any]:
        """The library versions whose behaviour this result models (:mod:`vramlab.core.versions`): the hand-written
        program's release, or the installed one that a trace, ``simulate --hf`` or a profile ran; ``installed``
        lists the libraries whose installed version differs."""
        from vramlab.core.spec.hub_kernels import runs as hub_runs
        from vramlab.core.spec.unsloth_gc import unsloth_gc_runs
        from vramlab.core.versions import (
            differing,
            hub_versions,
            kernel_versions,
            liger_versions,
            modelled_by,
            offload_versions,
            unsloth_gc_versions,
            unsloth_versions,
        )

        models, by = modelled_by(self.source or ("measured" if self.level is Level.PROFILE else ""))
        out: dict[str, Any] = {**models, "by": by}
        other = differing(models)
        if other:
            out["installed"] = other
        kernel = kernel_versions(self.setup.loss_kernel.value)  # a loss kernel: its release's source, everywhere
        if kernel:
            out["loss_kernel"] = kernel
        liger = liger_versions(self.setup.liger_kernels)  # Liger's RMSNorm / GLU kernels: written from its source
        if liger:
            out["liger_kernels"] = liger
        unsloth = unsloth_versions(self.setup.unsloth_kernels)  # Unsloth's fused LoRA kernels: from its source
        if unsloth:
            out["unsloth_kernels"] = unsloth
        if gc := unsloth_gc_versions(unsloth_gc_runs(self.setup)):  # Unsloth's checkpointing, from its source
            out["unsloth_gc"] = gc
        if hub_runs(self.setup):  # transformers' Hub kernels: the kernels library and repo read
            out["hub_kernels"] = hub_versions()
        offloading = offload_versions(self.setup.offload_activations.value)  # TRL's hooks: written from its source
        if offloading:
            out["activation_offloading"] = offloading
        return out

    # ---- serialisation ------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object of the CLI contract."""
        out: dict[str, Any] = {
            "level": self.level.value,
            "source": self.source or ("measured" if self.level is Level.PROFILE else ""),
            "model": self.model.id,
            "model_name": self.model.name,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_used_bytes": self.device_used_bytes,
            "components": {k.value: int(v) for k, v in self.ordered_components()},
            "peak_phase": self.peak_phase,
            "phases": self.phase_summary(),
            "phase_steps": {p.key: p.bytes for p in self.phases},
            "phase_components": {p.key: {k.value: int(v) for k, v in p.components.items() if v}
                                 for p in self.phases},
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "overheads": [{"name": o.name, "bytes": o.bytes, "level": o.level.value, "why": o.why}
                          for o in self.overheads],
            "setup": self.setup.resolved(),
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "models_versions": self.models_versions(),
        }
        if self.gpu is not None:
            out["gpu"] = {"id": self.gpu.id, "name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes,
                          "fits": self.fits(), "headroom_bytes": self.headroom_bytes()}
        if self.calibration:
            out["calibration"] = self.calibration
        from vramlab.core.vision import token_counts

        vision = token_counts(self.model, self.setup)
        if vision is not None:  # a vision-language model: what one sample is to the tower and the language model
            out["vision"] = vision
        if self.alive_at_peak:
            out["alive_at_peak"] = [
                {"bytes": a.nbytes, "kind": a.kind.value, "label": a.label, "shape": list(a.shape),
                 "dtype": a.dtype, "created_in": a.created_in} for a in self.alive_at_peak
            ]
        if self.timing:
            out["timing_s"] = dict(self.timing)
        return out

