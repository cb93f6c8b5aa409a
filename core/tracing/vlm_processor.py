"""The images of a sample as any vision-language family's own processor makes them (issue 28).

Families with hand-written processor rules (:mod:`vramlab.core.vision`) keep them; every other
image-text-to-text family transformers ships is answered by running its processor class itself, on the CPU,
on a synthetic image of the size the user gave, without the Hub:

* the processor class (``PROCESSOR_MAPPING_NAMES``) and its image processor (``IMAGE_PROCESSOR_MAPPING_NAMES``,
  the Pillow backend where the family has one) are built from their class defaults, with the sizes the model's
  config also names (``patch_size``, ``temporal_patch_size``, ``pooling_kernel_size`` ..., and ``merge_size``
  from ``spatial_merge_size``) taken from the config, so that the pixels fit the tower that is traced;
* the tokenizer is a stand-in (:class:`_StandIn`): every ``*_token`` the processor asks it for is a special
  token of its own; after the processor has expanded the prompt, the placeholders whose names the config gives
  ids (``image_token`` -> ``image_token_id`` / ``image_token_index``, ``boi_token`` -> ``boi_token_id`` ...)
  take those ids, so the model finds its images where the processor put them. Plain text the processor writes
  between placeholders (row markers spelled out, timestamps) is split on spaces and punctuation, which is
  close to, not exactly, what the family's own tokenizer makes of it: the note says so where it happens;
* the processor's outputs become the batch: its token row (per sample), its float tensors (pixels) as
  tensors of their shapes, its integer tensors (grids, image sizes, position ids, masks) as the constants the
  model reads.

Nothing here loads weights or runs remote code; a family whose processor cannot run here (it needs a package
that is not installed, such as torchvision) is refused with the processor's own reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.tracing import tv_functions

# the ids a placeholder name may have in a config (image_token -> image_token_id, image_token_index)
_ID_SUFFIXES = ("_id", "_index")
# sizes an image processor and the model's config both name; the config's value is the model's
_ALIASES = {"merge_size": ("spatial_merge_size", "merge_size")}
# what a checkpoint's processor files hold that is not a setting of the classes built from them
_NOT_SETTINGS = ("processor_class", "image_processor_type", "auto_map", "chat_template", "_processor_class")
_NEUTRAL = 0  # the id of plain text the processor writes (no image token is 0 in a shipped config)
# image processors whose longest edge is the tower's ``image_size`` in the released checkpoints'
# preprocessor_config.json (Pixtral-12B: 1024; Mistral Small 3.1 / Magistral: 1540), where the class default is 1024
_LONGEST_EDGE_IS_THE_TOWERS = ("PixtralImageProcessorPil", "PixtralImageProcessor")
# an image processor's settings the model's config holds too, which the model reads to place its features (LLaVA-NeXT
# and LLaVA-OneVision unpad by the config's pinpoints): the config's value, as for the sizes
_CONFIG_LISTS = ("image_grid_pinpoints",)
# a processor's __init__ settings that its class leaves None for processor_config.json to give and that only one
# value lets the model run: LLaVA-OneVision's num_image_tokens, the tower's tokens per tile (its position embeddings)
_FROM_TOWER = ("num_image_tokens",)
DEFAULTS_NOTE = "'s settings are transformers' defaults"
# a marker in a processor's text: one word between angle brackets (<IMG_ATOM>, <|image_pad|>, <row_1_col_1>)
_MARKER = re.compile(r"<[^<>\s]+>")


@dataclass(frozen=True)
class ProcessorRun:
    """One sample's images as the processor made them: the token row of its placeholders (config ids), per
    image the language tokens and the tower's patches, and the model inputs: ``(kind, shape, values, dtype)``
    with kind ``pixels`` (values None) or ``constant``."""

    row: tuple[int, ...]
    tokens_per_image: int
    patches_per_image: int
    inputs: tuple[tuple[str, str, tuple[int, ...], Any, str], ...]
    processor: str
    notes: tuple[str, ...] = ()
    video_tokens: int = 0  # the video's placeholders (its frames' tokens and the text between them)
    video_patches: int = 0


def processor_type(cfg: Any, settings: str = "") -> str:
    """The model type whose processor makes this config's images: the one whose processor class the checkpoint's
    ``processor_config.json`` names (``settings``: ``core.sources.files.load_processor_files``) where transformers
    ships it; else its tower's where transformers ships a processor and an image processor for the tower's type (a
    LLaVA wrapper around a Pixtral tower, Pixtral-12B, whose released processor_config.json names PixtralProcessor,
    not LlavaProcessor); else the config's own type. ``cfg`` is a config dict or a transformers config."""
    ia, pa = _auto()

    get = cfg.get if isinstance(cfg, Mapping) else functools.partial(getattr, cfg)
    own = str(get("model_type", ""))
    vc = get("vision_config", None)
    tower = (vc.get("model_type") if isinstance(vc, Mapping) else getattr(vc, "model_type", None)) if vc else None
    named = json.loads(settings).get("processor", {}).get("processor_class") if settings else None
    if named:  # the config's own type or its tower's first, where either maps to that class
        for t in (own, tower, *pa.PROCESSOR_MAPPING_NAMES):
            if t in pa.PROCESSOR_MAPPING_NAMES and pa.PROCESSOR_MAPPING_NAMES[t] == named \
                    and t in ia.IMAGE_PROCESSOR_MAPPING_NAMES:
                return str(t)
    if isinstance(tower, str) and tower in pa.PROCESSOR_MAPPING_NAMES and tower in ia.IMAGE_PROCESSOR_MAPPING_NAMES:
        return tower
    return own


def _auto() -> tuple[Any, Any]:
    """transformers' image processor and processor tables; SetupError where they do not import (a torchvision that
    is installed but does not load: the PyPI build, made for CUDA's torch, over a CPU-only torch)."""
    try:
        from transformers.models.auto import image_processing_auto as ia
        from transformers.models.auto import processing_auto as pa
    except (ImportError, RuntimeError, OSError) as e:
        root: BaseException = e
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__  # type: ignore[assignment]
        reason = " ".join(str(root).split())[:160]
        raise SetupError(f"transformers' image processors do not import here ({reason}); where torchvision is "
                         "installed it must be the build for the installed torch (a CPU-only torch: the CPU build "
                         "from download.pytorch.org/whl/cpu)") from None
    return ia, pa


@functools.cache
def processor_classes(model_type: str) -> tuple[type, type]:
    ia, pa = _auto()

    pname = pa.PROCESSOR_MAPPING_NAMES.get(model_type)
    inames = ia.IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type)
    if not pname or not inames:
        raise SetupError(f"transformers ships no processor for {model_type}: its images cannot be counted")
    if isinstance(inames, dict):
        ordered = [inames.get("pil"), inames.get("torchvision"), *inames.values()]
    else:
        ordered = list(inames) if isinstance(inames, (list, tuple)) else [inames]
    problems = []
    for iname in [n for n in ordered if n]:
        try:
            # a torchvision class where torchvision is not installed: run on torchvision's functions' stand-ins
            icls = tv_functions.image_class(iname) or ia.get_image_processor_class_from_name(iname)
            pcls = pa.processor_class_from_name(pname)
            if icls is None or pcls is None:
                raise ImportError(f"{iname} or {pname} is not in the installed transformers")
            with tv_functions.bound(icls):
                icls()  # a class whose backend is missing raises here, with the package it needs
            try:
                pcls.get_attributes()  # (a processor class standing in for one whose backend is missing, too)
            except ImportError:
                pcls = _beside_pillow(pname) or pcls
                pcls.get_attributes()
            return pcls, icls
        except (ImportError, RuntimeError, OSError) as e:  # (a torchvision that does not load: RuntimeError)
            problems.append(" ".join(str(e).split()).split(". ")[0])
    raise SetupError(f"{model_type}'s processor ({pname}) cannot run here: {problems[0] if problems else '?'}")


def _beside_pillow(pname: str) -> type | None:
    """The processor class ``pname`` where its module imports only a function from its family's torchvision image
    processor module (PixtralProcessor: ``get_resize_output_image_size``) and torchvision is not installed: the
    module imported with that sibling read from the family's Pillow module (``image_processing_pil_*``), which
    defines the same functions; the processor's own code is unchanged. None where that does not make it import."""
    import importlib
    import importlib.util
    import pkgutil
    import sys

    from transformers.models.auto import processing_auto as pa

    if importlib.util.find_spec("torchvision") is not None:  # the module imports as it is, or not for this reason
        return None
    for model_type, names in pa.PROCESSOR_MAPPING_NAMES.items():
        if pname not in (names if isinstance(names, tuple | list) else (names,)):
            continue
        package = f"transformers.models.{pa.model_type_to_module_name(model_type)}"
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            continue
        mods = {m.name for m in pkgutil.iter_modules(found.submodule_search_locations)}
        aliases = {f"{package}.{m}": f"{package}.{m.replace('image_processing_', 'image_processing_pil_', 1)}"
                   for m in mods if m.startswith("image_processing_") and not m.startswith("image_processing_pil_")
                   and m.replace("image_processing_", "image_processing_pil_", 1) in mods}
        for m in sorted(n for n in mods if n.startswith("processing_")):
            before = {a: sys.modules.get(a) for a in aliases}
            try:
                for alias, pil in aliases.items():
                    sys.modules[alias] = importlib.import_module(pil)
                cls = getattr(importlib.import_module(f"{package}.{m}"), pname, None)
            except ImportError:
                cls = None
            finally:
                for alias, old in before.items():
                    if old is None:
                        sys.modules.pop(alias, None)
                    else:
                        sys.modules[alias] = old
            if isinstance(cls, type):
                return cls
    return None


def _config_ints(cfg: Any, kinds: tuple[type, ...] = (int,)) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sub in (cfg, getattr(cfg, "text_config", None), getattr(cfg, "vision_config", None)):
        if sub is None:
            continue
        for k, v in sub.to_dict().items():
            if isinstance(v, kinds) and not isinstance(v, bool):
                out.setdefault(k, v)
    vc = getattr(cfg, "vision_config", None)
    if vc is not None:  # the tower's own sizes win over the wrapper's of the same name
        out.update({k: v for k, v in vc.to_dict().items() if isinstance(v, kinds) and not isinstance(v, bool)})
    return out


def _image_processor(icls: type, cfg: Any, settings: Mapping[str, Any] | None = None) -> Any:
    """The image processor of the checkpoint's ``preprocessor_config.json`` (``settings``) as transformers'
    ``from_pretrained`` builds it (the class's ``from_dict``); without one, the class defaults with the sizes the
    config names too taken from the config."""
    if settings:
        return icls.from_dict({k: v for k, v in settings.items() if k not in _NOT_SETTINGS})
    default = icls()
    known = _config_ints(cfg)
    kwargs = {}
    for name, value in vars(type(default)).items():
        if name.startswith("_") or not isinstance(value, int) or isinstance(value, bool):
            continue
        for key in _ALIASES.get(name, (name,)):
            if key in known:
                kwargs[name] = known[key]
                break
    if icls.__name__ in _LONGEST_EDGE_IS_THE_TOWERS and "image_size" in known:
        kwargs["size"] = {"longest_edge": known["image_size"]}
    size = getattr(default, "size", None)
    size = {k: v for k, v in (vars(size) if hasattr(size, "__dict__") else dict(size or {})).items() if v is not None}
    tower = getattr(getattr(cfg, "vision_config", None), "image_size", None)
    tower = (tower, tower) if isinstance(tower, int) else tuple(tower) if isinstance(tower, (list, tuple)) else ()
    if len(tower) == 2 and set(size) == {"height", "width"} and (size["height"], size["width"]) != tower:
        # an image processor that resizes every image (or tile) to one height and width: the tower's image_size,
        # which its position embeddings are made for (Ovis2's class default 384 px beside its config's 224 px tower;
        # Qianfan-OCR's 384 px tiles beside its [448, 448])
        kwargs["size"] = {"height": tower[0], "width": tower[1]}
    lists = _config_ints(cfg, (list,))
    kwargs.update({k: lists[k] for k in _CONFIG_LISTS if k in lists and isinstance(getattr(default, k, None), list)})
    return icls(**kwargs)


def _from_tower(pcls: type, cfg: Any, given: Mapping[str, Any]) -> dict[str, int]:
    """The settings of :data:`_FROM_TOWER` the processor class takes, leaves None and was not given: the tower's
    positions (its embeddings' ``num_positions``: patches, and a CLS where the tower has one), read from the tower
    transformers builds for the config on the meta device."""
    params = inspect.signature(pcls.__init__).parameters
    wanted = [k for k in _FROM_TOWER if k in params and params[k].default is None and given.get(k) is None]
    vc = getattr(cfg, "vision_config", None)
    if not wanted or vc is None:
        return {}
    import torch
    from transformers import AutoModel

    with torch.device("meta"):
        tower = AutoModel.from_config(vc)
    n = next((m.num_positions for m in tower.modules() if isinstance(getattr(m, "num_positions", None), int)), None)
    return {k: int(n) for k in wanted} if n else {}


def defaults_notes(pcls: type, derived: Mapping[str, int], files: Mapping[str, Any]) -> tuple[str, ...]:
    """The notes of a processor built without the checkpoint's processor files (its class defaults stand in) or
    with settings read from the tower that they did not give."""
    told = "; ".join(f"its {k}, which the class leaves to processor_config.json, is the tower's {v} positions per "
                     "tile (the one count its model takes)" for k, v in derived.items())
    if files:
        return (f"{pcls.__name__}: {told}",) if told else ()
    return (f"{pcls.__name__}{DEFAULTS_NOTE} (with the sizes the model's config names too): the model's folder has "
            "no processor_config.json or preprocessor_config.json" + (f"; {told}" if told else ""),)


def _stand_in() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    class _StandIn(PreTrainedTokenizerFast):
        """Every ``*_token`` asked for is a special token of its own (``*_token_id`` its id)."""

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__") or name.startswith("_StandIn"):
                raise AttributeError(name)
            if name.endswith("_token"):
                token = f"<|{name}|>"
                self.add_special_tokens({"additional_special_tokens": [token]},
                                        replace_extra_special_tokens=False)
                return token
            if name.endswith("_token_id"):
                return self.convert_tokens_to_ids(getattr(self, name[:-3]))
            return super().__getattr__(name)

        def convert_tokens_to_ids(self, tokens: Any) -> Any:
            """A marker the processor looks up by its text (GLM-4V's ``<|begin_of_video|>``) is a special token
            too, as it is in the family's tokenizer."""
            self._markers([tokens] if isinstance(tokens, str) else tokens if isinstance(tokens, list) else [])
            return super().convert_tokens_to_ids(tokens)

        def __call__(self, text: Any = None, *args: Any, **kwargs: Any) -> Any:
            """A marker the processor writes into the text it expands (Ovis2's ``<IMG_ATOM>``, ``<IMG_GRID>``) is a
            special token too, as it is in the family's tokenizer."""
            texts = [text] if isinstance(text, str) else text if isinstance(text, list) else []
            self._markers([m for t in texts if isinstance(t, str) for m in _MARKER.findall(t)])
            return super().__call__(text, *args, **kwargs)

        def _markers(self, tokens: list[Any]) -> None:
            new = [t for t in tokens if isinstance(t, str) and t.startswith("<") and t.endswith(">")
                   and not t.split()[1:] and t not in self.get_vocab()]
            if new:
                self.add_special_tokens({"additional_special_tokens": list(dict.fromkeys(new))},
                                        replace_extra_special_tokens=False)

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    return _StandIn(tokenizer_object=tok, unk_token="<unk>")


@contextlib.contextmanager
def _modalities_left_out() -> Any:
    """The processor built with None for what is not used (audio, a video processor where no video is asked):
    transformers' check of each argument's class skipped for those; a video processor is held to transformers'
    base class itself where the check cannot look it up (its table of video processors is torchvision's)."""
    from transformers.processing_utils import ProcessorMixin
    from transformers.video_processing_utils import BaseVideoProcessor

    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self: Any, name: str, argument: Any) -> Any:
        if argument is None:
            return type(None)
        if name == "video_processor" and not tv_functions.installed():
            if not isinstance(argument, BaseVideoProcessor):
                raise TypeError(f"Received a {type(argument).__name__} for argument {name}, but a "
                                "BaseVideoProcessor was expected.")
            return BaseVideoProcessor
        return check(self, name, argument)

    ProcessorMixin.check_argument_for_proper_class = lenient
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


@contextlib.contextmanager
def _real_tensors() -> Any:
    """The processor run on real tensors where it is first asked inside a simulation's fake tensor mode (a
    torchvision class makes its pixels with torch)."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # no torch: no mode to leave
        yield
        return
    with _disable_current_modes():
        yield


def _config_id(cfg: Any, name: str) -> int | None:
    for sub in (cfg, getattr(cfg, "text_config", None)):
        for suffix in _ID_SUFFIXES:
            v = getattr(sub, f"{name}{suffix}", None) if sub is not None else None
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


@functools.lru_cache(maxsize=64)
def run_processor(config_json: str, images: int, width: int, height: int, frames: int = 0,
                  settings: str = "") -> ProcessorRun:
    """What the family's processor makes of ``images`` synthetic images of ``width`` x ``height`` and a video of
    ``frames`` such frames (one sample; the frames are the ones it is given: no sampling); ``settings``: the
    checkpoint's processor files where they were read (``core.sources.files.load_processor_files``)."""
    import numpy as np

    from vramlab.core.sources.traced_config import config_from_dict

    cfg = config_from_dict(json.loads(config_json))
    mt = cfg.model_type
    ptype = processor_type(cfg, settings)
    pcls, icls = processor_classes(ptype)
    vcls = None
    if frames:
        vcls = tv_functions.video_class(ptype) if "video_processor" in pcls.get_attributes() else None
        if vcls is None:
            raise SetupError(video_refusal(mt, pcls))
    files = json.loads(settings) if settings else {}
    try:
        with tv_functions.bound(icls, *([vcls] if vcls else [])), _real_tensors():
            processor, tokenizer, derived = _processor(pcls, icls, vcls, cfg, files, ptype)
            wraps = _chat_markers(processor, tokenizer, images, frames, width, height, cfg)
            out = _call(processor, images, frames, width, height, wraps)
            alone = _call(processor, images, 0, width, height, wraps) if images and frames else out
    except SetupError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, ImportError, RuntimeError, NotImplementedError) as e:
        if not images and not frames:  # a processor that takes no sample without images (GOT-OCR2's): the text
            return ProcessorRun((), 0, 0, (), pcls.__name__)
        what = " and ".join(([f"{images} {width}x{height} image(s)"] if images else [])
                            + ([f"a video of {frames} such frames"] if frames else []))
        raise SetupError(f"{mt}'s processor ({pcls.__name__}) does not take {what}: "
                         f"{' '.join(str(e).split())[:200]}") from None
    types = np.asarray(out.get("mm_token_type_ids", [[2]]))
    if frames and not (types == 2).any():  # a video is a span of markers the processor does not name (_chat_markers)
        raise SetupError(f"{mt}'s processor ({pcls.__name__}) tells a video's tokens from an image's by markers that "
                         "the family's chat template writes around it, which the processor does not name: give its "
                         "frames as images instead")
    ids = [int(i) for i in np.asarray(out["input_ids"])[0]]
    remap: dict[int, int] = {}
    for name in dir(processor):
        value = getattr(processor, name, None) if name.endswith("_token") else None
        if isinstance(value, str) and value in tokenizer.get_vocab():
            target = _config_id(cfg, name)
            remap[tokenizer.convert_tokens_to_ids(value)] = _NEUTRAL if target is None else target
    for name, value in _marker_ids(processor):  # GLM-4V's video_start_id: the config's video_start_token_id
        target = _config_id(cfg, f"{name}_token")
        if target is not None:
            remap.setdefault(value, target)
    for token in {t for pair in wraps.values() for t in pair}:  # the stand-ins of the config's marker ids
        target = _config_id(cfg, token.strip("<|>"))
        if target is not None:
            remap.setdefault(tokenizer.convert_tokens_to_ids(token), target)
    image_id = _config_id(cfg, "image_token")
    if image_id is None:
        raise SetupError(f"{mt}: the config names no image_token_id (transformers' default config leaves it None; a "
                         "checkpoint's config.json gives it): the model places its image features at that id, and "
                         "without it transformers' class runs no image")
    remap[_expanded(processor, tokenizer, ids, images, width, height)] = image_id
    if frames and _config_id(cfg, "video_token") is None:
        raise SetupError(f"{mt}: the config names no video token id")
    row = tuple(remap.get(i, _NEUTRAL) for i in ids)
    video_images = "mm_token_type_ids" in out and any(r == image_id and t == 2 for r, t in zip(row, types[0],
                                                                                                  strict=False))
    if images and frames and video_images:
        raise SetupError(f"{mt}'s processor writes a video's frames with the image token, which its model takes for "
                         "the images' own (transformers' get_placeholder_mask): give images or a video, not both")
    notes = defaults_notes(pcls, derived, files)
    if tokenizer.unk_token_id in ids:
        notes += (f"{pcls.__name__} writes plain text between its image tokens; it is counted split on spaces and "
                  "punctuation, close to what the model's tokenizer makes of it",)
    inputs = []
    for name, value in out.items():
        if name in ("input_ids", "attention_mask", "text_replacement_offsets"):
            continue
        arr = np.asarray(value)
        if arr.dtype.kind == "f":
            inputs.append((name, "pixels", tuple(arr.shape), None, "float32"))
        elif arr.dtype.kind in "iub":
            inputs.append((name, "constant", tuple(arr.shape), arr.tolist(), "bool" if arr.dtype.kind == "b"
                           else "int64"))
    # the tower's input per image: its patches where the processor hands them over flattened (Qwen, Gemma 4:
    # (patches, features) or (images, patches, features)), else its tiles or crops (images of channels x pixels, in
    # one batch or per image: LLaVA-OneVision's, Idefics2's (images, crops, channels, height, width))
    pixels = next((s for n, k, s, _, _ in inputs if k == "pixels" and "video" not in n), ())
    patches = 0
    if pixels and images:
        patches = int(np.prod(pixels[:-1] if len(pixels) <= 3 else pixels[:-3])) // images
    image_tokens = len(np.asarray(alone["input_ids"])[0]) if images else 0
    video = next((s for n, k, s, _, _ in inputs if k == "pixels" and "video" in n), ())
    video_patches = int(np.prod(video[:-1] if len(video) <= 3 else video[:-3])) if video else 0
    return ProcessorRun(row, image_tokens // images if images else 0, patches, tuple(inputs), pcls.__name__, notes,
                        len(row) - image_tokens if frames else 0, video_patches)


def _processor(pcls: type, icls: type, vcls: type | None, cfg: Any, files: Mapping[str, Any],
               ptype: str = "") -> tuple[Any, Any, dict[str, int]]:
    """The processor built as the checkpoint's files (or the class defaults and the config's sizes) make it, with
    the stand-in tokenizer; that tokenizer; and the settings read from the tower (:func:`_from_tower`). Without a
    video asked for, the video processor is built only where the processor's ``__init__`` reads it (MiniCPM-V 4.6's
    ``self.video_processor.slice_mode``): a family whose video processor needs what is missing here (ERNIE-4.5-VL's,
    MiniMax-M3-VL's torchvision pieces) still counts its images."""
    try:
        return _built(pcls, icls, vcls, cfg, files)
    except AttributeError as e:
        needed = vcls is None and "video_processor" in pcls.get_attributes() and "NoneType" in str(e)
        vcls = tv_functions.video_class(ptype) if needed else None
        if vcls is None:
            raise
    with tv_functions.bound(vcls):
        return _built(pcls, icls, vcls, cfg, files)


def _built(pcls: type, icls: type, vcls: type | None, cfg: Any,
           files: Mapping[str, Any]) -> tuple[Any, Any, dict[str, int]]:
    image_processor = _image_processor(icls, cfg, files.get("image_processor"))
    video_processor = _image_processor(vcls, cfg, files.get("video_processor")) if vcls is not None else None
    tokenizer = _stand_in()
    attributes = pcls.get_attributes()
    parts = {"tokenizer": tokenizer, "image_processor": image_processor, "video_processor": video_processor}
    args = {a: parts.get(a) for a in attributes}
    known = _config_ints(cfg, (int, str))
    params = inspect.signature(pcls.__init__).parameters
    # the settings the config names too: its sizes, and what a processor leaves None for the checkpoint to give
    # (LLaVA-NeXT-Video's patch_size and vision_feature_select_strategy, which its config.json holds)
    extra = {k: known[k] for k, p in params.items() if k in known and k not in attributes
             and (isinstance(p.default, int) and isinstance(known[k], int) or p.default is None)}
    # the checkpoint's processor_config.json: the __init__ arguments it names (from_pretrained passes them)
    extra.update({k: v for k, v in files.get("processor", {}).items()
                  if k in params and k not in attributes and k not in _NOT_SETTINGS})
    # the markers a processor holds itself (PixtralProcessor's "[IMG]", "[IMG_BREAK]", "[IMG_END]": defaults of
    # its __init__, whose ids it looks up there; MiniMax-M3-VL's "]<]image[>[": constants of its class), not asked
    # of the tokenizer, are special tokens of it too
    own = [v for n, p in params.items() if n.endswith("_token")
           for v in (extra.get(n, p.default),) if isinstance(v, str)]
    own += [v for n in dir(pcls) if n.endswith("_TOKEN") for v in (getattr(pcls, n),) if isinstance(v, str) and v]
    tokenizer.add_special_tokens({"additional_special_tokens": own}, replace_extra_special_tokens=False)
    derived = _from_tower(pcls, cfg, extra)
    with _modalities_left_out():
        return pcls(**args, **extra, **derived), tokenizer, derived


def _expanded(processor: Any, tokenizer: Any, ids: list[int], images: int, width: int, height: int) -> int:
    """The id of the token the model finds each image feature at: the processor's ``image_token`` where the row
    holds it; else (Ovis2's ``<image>``, expanded into ``<IMG_START>``, ``<IMG_ATOM>`` ... ``<IMG_END>``) the one
    token of the row that it writes as many times as its own ``_get_num_multimodal_tokens`` counts image tokens."""
    own = tokenizer.convert_tokens_to_ids(processor.image_token)
    if not images or own in ids or not hasattr(processor, "_get_num_multimodal_tokens"):
        return own
    try:
        count = processor._get_num_multimodal_tokens(image_sizes=[(height, width)]).num_image_tokens[0] * images
    except (AttributeError, TypeError, ValueError, KeyError, IndexError, NotImplementedError):
        return own
    found = [i for i in set(ids) if ids.count(i) == count and i != tokenizer.unk_token_id]
    return found[0] if len(found) == 1 else own


def _marker_ids(processor: Any) -> list[tuple[str, int]]:
    """The markers a processor holds by id only (``video_start_id``: GLM-4V looks its ``<|begin_of_video|>`` up)."""
    return [(n[:-3], v) for n in dir(processor) if n.endswith(("_start_id", "_end_id"))
            for v in (getattr(processor, n, None),) if isinstance(v, int) and not isinstance(v, bool)]


def _markers(processor: Any, tokenizer: Any, kind: str, cfg: Any = None) -> tuple[str, str]:
    """The start and end markers the processor names for ``kind`` (image, video): ``{kind}_start_token`` or
    ``vision_start_token`` (Qwen-VL), or only their ids (GLM-4V's ``video_start_id``); else those the config gives
    ids to (GLM-4V's ``image_start_token_id``: a stand-in token, that id in the row); ("", "") where none."""
    for prefix in (kind, "vision"):
        found = []
        for edge in ("start", "end"):
            v = next((v for s in ("_token", "_token_id", "_id")
                      for v in (getattr(processor, f"{prefix}_{edge}{s}", None),) if v is not None), None)
            if isinstance(v, int) and not isinstance(v, bool):
                v = tokenizer.convert_ids_to_tokens(v)
            found.append(v if isinstance(v, str) and v else None)
        if found[0] and found[1]:
            return found[0], found[1]
    if cfg is not None and all(_config_id(cfg, f"{kind}_{e}_token") is not None for e in ("start", "end")):
        return getattr(tokenizer, f"{kind}_start_token"), getattr(tokenizer, f"{kind}_end_token")
    return "", ""


def _chat_markers(processor: Any, tokenizer: Any, images: int, frames: int, width: int, height: int,
                  cfg: Any = None) -> dict[str, tuple[str, str]]:
    """The markers a chat template writes around each image and video placeholder: those the processor names
    (:func:`_markers`) but does not write itself when it expands a bare placeholder (Qwen-VL's
    ``<|vision_start|>`` around an image; GLM-4V's ``<|begin_of_video|>``, by which alone its processor tells a
    video from images). Without them adjacent images are one span to Qwen-VL's M-RoPE."""
    import numpy as np

    out = {}
    for kind, n, f in (("image", images, 0), ("video", 0, frames)):
        start, end = _markers(processor, tokenizer, kind, cfg)
        if not (n or f) or not start:
            continue
        ids = np.asarray(_call(processor, min(n, 1), f, width, height)["input_ids"])[0]
        if tokenizer.convert_tokens_to_ids(start) not in ids:
            out[kind] = (start, end)
    return out


def _call(processor: Any, images: int, frames: int, width: int, height: int,
          wraps: dict[str, tuple[str, str]] | None = None) -> Any:
    """The processor run on one sample: ``images`` black images and a black video of ``frames`` frames (taken as
    they are: no frame sampling), after their placeholders in the text, each between the markers of ``wraps``
    (:func:`_chat_markers`)."""
    import numpy as np
    from PIL import Image

    def placed(kind: str, token: str) -> str:
        start, end = (wraps or {}).get(kind, ("", ""))
        return start + token + end

    image = Image.new("RGB", (width, height))
    text = placed("image", prompt_token(processor, "image")) * images
    kwargs: dict[str, Any] = {}
    if frames:
        text += placed("video", prompt_token(processor, "video"))
        from transformers.video_utils import VideoMetadata

        # at 24 fps, transformers' own default where a video's rate is unknown (its timestamps in the prompt)
        meta = VideoMetadata(total_num_frames=frames, fps=24, frames_indices=list(range(frames)))
        kwargs = {"videos": [np.zeros((frames, height, width, 3), dtype=np.uint8)], "do_sample_frames": False,
                  "video_metadata": [meta]}
    try:
        return processor(images=[[image] * images] if images else None, text=[text], return_tensors="np", **kwargs)
    except ValueError as e:
        # a processor that takes one image per sample, not a list per sample (GOT-OCR2's: several are the pages of
        # one document, its multi_page mode): the one image given as it is; several refused with its reason
        if images != 1 or "multi_page" not in str(e):
            raise
    return processor(images=[image], text=[text], return_tensors="np", **kwargs)


def prompt_token(processor: Any, kind: str) -> str:
    """The placeholder of ``kind`` (image, video) that the processor looks for in a prompt: its
    ``{kind}_placeholder_token`` where it has one (Qianfan-OCR's ``<image>``, which its chat template writes and it
    expands into ``<img>``, ``image_token`` ..., ``</img>``), else the ``{kind}_token`` it expands. SetupError where
    it names neither (PP-Chart2Table's processor: the checkpoint's chat template writes the image's tokens)."""
    token = getattr(processor, f"{kind}_placeholder_token", None) or getattr(processor, f"{kind}_token", None)
    if not isinstance(token, str) or not token:
        raise SetupError(f"{type(processor).__name__} names no {kind} token and writes no {kind} placeholders: the "
                         f"prompt's {kind} tokens are written by the checkpoint's chat template, which transformers "
                         "does not ship")
    return token


def video_refusal(model_type: str, pcls: type) -> str:
    """Why this family's video is not counted: its processor class takes none (no ``video_processor`` among its
    attributes), or transformers' auto mapping names no video processor class for it."""
    name = pcls.__name__
    if "video_processor" not in pcls.get_attributes():
        return f"{model_type}'s own processor ({name}) takes no video: give its frames as images instead"
    return (f"{model_type}'s processor ({name}) takes video, but the installed transformers names no video processor "
            "class for it: give its frames as images instead")


def attached(spec: Any) -> Any:
    """``spec`` (a ModelSpec) with its processor's run attached where its images are counted by their processor
    class (``ProcessorSpec.run``): a spec rebuilt from its dict has none."""
    v = spec.vision
    if v is None or v.processor.kind != "processor" or v.processor.run is not None:
        return spec
    replace = dataclasses.replace
    return replace(spec, vision=replace(v, processor=replace(v.processor, run=run_processor)))
