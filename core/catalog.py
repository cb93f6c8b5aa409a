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

from vramlab.core.checks import SetupError
from vramlab.core.spec.gpu import MAX_GPU_BYTES, MIN_GPU_BYTES, VENDOR_WORDS, GpuSpec, gpu_key
from vramlab.core.spec.model import ModelSpec
from vramlab.core.units import GiB, parse_size


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
        from vramlab.core.sources.hub import parse_hub_id

        ref = parse_hub_id(arg)
        if ref is not None:
            try:
                return hub_entry(ref, network=network)
            except SetupError as e:
                hint = _no_folder(path)
                if not hint:
                    raise
                raise SetupError(f"{e}{hint}") from e
    looks_like_path = path.exists() or "/" in arg or "\\" in arg or arg.endswith(".json")
    if looks_like_path:
        from vramlab.core.sources.folder import load_model_source

        imported = load_model_source(path)
        return ModelEntry(imported.spec, str(path), imported.warnings, imported.tensor_params)
    close = difflib.get_close_matches(arg.lower(), [m.id for m in models()], n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else " See `vramlab estimate --list-models`."
    raise SetupError(f"unknown model {arg!r}: not a preset id, config.json or model folder.{hint}")


def _no_folder(path: Path) -> str:
    """'; nor is there a local folder PATH' where the Hub id looks like a mistyped local folder."""
    return f"; nor is there a local folder {path}" if path.parent != Path(".") and path.parent.is_dir() else ""


def repo_of_source(source: str | None) -> str | None:
    """The Hub repository a preset was made from, as its ``source`` names it (``org/name config.json; ...``)."""
    found = re.match(r"([A-Za-z0-9][\w.-]*/[\w.-]+) config\.json", source or "")
    return found[1] if found else None


def preset_of_repo(repo_id: str) -> ModelSpec | None:
    """The preset made from the Hub repository ``repo_id``'s config.json, if any."""
    return next((m for m in models() if (repo_of_source(m.source) or "").lower() == repo_id.lower()), None)


def _same_name_hint(repo_id: str) -> str:
    """'; the preset qwen2.5-7b has that name (-m qwen2.5-7b)' when a preset shares the repository's name, or
    the preset of the name the repository's extends ('Qwen2.5-7B-Instruct': qwen2.5-7b, the same architecture
    as a fine-tune of it)."""
    name = repo_id.rsplit("/", 1)[-1]
    same = find_model(name)
    if same is not None:
        return f"; the preset {same.id} has that name (-m {same.id}, no download)"
    base = [m for m in models() if name.lower().startswith(m.name.lower() + "-")]  # Qwen2.5-7B of Qwen2.5-7B-Instruct
    if not base:
        return ""
    m = max(base, key=lambda m: len(m.name))
    return f"; the preset {m.id} is {m.name}, the model its name extends (-m {m.id}, no download)"


def hub_entry(ref: Any, *, network: bool = True, **lookup: Any) -> ModelEntry:
    """A Hub model (``ref``: a HubRef or an id) as a ModelEntry; ``lookup`` goes to ``load_hub_model``
    (progress, cancelled). ``network=False`` reads only the local caches."""
    import dataclasses

    from vramlab.core.sources.hub import HubSettings, NotCached, load_hub_model, parse_hub_id

    settings = HubSettings.from_env()
    if not network and not settings.offline:
        settings = dataclasses.replace(settings, offline=True, offline_reason="only the local caches are read here")
    try:
        model = load_hub_model(ref, settings=settings, **lookup)
    except NotCached as e:  # offline or unreachable: the preset made from that repository stands in
        parsed = parse_hub_id(ref) if isinstance(ref, str) else ref
        if parsed is None:
            raise
        preset = preset_of_repo(parsed.repo_id) if parsed.revision is None else None
        if preset is not None:
            return ModelEntry(preset, "preset", warnings=(
                f"{e}; the preset {preset.id} ({preset.name}), made from that repository's config.json, is used "
                "instead (its published parameter count, not the checkpoint's headers)",))
        raise type(e)(f"{e}{_same_name_hint(parsed.repo_id)}") from e
    imported = model.imported
    return ModelEntry(imported.spec, model.snapshot, imported.warnings, imported.tensor_params,
                      origin=model.origin, adapter=model.adapter)


# Words that do not tell two catalogue GPUs apart when left out: "4090" is the RTX 4090, "H100 SXM5" the H100 SXM.
_GENERIC_WORDS = frozenset({"rtx", "gtx", "sxm", "pcie"})
# What the driver and the cloud consoles add that no catalogue name carries (the memory technology)
# and the "1x" / "GPU" of cloud consoles' listings ("1x H100 (80 GB SXM5)", "gpu_1x_h100_sxm5")
_IGNORED_WORDS = frozenset({"hbm2", "hbm2e", "hbm3", "hbm3e", "gddr6", "gddr6x", "gddr7", "generation", "edition",
                            "gpu", "1x"})
# Capacities GPUs are sold with, in GB as printed on the box (which are GiB of memory chips); a catalogue GPU
# whose name has no size is labelled with the smallest of these that holds what the driver reports (ECC and
# firmware reserve keep that a little lower: an L40S "48 GB" reports 44.99 GiB).
_MARKETED_GB = (4, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 128, 141, 180, 192, 256, 288)
_MEMORY_WORD = re.compile(r"^(\d+)(?:gb|gib|g)$")


def _words(name: str) -> list[str]:
    """A GPU name as words: vendor and memory-technology words left out, "80 GB" joined to "80gb", SXM2/4/5 as
    "sxm" (the form factor; the generation is the GPU's own)."""
    name = re.sub(r"\s*\(cuda:\d+\)\s*$", "", str(name).lower())
    name = re.sub(r"(\d)\s+(gb|gib|g)\b", r"\1\2", name)
    out = []
    for w in re.split(r"[^0-9a-z.]+|_", name):
        if not w or w in VENDOR_WORDS or w in _IGNORED_WORDS:
            continue
        out.append("sxm" if re.fullmatch(r"sxm\d?", w) else w)
    return out


def _split_memory(words: list[str]) -> tuple[set[str], int | None]:
    """(the naming words, the memory size in GB a word such as "80gb" gives, or None)."""
    memory = None
    rest = set()
    for w in words:
        m = _MEMORY_WORD.match(w)
        if m:
            memory = int(m.group(1))
        else:
            rest.add(w)
    return rest, memory


@dataclass(frozen=True)
class _GpuNames:
    gpu: GpuSpec
    aliases: tuple[str, ...]  # what the driver or a cloud console prints for it, when its words do not say it
    words: frozenset[str]  # every naming word of its id, name and aliases
    id_words: frozenset[str]
    label_gb: int  # the size on the box


@functools.cache
def _gpu_names() -> tuple[_GpuNames, ...]:
    data = json.loads(_resource_text("gpus.json"))
    aliases = data.get("aliases", {})
    out = []
    for g in gpus():
        names = tuple(aliases.get(g.id, ()))
        words: set[str] = set()
        for n in (g.id, g.name, *names):
            words |= _split_memory(_words(n))[0]
        label = _split_memory(_words(g.name))[1]
        if label is None:
            gib = g.memory_bytes / 2**30
            label = next((c for c in _MARKETED_GB if c >= gib - 0.01), round(gib))
        out.append(_GpuNames(g, names, frozenset(words), frozenset(_split_memory(_words(g.id))[0]), label))
    return tuple(out)


def _name_candidates(name: str) -> list[GpuSpec]:
    """The catalogue GPUs a name can mean: every naming word the user gave is one of the GPU's words, and a
    size given is its size on the box. Where several remain, those the user's words name but for generic
    words (RTX, SXM, PCIe) are preferred: "3090" is the RTX 3090, not the 3090 Ti."""
    words, memory = _split_memory(_words(name))
    if not words:
        return []
    found = [n for n in _gpu_names() if words <= n.words and (memory is None or memory == n.label_gb)]
    plain = [n for n in found if n.id_words - words <= _GENERIC_WORDS]
    if len(plain) == 1:
        return [plain[0].gpu]
    return [n.gpu for n in found]


def match_gpu(name: str) -> GpuSpec | None:
    """The catalogue GPU ``name`` means, or None: its id, its name or a name the driver or a cloud console prints
    for it (vendor words, case and punctuation aside), else the one GPU whose words the name's are (a size in
    the name must be the GPU's): "4090", "H100 SXM5", "NVIDIA H100 80GB HBM3" (the H100 SXM), "RTX 6000 Ada".
    Several GPUs that fit the words are no match (see :func:`find_gpu`)."""
    key = gpu_key(name)
    if not key:
        return None
    for n in _gpu_names():
        if key in (gpu_key(n.gpu.id), gpu_key(n.gpu.name), *(gpu_key(a) for a in n.aliases)):
            return n.gpu
    found = _name_candidates(name)
    return found[0] if len(found) == 1 else None


# A size people type for a GPU. A whole number of GB ("24GB", "24 GB", "80g") is the size printed on a card, and
# vendors' GB on a GPU are GiB of memory chips (a "24 GB" RTX 4090 has 24 GiB; the driver shows 24,564 MiB): it is
# read as that card class, N GiB. Any other size is taken as written: GiB / MiB / TiB, MB / TB, a fraction of a
# GB (22.5GB is 22.5 x 10^9 bytes) or a number of bytes.
_CARD_SIZE = re.compile(r"^\s*(\d+)\s*(?:gb|g)\s*$", re.IGNORECASE)
_SIZE_LIKE = re.compile(r"^\s*[0-9]*\.?[0-9]+\s*(?:[kmgt]i?b?|b)\s*$", re.IGNORECASE)


def find_gpu(name: str) -> GpuSpec:
    """A GPU by id, name or the words that name one (see :func:`match_gpu`), or a custom GPU from a memory size
    (see ``_CARD_SIZE``: "24GB" is a 24 GB card, 24 GiB; "24GiB", "22.5GB" and "12288MiB" are sizes as written).
    The custom GPU's name says which reading was taken. Anything else is a SetupError listing the near matches:
    a substring is never taken for a GPU ('4GB' is not the H100 NVL 94GB)."""
    text = str(name).strip()
    if not text:
        raise SetupError("--gpu is empty: give a GPU (rtx-4090, 'H100 SXM', see `vramlab estimate --list-gpus`) "
                         "or a memory size (24GB for a 24 GB card, 22.5GiB)")
    found = match_gpu(text)
    if found is not None:
        return found
    own = re.fullmatch(r"card-(\d+)gb|custom-(\d+)", text)  # the ids of the GPUs made below (a saved comparison)
    if own:
        text = f"{own[1]}GB" if own[1] else f"{own[2]}B"
    shown = text if len(text) <= 40 else text[:37] + "..."
    card = _CARD_SIZE.match(text)
    if card or _SIZE_LIKE.match(text):
        try:
            size = int(card.group(1)) * 2**30 if card else parse_size(text)
        except ValueError as e:
            raise SetupError(f"GPU size {shown!r}: {e}") from None
        if not MIN_GPU_BYTES <= size <= MAX_GPU_BYTES:
            raise SetupError(f"GPU size {shown!r} is out of range: give between 256MiB and 64TiB per GPU")
        if card:
            gb = int(card.group(1))
            return GpuSpec(id=f"card-{gb}gb", name=f"{gb} GB card ({gb} GiB)", memory_bytes=size,
                           notes=f"{text!r} read as a {gb} GB card: vendors' GB on a GPU are GiB of memory chips; "
                                 f"write {gb * 1000}MB for {gb} x 10^9 bytes, or name the GPU for its exact memory")
        return GpuSpec(id=f"custom-{size}", name=f"{shown} as given", memory_bytes=size,
                       notes=f"{text!r} read as a size of {size:,} bytes")
    raise SetupError(f"unknown GPU {shown!r}: {_near_gpus(text)}")


def _near_gpus(text: str) -> str:
    several = _name_candidates(text)
    if len(several) > 1:
        return f"it names {len(several)} GPUs: {', '.join(g.id for g in several)}; give one of them"
    if re.fullmatch(r"[0-9.]+", text.strip()):
        return (f"a bare number is neither a GPU nor a size: write {text.strip()}GB for a {text.strip()} GB card, "
                f"or {text.strip()}GiB")
    key = gpu_key(text)
    ids = [g.id for g in gpus()]
    near = [g.id for g in gpus() if key and (gpu_key(g.id).startswith(key) or gpu_key(g.name).startswith(key))]
    near += [i for i in difflib.get_close_matches(key, ids, n=4, cutoff=0.6) if i not in near]
    hint = f"did you mean {', '.join(near[:6])}" if near else "see `vramlab estimate --list-gpus`"
    return f"{hint}; or give a memory size such as 24GB (a 24 GB card) or 22.5GiB"


def common_sizes() -> tuple[tuple[str, int], ...]:
    """Reference capacities drawn as lines on request (GB as vendors label them; bytes as drivers show)."""
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
