"""What a live profile will run, decided before it starts: the setup checked, the device there, the GPU it
runs on, the estimate it is compared with, and the host's memory for a CPU run.

The "Live profile" tab (``app/views/live.py``) asks :func:`plan_run` and shows what it answers; the plan
is pure (no Qt, no child process), so the choices are tested without a window. A run that cannot start is
a :class:`RunRefused` whose text is the one line the tab shows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vramlab.core.checks import SetupError
from vramlab.core.live import DEFAULT_TIMEOUT_S, GpuProbe, RunRequest, predicted_for
from vramlab.core.profiling.profile import check_host_memory
from vramlab.core.result import MemoryResult
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

log = logging.getLogger(__name__)


class RunRefused(SetupError):
    """The run cannot start; the message is the whole reason, ready to show."""


@dataclass(frozen=True)
class RunPlan:
    """A run that can start, and what to say first (a warning, or nothing)."""

    request: RunRequest
    warning: str = ""


def not_profilable(e: SetupError) -> RunRefused:
    """The refusal for a setup that is not valid (the fields make none, or the model refuses it)."""
    return RunRefused(f"The setup cannot be profiled: {e}")


def gpu_spec_for(probe: GpuProbe) -> GpuSpec | None:
    """The GpuSpec of the detected GPU (core.catalog.detected_gpu: the catalogue's entry, the driver's memory)."""
    if not probe.available or not probe.name or not probe.memory_total_bytes:
        return None
    from vramlab.core.catalog import detected_gpu

    try:
        return detected_gpu(probe.name, int(probe.memory_total_bytes), 0, probe.compute_capability)
    except SetupError:  # a reading no GPU can have: no fits verdict rather than a wrong one
        return None


def plan_run(spec: ModelSpec, setup: TrainingSetup, device: str, probe: GpuProbe, chosen_gpu: GpuSpec | None, *,
             steps: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S, fault: str | None = None,
             tracked: bool = False) -> RunPlan:
    """The request for a profile of ``setup`` on ``device`` ('cuda' or 'cpu'), or :class:`RunRefused`.

    On CUDA the run is compared with the estimate on the detected GPU (the one chosen in the window when the
    detection names no card the catalogue knows); ``tracked`` (the tensor tracker) applies to CUDA only. A
    CPU run allocates every tensor for real, so it is refused when the host cannot hold them (``fault`` runs,
    the tests' injected failures, skip that check). An estimator failure does not stop a measurement: the run
    goes ahead without an estimate, and the plan's warning says so."""
    try:
        setup.validate(spec)
    except SetupError as e:
        raise not_profilable(e) from e
    if device == "cuda" and not probe.available:
        raise RunRefused(f"No NVIDIA GPU found: {probe.reason}. Choose CPU.")
    gpu = (gpu_spec_for(probe) or chosen_gpu) if device == "cuda" else None
    warning = ""
    try:
        predicted: MemoryResult | None = predicted_for(spec, setup, device, gpu)
        if device == "cpu" and not fault:
            check_host_memory(spec, setup)
    except SetupError as e:
        raise RunRefused(f"Not started: {e}") from e
    except Exception as e:  # an estimator bug must not stop a measurement
        log.exception("estimate failed before profiling")
        predicted = None
        warning = f"No estimate to compare with ({type(e).__name__}: {e}); measuring anyway."
    request = RunRequest(spec, setup, device, gpu, predicted, steps=steps, timeout_s=timeout_s, fault=fault,
                         tracked=device == "cuda" and tracked, nvml_index=probe.nvml_index)
    return RunPlan(request, warning)
