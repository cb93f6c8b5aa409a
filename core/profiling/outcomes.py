"""What a profile returns: how it ended (:class:`OutcomeKind`), the outcome of one process
(:class:`ProfileOutcome`) and of a sharded run (:class:`DistributedOutcome`), and the outcome read from a
child's last event line (:func:`read_outcome`).

The records sit below the launchers (:mod:`.profile`, :mod:`.distributed`) so that whoever shows or keeps an
outcome (the report, the live view, a calibration) imports them without importing a launcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from vramlab.core.kinds import Kind, LiveTensor
from vramlab.core.result import Level, MemLevel, MemoryResult, Overhead, PhasePeak
from vramlab.core.sdpa import FLASH, cuda_choice, mismatch_note
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

if TYPE_CHECKING:
    from vramlab.core.monitor.watch import RunWatch

EventCallback = Callable[[dict[str, Any]], None]

class OutcomeKind(StrEnum):
    """How a profile run ended (the child's ``failure`` events name these; ``--json`` prints the value)."""

    OK = "ok"
    OOM = "oom"  # out of memory: a result for the user (the setup does not fit), not an error of ours
    ERROR = "error"
    CRASHED = "crashed"  # the child died (a signal, a driver fault) without saying why
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    NO_GPU = "no_gpu"  # CUDA was asked for and is not there

    @classmethod
    def read(cls, value: Any) -> OutcomeKind:
        """A kind from a child's event; anything unknown is an error (never a silent success)."""
        try:
            return cls(value)
        except ValueError:
            return cls.ERROR

@dataclass
class ProfileOutcome:
    """What a profile run produced: a result, or a failure with the phase and memory where it happened."""

    ok: bool
    kind: OutcomeKind
    message: str
    device: str
    result: MemoryResult | None = None
    info: dict[str, Any] = field(default_factory=dict)
    failed_phase: str | None = None
    memory_at_failure: int | None = None
    device_used_peak_bytes: int | None = None
    process_used_peak_bytes: int | None = None
    device_delta_peak_bytes: int | None = None  # the whole GPU's peak used less its used before the run
    context_bytes: int | None = None
    context_source: str | None = None  # "process" (NVML matched the run's PID) or "whole-GPU delta"
    requested_peak_bytes: int | None = None  # torch.cuda.memory_stats()["requested_bytes.all.peak"]
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kind = OutcomeKind.read(self.kind)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object: the measured result's keys of the CLI contract (``peak_allocated_bytes``,
        ``components``, ``phases``, ... as ``estimate`` prints them; absent when the run failed) and beside
        them what only a profile has: the outcome, NVML readings, the CUDA context, speed, environment."""
        out: dict[str, Any] = self.result.to_json() if self.result is not None else {}
        out |= {
            "ok": self.ok, "kind": self.kind.value, "message": self.message, "device": self.device,
            "failed_phase": self.failed_phase, "memory_at_failure_bytes": self.memory_at_failure,
            "device_used_peak_bytes": self.device_used_peak_bytes,
            "process_used_peak_bytes": self.process_used_peak_bytes,
            "device_delta_peak_bytes": self.device_delta_peak_bytes, "context_bytes": self.context_bytes,
            "context_source": self.context_source, "requested_peak_bytes": self.requested_peak_bytes,
            "tokens_per_s": self.tokens_per_s, "step_time_s": self.step_time_s, "environment": self.info,
        }
        return out


@dataclass
class DistributedOutcome(ProfileOutcome):
    """A sharded run: ``result`` is the rank with the highest tensor peak; ``ranks[r]`` is rank r's own
    outcome (its MemoryResult, phases, failure); ``failed_rank`` names the rank a failure started on."""

    world_size: int = 0
    backend: str = ""
    ranks: list[ProfileOutcome] = field(default_factory=list)
    failed_rank: int | None = None
    stderr_tail: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out.update({"world_size": self.world_size, "backend": self.backend, "failed_rank": self.failed_rank,
                    "ranks": [{"rank": r, **o.to_json()} for r, o in enumerate(self.ranks)]})
        return out


def with_watch_info(outcome: ProfileOutcome, watch: RunWatch | None, cuda_index: int) -> ProfileOutcome:
    """What only the parent knows about the run's GPU (NVML): the driver (for a calibration) and how
    NVML readings went."""
    if watch is None:
        return outcome
    extra: dict[str, Any] = {}
    gpu = watch.gpu(cuda_index)
    if gpu is not None:
        extra["driver"] = gpu.driver_version or ""
        extra["nvml_gpu_uuid"] = gpu.uuid
    if watch.errors:
        extra["nvml_errors"] = watch.errors
        extra["nvml_last_error"] = watch.last_error
    if not extra:
        return outcome
    return dataclasses.replace(outcome, info={**outcome.info, **extra})


def read_outcome(spec: ModelSpec, setup: TrainingSetup, device: str, gpu: GpuSpec | None,
                 final: dict[str, Any],
                 lines: list[dict[str, Any]], watch: dict[str, Any]) -> ProfileOutcome:
    """The outcome a child's last line (``result`` or ``failure``) tells, with its events and the parent's NVML
    ``watch`` readings (a :meth:`~vramlab.core.monitor.watch.RunWatch.stop` entry)."""
    if final["event"] == "failure":
        return ProfileOutcome(False, final.get("kind", "error"), final.get("message", ""), device,
                              info=final.get("info", {}), failed_phase=final.get("phase"),
                              memory_at_failure=final.get("allocated_at_failure"), events=lines, **watch)
    info = final.get("info", {})
    tracked = final.get("tracked")
    phases_raw = final.get("phases") or {}
    if device == "cuda":
        phases = tuple(PhasePeak(k, int(v["allocated"]), {}) for k, v in phases_raw.items())
    else:
        phases = tuple(PhasePeak(k, int(v), {Kind(kk): vv for kk, vv in tracked["phase_kinds"].get(k, {}).items()})
                       for k, v in tracked["phases"].items())
    components: dict[Kind, int] = {}
    alive: tuple[LiveTensor, ...] = ()
    if tracked:
        components = {Kind(k): int(v) for k, v in tracked["kinds"].items()}
        alive = tuple(LiveTensor(t[0], Kind(t[1]), t[2], tuple(t[3]), t[4], t[5]) for t in tracked["top"])
    peak = int(final["peak_allocated_bytes"])
    reserved = int(final["peak_reserved_bytes"])
    requested = final.get("peak_requested_bytes")
    peak_phase = max(phases, key=lambda p: p.bytes).key if phases else "load"
    overheads: list[Overhead] = []
    device_used = reserved
    context = watch.get("context_bytes")
    if context is not None:
        overheads.append(Overhead("CUDA context (measured)", context, MemLevel.DEVICE, "NVML: the run's own memory "
                                  "at its end, read while it waited (nothing moving), less its allocator's "
                                  "memory_reserved() (cuBLAS workspaces included there)."))
    if watch.get("process_used_peak_bytes"):
        device_used = int(watch["process_used_peak_bytes"])
    elif watch.get("device_delta_peak_bytes"):  # no process matched by PID (a container): the whole GPU's delta
        device_used = max(reserved, int(watch["device_delta_peak_bytes"]))
    elif device != "cuda" and final.get("max_rss_bytes"):
        overheads.append(Overhead("Process resident memory (RSS)", int(final["max_rss_bytes"]), MemLevel.DEVICE,
                                  "No GPU: the run's peak resident memory on the CPU."))
    notes = [f"measured on {info.get('gpu', device)}"]
    if info.get("quantization"):
        notes.append(f"quantized layers and 8-bit optimizer: {info['quantization']}")
    ran = info.get("sdpa_backend")
    if ran:
        notes.append(f"SDPA kernel: {ran} ({info.get('sdpa_inputs', '')}); predicted {info.get('sdpa_predicted')}: "
                     f"{info.get('sdpa_predicted_reason', '')}")
        mismatch = mismatch_note(modelled_kernel(spec, setup, device, info), ran)
        if mismatch:
            notes.append(mismatch)
    if device == "cuda" and not watch.get("process_used_peak_bytes"):
        if watch.get("device_delta_peak_bytes"):
            notes.append("NVML listed no process under the run's PID (a container's PID namespace): the device "
                         "level is the whole GPU's used less what it used before the run")
        else:
            notes.append("NVML listed no per-process memory for the run: the device level shown is the allocator's "
                         "reserved level")
    timing = final.get("timing", {})
    step_time = sum(v for k, v in timing.items() if k.endswith("@2"))
    # the measured step runs at most two micro-batches (see step.run_steps), whatever grad_accum says
    tokens = setup.micro_batch * setup.seq_len * min(setup.grad_accum, 2)
    result = MemoryResult(
        level=Level.PROFILE, model=spec, setup=setup, peak_allocated_bytes=peak, peak_reserved_bytes=reserved,
        device_used_bytes=device_used, components=components or {Kind.TEMPORARIES: 0}, peak_phase=peak_phase,
        phases=phases, total_params=int(final.get("total_params", 0)),
        trainable_params=int(final.get("trainable_params", 0)), overheads=tuple(overheads),
        warnings=tuple(setup.warnings(spec)), alive_at_peak=alive, gpu=gpu, timing=timing,
        notes=tuple(notes),
    )
    return ProfileOutcome(True, OutcomeKind.OK, "", device, result=result, info=info, events=lines,
                          step_time_s=step_time or None, tokens_per_s=(tokens / step_time) if step_time else None,
                          requested_peak_bytes=int(requested) if requested is not None else None, **watch)


def modelled_kernel(spec: ModelSpec, setup: TrainingSetup, device: str, info: dict[str, Any]) -> str:
    """The SDPA kernel the estimate modelled for the run (on its GPU, with the run's torch): a CPU run's
    simulation models CPU flash; a CUDA run takes :func:`vramlab.core.sdpa.cuda_choice`."""
    if device != "cuda":
        return FLASH
    cc = info.get("capability")
    choice = cuda_choice(spec, setup, tuple(cc) if cc else None, torch_version=info.get("torch") or None)
    return choice.backend if choice is not None else FLASH
