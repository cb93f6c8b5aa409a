"""Per-machine calibration: what a real profile measured of the runtime, kept for later estimates.

The tensor level needs no calibration (it is the model's own arithmetic); the outer levels do: the CUDA
context depends on the driver, the GPU and the torch build, and the allocator's slack on the allocator
version and settings. After a profile on a GPU, its measured context and the ratio of measured to
modelled allocator slack are saved; estimates for the same GPU then use them and say
"calibrated on <GPU>".

Stored as JSON in the user's configuration folder (``VRAMLAB_CONFIG_DIR`` overrides it, e.g. in tests).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vramlab.core.profiling.outcomes import ProfileOutcome
    from vramlab.core.spec import GpuSpec, ModelSpec, TrainingSetup

from vramlab.core.fileio import FileProblem, read_json_file, write_json

FILE = "calibration.json"
MAX_CONTEXT_BYTES = 16 * 2**30  # a CUDA context is hundreds of MiB; 16 GiB is far above any measured
MIN_RATIO, MAX_RATIO = 0.25, 4.0  # one profile is one sample: the correction stays within reason
log = logging.getLogger(__name__)


def config_dir() -> Path:
    override = os.environ.get("VRAMLAB_CONFIG_DIR")
    if override:
        return Path(override)
    if sys.platform == "win32":
        return Path(os.environ.get("APPDATA", Path.home())) / "VRAM Lab"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "VRAM Lab"
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "vramlab"


@dataclass(frozen=True)
class Calibration:
    gpu_name: str
    context_bytes: int  # measured CUDA context of a training process
    slack_ratio: float  # measured (reserved - allocated) / modelled, at the peak
    torch: str = ""
    driver: str = ""
    date: str = ""

    def __post_init__(self) -> None:
        """A calibration is data from a file: a negative or absurd context, a NaN ratio or a name that is not
        text would give a wrong device level, so it is refused (ValueError) with the reason."""
        if not isinstance(self.gpu_name, str) or not self.gpu_name.strip():
            raise ValueError(f"gpu_name must be a GPU's name (got {self.gpu_name!r:.40})")
        if isinstance(self.context_bytes, bool) or not isinstance(self.context_bytes, int) \
                or not 0 <= self.context_bytes <= MAX_CONTEXT_BYTES:
            raise ValueError(f"context_bytes must be a whole number from 0 to {MAX_CONTEXT_BYTES:,} "
                             f"(got {self.context_bytes!r:.40})")
        ratio = self.slack_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) \
                or not MIN_RATIO <= ratio <= MAX_RATIO:  # also false for NaN
            raise ValueError(f"slack_ratio must be a number from {MIN_RATIO} to {MAX_RATIO} (got {ratio!r:.40})")
        for name in ("torch", "driver", "date"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be text")

    @property
    def label(self) -> str:
        return f"calibrated on {self.gpu_name}" + (f" ({self.date})" if self.date else "")


def _norm(name: str) -> str:
    """The catalogue's GPU key (:func:`~vramlab.core.catalog.gpu_key`): the driver's "NVIDIA GeForce RTX 4090"
    and the catalogue's "GeForce RTX 4090" are one GPU, an A10 is not an A100."""
    from vramlab.core.catalog import gpu_key

    return gpu_key(name)


def load_all(path: Path | None = None) -> dict[str, Calibration]:
    """Every valid calibration in the file. A damaged file or entry is ignored with a warning (logged): an
    estimate then uses the modelled context, never a wrong measured one, and never fails for it."""
    path = path or config_dir() / FILE
    if not path.exists():
        return {}
    try:
        data = read_json_file(path, max_bytes=2**20)
    except FileProblem as e:
        log.warning("calibration ignored: %s", e)
        return {}
    if not isinstance(data, dict):
        log.warning("calibration ignored: %s holds no calibrations (expected an object)", path.name)
        return {}
    out = {}
    for key, item in data.items():
        try:
            if not isinstance(item, dict):
                raise ValueError("expected an object")
            out[key] = Calibration(**item)
        except (TypeError, ValueError) as e:  # a damaged entry, or a field from a newer version
            log.warning("calibration %r in %s ignored: %s", str(key)[:40], path.name, str(e).splitlines()[0])
    return out


def for_gpu(gpu_name: str, path: Path | None = None) -> Calibration | None:
    """The calibration saved for this GPU model (the same name without vendor words), or None. Matching is
    exact on purpose: an A10's calibration says nothing about an A100, nor an L4's about an L40S."""
    target = _norm(gpu_name)
    if not target:
        return None
    for cal in load_all(path).values():
        if _norm(cal.gpu_name) == target:
            return cal
    return None


def save(cal: Calibration, path: Path | None = None) -> Path:
    path = path or config_dir() / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {k: asdict(v) for k, v in load_all(path).items()}
    data[_norm(cal.gpu_name)] = asdict(cal)
    return write_json(path, data)  # atomic: a crash never leaves a half-written file


def from_profile(gpu_name: str, context_bytes: int, measured_allocated: int, measured_reserved: int,
                 modelled_slack: int, torch: str = "", driver: str = "") -> Calibration:
    slack = max(0, measured_reserved - measured_allocated)
    ratio = slack / modelled_slack if modelled_slack > 0 else 1.0
    ratio = min(max(ratio, MIN_RATIO), MAX_RATIO)  # one profile is one sample: keep the correction within reason
    return Calibration(gpu_name, int(context_bytes), float(ratio), torch, driver, dt.date.today().isoformat())


def from_outcome(spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None, outcome: ProfileOutcome,
                 driver: str = "") -> Calibration | None:
    """The calibration a finished CUDA profile gives (None when it measured no context): its context, and
    its allocator slack against the slack the allocator replay models for the same setup, uncalibrated.
    Replays the step (20-400 ms): callers with a window run it off the GUI thread."""
    from vramlab.core.estimate import estimate
    from vramlab.core.levels import allocator_slack

    r = outcome.result
    if not outcome.ok or outcome.device != "cuda" or not outcome.context_bytes or r is None:
        return None
    modelled = estimate(spec, setup, gpu, allocator=True, calibration=None)
    name = outcome.info.get("gpu") or (gpu.name if gpu is not None else "GPU")
    return from_profile(name, outcome.context_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes,
                        allocator_slack(modelled), torch=outcome.info.get("torch", ""),
                        driver=driver or outcome.info.get("driver", ""))
