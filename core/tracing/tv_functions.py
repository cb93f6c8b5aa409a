"""transformers' torchvision image and video processor classes, run where torchvision is not installed (issue 28).

transformers ships some families' processors for torchvision only: LFM2-VL's image processor, and every video
processor (``video_processing_utils``' ``BaseVideoProcessor`` is a ``TorchvisionBackend``: Gemma 4, Qwen3-VL /
Qwen3.5, GLM-4V, LLaVA-OneVision, LLaVA-NeXT-Video). PyPI's torchvision is built against CUDA's torch and does
not load over a CPU-only torch (its ``_C`` extension links ``libtorch_cuda``), so it cannot be a default dependency
of this CPU-first tool. These classes' own code still decides everything a sample's count depends on (frame
sampling, smart_resize, tiling, padding, patchifying, the prompt's placeholders); it calls eight tensor
functions of ``torchvision.transforms.v2.functional`` for the pixels.

Here those modules get :func:`functional`'s stand-ins of those eight functions under the name they use
(``tvF``) while a processor runs (:func:`bound`), and a module that cannot even be imported without torchvision
(LFM2-VL's image processor imports it at the top; Gemma 4's video processor names ``tvF.InterpolationMode`` in a
signature) is loaded with them bound (:func:`load_class`). The stand-ins are exact for the input they are given:
the processor runs on a synthetic black image or video (:mod:`.vlm_processor`), and a resize, crop, pad,
normalize or dtype conversion of a constant image is that constant at the output's shape, which these compute
(a resize of any other image is interpolated by torch, not by torchvision's kernels). A call of a form they do
not model raises, so the processor is refused with that reason, never counted on a guess. Where torchvision is
installed, transformers' classes run on it and nothing here is used.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import functools
import importlib
import importlib.machinery
import importlib.util
import pkgutil
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

_LOCK = threading.RLock()
# the names the processor modules bind torchvision's functional module and the resample table to
_NAME = "tvF"
_TABLE = "pil_torch_interpolation_mapping"
_TV_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")


def installed() -> bool:
    """Whether torchvision is installed (transformers then runs its classes on it, or fails with its reason)."""
    return importlib.util.find_spec("torchvision") is not None


class InterpolationMode(enum.Enum):
    """torchvision's ``InterpolationMode`` (the names transformers' resample tables use)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _resize(image: Any, size: Sequence[int] | int, interpolation: Any = None, max_size: Any = None,
            antialias: bool = True) -> Any:
    import torch

    if isinstance(size, int) or len(size) != 2 or max_size is not None:
        raise NotImplementedError(f"a resize to {size!r} (max_size {max_size}): only (height, width) is modelled")
    h, w = int(size[0]), int(size[1])
    if not bool(image.any()):  # a black image resized is black at the new size, whatever the kernel
        return torch.zeros((*image.shape[:-2], h, w), dtype=image.dtype)
    flat = image.reshape(-1, *image.shape[-3:]).float()
    out = torch.nn.functional.interpolate(flat, size=(h, w), mode="bilinear", antialias=antialias)
    return out.round().clamp(0, 255).to(image.dtype).reshape(*image.shape[:-2], h, w) \
        if not image.is_floating_point() else out.to(image.dtype).reshape(*image.shape[:-2], h, w)


def _crop(image: Any, top: int, left: int, height: int, width: int) -> Any:
    import torch

    h, w = image.shape[-2:]
    if top < 0 or left < 0 or top + height > h or left + width > w:  # torchvision pads what lies outside with 0
        pads = [max(-left, 0), max(left + width - w, 0), max(-top, 0), max(top + height - h, 0)]
        image = torch.nn.functional.pad(image, pads)
        top, left = max(top, 0), max(left, 0)
    return image[..., top:top + height, left:left + width]


def _pad(image: Any, padding: Sequence[int] | int, fill: Any = 0, padding_mode: str = "constant") -> Any:
    import torch

    if padding_mode != "constant" or not isinstance(fill, (int, float)):
        raise NotImplementedError(f"a {padding_mode} pad with fill {fill!r}: only a constant fill is modelled")
    p = [padding] if isinstance(padding, int) else list(padding)
    left, top, right, bottom = {1: p * 4, 2: p * 2, 4: p}.get(len(p), [None] * 4)
    if left is None:
        raise NotImplementedError(f"a pad of {padding!r}")
    return torch.nn.functional.pad(image, [left, right, top, bottom], value=fill)


def _normalize(image: Any, mean: Sequence[float], std: Sequence[float], inplace: bool = False) -> Any:
    import torch

    m = torch.as_tensor(mean, dtype=image.dtype).reshape(-1, 1, 1)
    s = torch.as_tensor(std, dtype=image.dtype).reshape(-1, 1, 1)
    return (image - m) / s


def _to_dtype(image: Any, dtype: Any = None, scale: bool = False) -> Any:
    import torch

    dtype = dtype or torch.float32
    if not scale or image.dtype == dtype:
        return image.to(dtype)
    if image.is_floating_point() and not dtype.is_floating_point:
        return (image * 255).round().clamp(0, 255).to(dtype)
    if not image.is_floating_point() and dtype.is_floating_point:
        return image.to(dtype) / 255
    return image.to(dtype)


def _grayscale_to_rgb(image: Any) -> Any:
    return image if image.shape[-3] == 3 else image.expand(*image.shape[:-3], 3, *image.shape[-2:])


def _to_tensor(picture: Any) -> Any:
    import numpy as np
    import torch

    arr = np.asarray(picture)
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    out = torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
    return out.float() / 255 if out.dtype == torch.uint8 else out


def _pil_to_tensor(picture: Any) -> Any:
    """torchvision's ``pil_to_tensor``: the picture's own values, channels first, in its own dtype (no scaling)."""
    import numpy as np
    import torch

    arr = np.array(picture, copy=True)
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


@functools.cache
def functional() -> types.ModuleType:
    """The stand-in of ``torchvision.transforms.v2.functional``: the functions transformers' processors call."""
    m = types.ModuleType("torchvision.transforms.v2.functional", "VRAM Lab's stand-ins (core/tracing/tv_functions.py)")
    m.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    for name, fn in (("resize", _resize), ("crop", _crop), ("pad", _pad), ("normalize", _normalize),
                     ("to_dtype", _to_dtype), ("grayscale_to_rgb", _grayscale_to_rgb), ("to_tensor", _to_tensor),
                     ("pil_to_tensor", _pil_to_tensor)):
        setattr(m, name, fn)
    return m


def _table() -> dict[Any, InterpolationMode]:
    from transformers.image_utils import PILImageResampling

    return {PILImageResampling.NEAREST: InterpolationMode.NEAREST_EXACT, PILImageResampling.BOX: InterpolationMode.BOX,
            PILImageResampling.BILINEAR: InterpolationMode.BILINEAR,
            PILImageResampling.HAMMING: InterpolationMode.HAMMING,
            PILImageResampling.BICUBIC: InterpolationMode.BICUBIC,
            PILImageResampling.LANCZOS: InterpolationMode.LANCZOS}


@contextlib.contextmanager
def bound(*classes: type) -> Iterator[None]:
    """The stand-ins bound in the modules of ``classes`` and of their bases (``tvF``, and the resample table where
    the module has None for it) while the block runs; nothing is bound where torchvision is installed."""
    if installed():
        yield
        return
    with _LOCK:
        modules = {sys.modules[c.__module__] for cls in classes for c in cls.__mro__
                   if c.__module__.startswith("transformers.") and c.__module__ in sys.modules}
        added = []
        try:
            for m in modules:
                if not hasattr(m, _NAME):
                    setattr(m, _NAME, functional())
                    added.append((m, _NAME))
                if _TABLE in vars(m) and getattr(m, _TABLE) is None:
                    setattr(m, _TABLE, _table())
                    added.append((m, _TABLE))
            yield
        finally:
            for m, name in added:
                if name == _TABLE:
                    setattr(m, name, None)
                else:
                    delattr(m, name)


def load_class(package: str, prefix: str, name: str) -> type | None:
    """The class ``name`` of the submodule of transformers' ``package`` (``transformers.models.<family>``) whose
    name starts with ``prefix`` (``image_processing_``, ``video_processing_``) and defines it: imported as it is,
    or, where that fails for want of torchvision, loaded with the stand-ins bound in it. None where no such
    module defines it."""
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        return None
    for info in pkgutil.iter_modules(found.submodule_search_locations):
        if not info.name.startswith(prefix):
            continue
        full = f"{package}.{info.name}"
        spec = importlib.util.find_spec(full)
        if spec is None or spec.origin is None or spec.loader is None:
            continue
        with open(spec.origin, encoding="utf-8") as f:
            if f"class {name}(" not in f.read():
                continue
        try:
            module = importlib.import_module(full)
        except (ImportError, NameError):
            if installed():
                raise
            module = _load_bound(full, spec)
        return getattr(module, name, None)
    return None


def _load_bound(full: str, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
    """The module executed with ``tvF`` bound beforehand, and ``torchvision.transforms.v2.functional`` importable
    as the stand-in while it runs (for a module that imports it at the top)."""
    with _LOCK:
        module = importlib.util.module_from_spec(spec)
        setattr(module, _NAME, functional())
        fakes = {}
        for n in _TV_MODULES:
            fake = types.ModuleType(n)
            fake.__spec__ = importlib.machinery.ModuleSpec(n, None, is_package=True)
            fake.__path__ = []  # type: ignore[attr-defined]
            fakes[n] = fake
        fakes["torchvision.transforms.v2"].functional = functional()  # type: ignore[attr-defined]
        fakes["torchvision.transforms.v2.functional"] = functional()
        sys.modules[full] = module
        try:
            sys.modules.update(fakes)
            assert spec.loader is not None
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(full, None)
            raise
        finally:
            for n in fakes:
                sys.modules.pop(n, None)
        return module


@functools.cache
def video_processor_names() -> dict[str, str]:
    """Model type -> the name of its video processor class, as transformers' auto mapping lists it (read from its
    source: where torchvision is not installed, transformers sets every entry of the loaded table to None)."""
    out: dict[str, str] = {}
    for module in ("auto_mappings", "video_processing_auto"):
        found = importlib.util.find_spec(f"transformers.models.auto.{module}")
        origin = found.origin if found else None
        if not origin:
            continue
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[1], ast.Dict):
                key, value = node.elts
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    continue
                for k, v in zip(value.keys, value.values, strict=False):
                    if isinstance(k, ast.Constant) and k.value == "torchvision" and isinstance(v, ast.Constant) \
                            and isinstance(v.value, str) and v.value.endswith("VideoProcessor"):
                        out.setdefault(key.value, v.value)
    return out


def image_class(name: str) -> type | None:
    """transformers' torchvision image processor class ``name`` loaded with the stand-ins where torchvision is not
    installed (LFM2-VL's); None where torchvision is installed or no family module defines it."""
    if installed():
        return None
    from transformers.models.auto import image_processing_auto as ia
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    table = ia.IMAGE_PROCESSOR_MAPPING_NAMES
    for t in [t for t in table if isinstance(table[t], dict) and table[t].get("torchvision") == name]:
        cls = load_class(f"transformers.models.{model_type_to_module_name(t)}", "image_processing_", name)
        if cls is not None:
            return cls
    return None


@functools.cache
def video_class(model_type: str) -> type | None:
    """The video processor class of this model type (transformers' auto mapping), loaded with the stand-ins where
    torchvision is not installed; None where the mapping names none."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    names = video_processor_names()
    name = names.get(model_type)
    if name is None:
        return None
    if installed():
        from transformers.models.auto.video_processing_auto import video_processor_class_from_name

        return video_processor_class_from_name(name)
    for t in [t for t, n in names.items() if n == name]:
        cls = load_class(f"transformers.models.{model_type_to_module_name(t)}", "video_processing_", name)
        if cls is not None:
            return cls
    return None
