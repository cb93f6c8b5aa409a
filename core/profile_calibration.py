"""The calibration a finished CUDA profile gives: its measured context, and its allocator slack against the
slack the allocator replay models for the same setup (:mod:`vramlab.core.calibration` keeps it; the estimate
reads it back). Above the estimate, which it runs, and beside the profile, whose outcome it reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.calibration import Calibration, from_profile
from vramlab.core.estimate import estimate
from vramlab.core.levels import allocator_slack
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

if TYPE_CHECKING:
    from vramlab.core.profiling.profile import ProfileOutcome


def from_outcome(spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None, outcome: ProfileOutcome,
                 driver: str = "") -> Calibration | None:
    """The calibration a finished CUDA profile gives (None when it measured no context): its context, and
    its allocator slack against the slack the allocator replay models for the same setup, uncalibrated.
    Replays the step (20-400 ms): callers with a window run it off the GUI thread."""
    r = outcome.result
    if not outcome.ok or outcome.device != "cuda" or not outcome.context_bytes or r is None:
        return None
    modelled = estimate(spec, setup, gpu, allocator=True, calibration=None)
    name = outcome.info.get("gpu") or (gpu.name if gpu is not None else "GPU")
    return from_profile(name, outcome.context_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes,
                        allocator_slack(modelled), torch=outcome.info.get("torch", ""),
                        driver=driver or outcome.info.get("driver", ""))
