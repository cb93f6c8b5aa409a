"""Model and GPU presets shipped in ``resources/``, and resolution of what a user names.

A model argument is a preset id (``llama-2-7b``), a preset's display name, a path to a HF
``config.json``, a local model folder (see :mod:`vramlab.core.sources.folder`), or a Hugging Face Hub id
``org/name[@revision]`` (see :mod:`vramlab.core.sources.hub`; a local path of the same spelling wins).
A GPU argument is a preset id or a name; a memory size such as ``24GiB`` makes a custom GPU.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .spec import MAX_GPU_BYTES, MIN_GPU_BYTES, GpuSpec, ModelSpec, SetupError
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
        from .sources.folder import load_model_source

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


# Words that name a vendor or a product line rather than a GPU: "NVIDIA GeForce RTX 4090" (the driver),
# "GeForce RTX 4090" (the catalogue) and "rtx 4090" (a user) are one GPU.
VENDOR_WORDS = ("nvidia", "geforce", "tesla", "amd", "radeon", "instinct")


def gpu_key(name: str) -> str:
    """A GPU's name without vendor words, the app's "(cuda:N)" suffix, case and punctuation. Two names
    are the same GPU exactly when their keys are equal: an A10 is not an A100, 4GB is not the H100 NVL."""
    name = re.sub(r"\s*\(cuda:\d+\)\s*$", "", str(name).lower())
    words = [w for w in re.split(r"[^0-9a-z.]+", name) if w and w not in VENDOR_WORDS]
    return "".join(words)


def match_gpu(name: str) -> GpuSpec | None:
    """The catalogue GPU whose id or name equals ``name`` (vendor words, case and punctuation aside)."""
    key = gpu_key(name)
    if not key:
        return None
    for g in gpus():
        if key in (gpu_key(g.id), gpu_key(g.name)):
            return g
    return None


def find_gpu(name: str) -> GpuSpec:
    """A GPU preset by id or name (exactly, vendor words and case aside), or a custom GPU from a memory size
    the user typed ('24GiB', '80GB', '12288MiB'). Anything else is a SetupError listing the near matches:
    a substring is never taken for a GPU ('4GB' is not the H100 NVL 94GB)."""
    found = match_gpu(name)
    if found is not None:
        return found
    text = str(name).strip()
    shown = text if len(text) <= 40 else text[:37] + "..."
    if _SIZE_LIKE.match(text):  # a size the user typed (a bare number is not one: 24 bytes or 24 GB?)
        try:
            size = parse_size(text)
        except ValueError as e:
            raise SetupError(f"GPU size {shown!r}: {e}") from None
        if not MIN_GPU_BYTES <= size <= MAX_GPU_BYTES:
            raise SetupError(f"GPU size {shown!r} is out of range: give between 256MiB and 64TiB per GPU")
        return GpuSpec(id=f"custom-{size}", name=f"Custom GPU ({text})", memory_bytes=size)
    raise SetupError(f"unknown GPU {shown!r}: {_near_gpus(text)}; or give a memory size such as 24GiB")


_SIZE_LIKE = re.compile(r"^\s*[0-9]*\.?[0-9]+\s*(?:[kmgt]i?b?|b)\s*$", re.IGNORECASE)


def _near_gpus(text: str) -> str:
    key = gpu_key(text)
    if re.fullmatch(r"[0-9.]+", text.strip()):
        return f"a bare number is not a size (write {text.strip()}GiB or {text.strip()}GB)"
    ids = [g.id for g in gpus()]
    near = [g.id for g in gpus() if key and (gpu_key(g.id).startswith(key) or gpu_key(g.name).startswith(key))]
    near += [i for i in difflib.get_close_matches(key, ids, n=4, cutoff=0.6) if i not in near]
    return f"did you mean {', '.join(near[:6])}" if near else "see `vramlab estimate --list-gpus`"


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
    base = match_gpu(name)  # exactly the catalogue's GPU of that name, never a size read out of it
    if base is None:
        cc = f"{compute_capability[0]}.{compute_capability[1]}" if compute_capability else ""
        base = GpuSpec(id="", name=name, memory_bytes=int(memory_total_bytes),
                       arch=arch_for_capability(compute_capability), compute_capability=cc)
    shown = f"{name} (cuda:{cuda_index})" if with_index else name
    return dataclasses.replace(base, id=f"detected-{cuda_index}", name=shown, memory_bytes=int(memory_total_bytes),
                               notes="detected on this machine")
