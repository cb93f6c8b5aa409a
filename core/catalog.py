"""Model and GPU presets shipped in ``resources/``, and resolution of what a user names.

A model argument is a preset id (``llama-2-7b``), a preset's display name, a path to a HF
``config.json``, or a local model folder (see :mod:`vramlab.core.importer`). A GPU argument is a preset id
or a name; a memory size such as ``24GiB`` makes a custom GPU.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .spec import GpuSpec, ModelSpec, SetupError
from .units import parse_size


@dataclass(frozen=True)
class ModelEntry:
    spec: ModelSpec
    source: str  # "preset" or the path it was imported from
    warnings: tuple[str, ...] = ()
    tensor_params: int | None = None


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


def resolve_model(arg: str) -> ModelEntry:
    """A preset, or a local config.json / model folder. Raises SetupError with suggestions."""
    preset = find_model(arg)
    if preset is not None:
        return ModelEntry(preset, "preset")
    path = Path(arg).expanduser()
    looks_like_path = path.exists() or "/" in arg or "\\" in arg or arg.endswith(".json")
    if looks_like_path:
        from .importer import load_model_source

        imported = load_model_source(path)
        return ModelEntry(imported.spec, str(path), imported.warnings, imported.tensor_params)
    close = difflib.get_close_matches(arg.lower(), [m.id for m in models()], n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else " See `vramlab estimate --list-models`."
    raise SetupError(f"unknown model {arg!r}: not a preset id, config.json or model folder.{hint}")


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


# Architecture by CUDA compute capability (major, or (major, minor) where a major spans two), for a detected
# GPU the catalogue does not list: the outer levels (context, cuBLAS workspace) depend on it.
_ARCH_BY_CAPABILITY = {(7, 0): "volta", (7, 2): "volta", (7, 5): "turing", (8, 9): "ada", 8: "ampere",
                       9: "hopper", 10: "blackwell", 12: "blackwell"}


def arch_for_capability(capability: tuple[int, int] | None) -> str:
    if capability is None:
        return ""
    return _ARCH_BY_CAPABILITY.get(tuple(capability), _ARCH_BY_CAPABILITY.get(capability[0], ""))


def detected_gpu(name: str, memory_total_bytes: int, cuda_index: int = 0,
                 compute_capability: tuple[int, int] | None = None, with_index: bool = False) -> GpuSpec:
    """A GPU found on this machine (NVML) as a GpuSpec: the catalogue's entry for its name (speed,
    architecture) with the memory the driver reports, else a bare spec whose architecture follows its
    compute capability. ``with_index`` adds "(cuda:N)" to the name, for lists of several GPUs. The one
    mapping the GPU list and the Live tab use."""
    try:
        base = find_gpu(name)
        if base.id.startswith("custom-"):
            raise SetupError(name)
    except SetupError:
        cc = f"{compute_capability[0]}.{compute_capability[1]}" if compute_capability else ""
        base = GpuSpec(id="", name=name, memory_bytes=int(memory_total_bytes),
                       arch=arch_for_capability(compute_capability), compute_capability=cc)
    shown = f"{name} (cuda:{cuda_index})" if with_index else name
    return dataclasses.replace(base, id=f"detected-{cuda_index}", name=shown, memory_bytes=int(memory_total_bytes),
                               notes="detected on this machine")
