"""Model and GPU presets shipped in ``resources/``, and resolution of what a user names.

A model argument is a preset id (``llama-2-7b``), a preset's display name, a path to a HF
``config.json``, a local model folder (see :mod:`vramlab.core.importer`), or a Hugging Face Hub id
``org/name[@revision]`` (see :mod:`vramlab.core.sources.hub`; a local path of the same spelling wins).
A GPU argument is a preset id or a name; a memory size such as ``24GiB`` makes a custom GPU.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .spec import GpuSpec, ModelSpec, SetupError
from .units import parse_size


@dataclass(frozen=True)
class ModelEntry:
    spec: ModelSpec
    source: str  # "preset" or the path it was imported from (a Hub model: its cache snapshot folder)
    warnings: tuple[str, ...] = ()
    tensor_params: int | None = None
    origin: str = ""  # a Hub model: repository, commit, and whether the network was used
    adapter: Mapping[str, Any] | None = None  # a Hub adapter repo: its adapter_config.json (the spec is the base)


def _resource_text(name: str) -> str:
    return resources.files("vramlab.resources").joinpath(name).read_text(encoding="utf-8")


@functools.cache
def models() -> tuple[ModelSpec, ...]:
    data = json.loads(_resource_text("models.json"))
    return tuple(ModelSpec.from_dict(m) for m in data["models"])


@functools.cache
def gpus() -> tuple[GpuSpec, ...]:
    data = json.loads(_resource_text("gpus.json"))
    return tuple(GpuSpec.from_dict(g) for g in data["gpus"])


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "", text.lower())


def find_model(name: str) -> ModelSpec | None:
    key = _norm(name)
    for m in models():
        if _norm(m.id) == key or _norm(m.name) == key:
            return m
    return None


def resolve_model(arg: str, *, network: bool = True) -> ModelEntry:
    """A preset, a local config.json / model folder, or a Hub id. Raises SetupError with suggestions.

    ``network=False`` refuses a Hub id that is not in the local cache instead of looking it up (the window
    looks those up on a worker thread)."""
    preset = find_model(arg)
    if preset is not None:
        return ModelEntry(preset, "preset")
    path = Path(arg).expanduser()
    if not path.exists() and not arg.endswith(".json"):
        from .sources.hub import parse_hub_id

        ref = parse_hub_id(arg)
        if ref is not None:
            try:
                return hub_entry(ref, network=network)
            except SetupError as e:
                if path.parent != Path(".") and path.parent.is_dir():  # likely a mistyped local folder
                    raise SetupError(f"{e}; nor is there a local folder {path}") from e
                raise
    looks_like_path = path.exists() or "/" in arg or "\\" in arg or arg.endswith(".json")
    if looks_like_path:
        from .importer import load_model_source

        imported = load_model_source(path)
        return ModelEntry(imported.spec, str(path), imported.warnings, imported.tensor_params)
    close = difflib.get_close_matches(arg.lower(), [m.id for m in models()], n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else " See `vramlab estimate --list-models`."
    raise SetupError(f"unknown model {arg!r}: not a preset id, config.json or model folder.{hint}")


def hub_entry(ref: Any, *, network: bool = True, **lookup: Any) -> ModelEntry:
    """A Hub model (``ref``: a HubRef or an id) as a ModelEntry; ``lookup`` goes to ``load_hub_model``
    (progress, cancelled). ``network=False`` reads only the local caches."""
    import dataclasses

    from .sources.hub import HubSettings, load_hub_model

    settings = HubSettings.from_env()
    if not network and not settings.offline:
        settings = dataclasses.replace(settings, offline=True, offline_reason="only the local caches are read here")
    model = load_hub_model(ref, settings=settings, **lookup)
    imported = model.imported
    return ModelEntry(imported.spec, model.snapshot, imported.warnings, imported.tensor_params,
                      origin=model.origin, adapter=model.adapter)


def find_gpu(name: str) -> GpuSpec:
    """A GPU preset by id or name, or a custom GPU from a size ('24GiB', '80GB')."""
    key = _norm(name)
    for g in gpus():
        if _norm(g.id) == key or _norm(g.name) == key:
            return g
    candidates = [g for g in gpus() if key and (key in _norm(g.name) or key in _norm(g.id))]
    if len(candidates) == 1:
        return candidates[0]
    try:
        size = parse_size(name)
    except ValueError:
        size = 0
    if size >= 2**30:
        return GpuSpec(id=f"custom-{size}", name=f"Custom GPU ({name})", memory_bytes=size)
    options = ", ".join(g.id for g in candidates[:6]) if candidates else "see `vramlab estimate --list-gpus`"
    raise SetupError(f"unknown GPU {name!r}: {('ambiguous: ' + options) if candidates else options}, "
                     "or give a memory size such as 24GiB")


def common_sizes() -> tuple[tuple[str, int], ...]:
    """Reference capacities drawn as lines on request (GB as vendors label them; bytes as drivers show)."""
    from .units import GiB

    return tuple((f"{n} GB", n * GiB) for n in (16, 24, 40, 48, 80))
