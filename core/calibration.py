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
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .fileio import write_json

FILE = "calibration.json"


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

    @property
    def label(self) -> str:
        return f"calibrated on {self.gpu_name}" + (f" ({self.date})" if self.date else "")


def _norm(name: str) -> str:
    """The catalogue's GPU key (:func:`~vramlab.core.catalog.gpu_key`): the driver's "NVIDIA GeForce RTX 4090"
    and the catalogue's "GeForce RTX 4090" are one GPU, an A10 is not an A100."""
    from .catalog import gpu_key

    return gpu_key(name)


def load_all(path: Path | None = None) -> dict[str, Calibration]:
    path = path or config_dir() / FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for key, item in data.items() if isinstance(data, dict) else ():
        try:
            out[key] = Calibration(**item)
        except TypeError:
            continue  # a field from a newer version: ignore that entry rather than fail
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
    ratio = min(max(ratio, 0.25), 4.0)  # one profile is one sample: keep the correction within reason
    return Calibration(gpu_name, int(context_bytes), float(ratio), torch, driver, dt.date.today().isoformat())
