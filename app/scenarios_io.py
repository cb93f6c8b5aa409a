"""Scenario files: the comparison saved as JSON, and read back with clear messages when a file is wrong.

Format (version 1)::

    {"format": "vramlab-scenarios", "version": 1, "vramlab": "0.1.0", "gpu": "rtx-4090",
     "scenarios": [{"name": "LoRA - BF16", "model": "llama-2-7b", "follows_preset": null,
                    "setup": {... TrainingSetup.to_dict() ...}}]}

``model`` is a preset id or the path of an imported config.json / model folder; ``setup`` is the core's
:meth:`~vramlab.core.spec.training.TrainingSetup.to_dict` dictionary (exact; files with the resolved form also load).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vramlab.app.state import ModelChoice, Scenario, load_model
from vramlab.core import __version__
from vramlab.core.checks import SetupError
from vramlab.core.fileio import FileProblem, read_json_file, write_json
from vramlab.core.spec.edits import repair_setup_fields
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.presets import precision_preset
from vramlab.core.spec.training import TrainingSetup

FORMAT = "vramlab-scenarios"
VERSION = 1

ScenarioTuple = tuple[str, ModelChoice, TrainingSetup, str | None]


class ScenarioFileError(ValueError):
    """A scenario file that cannot be used; the message names the file and what is wrong."""


def to_dict(scenarios: Iterable[Scenario], gpu: GpuSpec | None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "vramlab": __version__,
        "gpu": gpu.id if gpu else None,
        "scenarios": [
            {"name": s.name, "model": s.model.ref, "model_name": s.model.spec.name,
             "follows_preset": s.follows, "setup": s.setup.to_dict()}
            for s in scenarios
        ],
    }


def from_dict(data: Any, where: str = "scenario file",
              problems: list[str] | None = None) -> tuple[list[ScenarioTuple], str | None]:
    """(name, model, setup, follows) tuples and the GPU id. Raises ScenarioFileError.

    A file the user opens is refused whole at its first bad value (nothing changes; the message says what to
    fix). With ``problems`` (the window's own saved scenarios, read at start) a bad setup value is replaced
    by its default and reported there instead, with the same rules (:func:`repair_setup_fields`). A row that
    follows a precision preset is derived again from the current setup when shown, so its stored setup is
    taken as it is, even where the core refuses it (the comparison shows that row's reason)."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise ScenarioFileError(f"{where} is not a VRAM Lab scenario file (expected \"format\": \"{FORMAT}\")")
    version = data.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise ScenarioFileError(f"{where} has version {version!r}; this VRAM Lab reads version {VERSION}")
    items = data.get("scenarios")
    if not isinstance(items, list) or not items:
        raise ScenarioFileError(f"{where} holds no scenarios")
    models: dict[str, ModelChoice] = {}
    out: list[ScenarioTuple] = []
    for i, item in enumerate(items, 1):
        label = f"{where}, scenario {i}"
        if not isinstance(item, Mapping):
            raise ScenarioFileError(f"{label}: expected an object")
        name = str(item.get("name") or f"Scenario {i}").strip()
        label = f"{where}, scenario {i} ({name!r})"
        ref = item.get("model")
        if not isinstance(ref, str) or not ref:
            raise ScenarioFileError(f"{label}: no \"model\" (a preset id or a config.json path)")
        try:
            model = models.get(ref) or load_model(ref)
        except SetupError as e:
            raise ScenarioFileError(f"{label}: {e}") from e
        models[ref] = model
        setup_data = item.get("setup")
        if not isinstance(setup_data, Mapping):
            raise ScenarioFileError(f"{label}: no \"setup\" object")
        follows = _known_preset(item.get("follows_preset"))
        if follows is not None:  # derived again from the current setup when shown: it may be one the core refuses
            try:  # (Full with Cut Cross Entropy: fp32 weights), which the comparison shows with its reason
                out.append((name, model, TrainingSetup.from_dict(setup_data), follows))
                continue
            except (SetupError, ValueError, TypeError):
                pass  # values that make no setup at all: checked as a pinned one's below
        if problems is not None:
            fields, bad = repair_setup_fields(setup_data, model=model.spec, where=label)
            problems.extend(bad)
            setup_data = fields
        try:
            setup = TrainingSetup.from_dict(setup_data)
            setup.validate(model.spec)
        except (SetupError, ValueError, TypeError) as e:
            raise ScenarioFileError(f"{label}: {e}") from e
        out.append((name, model, setup, follows))
    gpu = data.get("gpu")
    return out, gpu if isinstance(gpu, str) else None


def _known_preset(follows: Any) -> str | None:
    if follows is None:
        return None
    try:
        return precision_preset(str(follows)).id
    except SetupError:
        return None


def save(path: str | Path, scenarios: Iterable[Scenario], gpu: GpuSpec | None) -> None:
    """Written to a temporary file and renamed: a failed save leaves the old file whole."""
    write_json(path, to_dict(scenarios, gpu))


def load(path: str | Path) -> tuple[list[ScenarioTuple], str | None]:
    p = Path(path)
    try:
        data = read_json_file(p)
    except FileProblem as e:
        raise ScenarioFileError(str(e)) from e
    return from_dict(data, p.name)
