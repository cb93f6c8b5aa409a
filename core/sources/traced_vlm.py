"""A vision-language config without a hand-written program, as a spec whose whole step is traced (issue 16).

The model types of :data:`~vramlab.core.families.registry.TRACED_TOWERS` (SmolVLM / Idefics3, InternVL, Qwen2-VL,
Qwen3-VL, LLaVA-NeXT) become a :class:`~vramlab.core.spec.model.ModelSpec` that carries the whole multimodal config
(``transformers_config``: the language model, the vision tower and the projector, traced together by
:mod:`vramlab.core.tracing.vlm_traced`) and a :class:`~vramlab.core.vision.VisionSpec` with

* the processor's rules, read from the config as the released processors set them
  (:func:`processor_from_config`; the token arithmetic itself is :mod:`vramlab.core.vision`'s, held to
  transformers' image processors by the tests), and
* the tower's and projector's parameters as transformers' class counts them (built on the meta device).

Needs torch and transformers; without them the config is imported as before (its language model only,
with a warning).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import (
    IDEFICS3,
    INTERNVL,
    LLAVA_NEXT,
    QWEN3_VL,
    SMOLVLM,
    TRACED_TOWERS,
    VISION_FAMILY_TYPES,
)
from vramlab.core.sources.remote_code import transformers_vlm_types
from vramlab.core.sources.traced_config import VOLATILE_KEYS, config_fields
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import DType
from vramlab.core.tracing.vlm_processor import DEFAULTS_NOTE, processor_classes, processor_type, run_processor
from vramlab.core.vision import ProcessorSpec, VisionSpec

# the released processors' settings that config.json does not carry (preprocessor_config.json of
# Qwen/Qwen2-VL-*-Instruct and Qwen/Qwen3-VL-*-Instruct; InternVL's GotOcr2 max_patches; Idefics3 / SmolVLM
# resize the longest edge to 4 tiles)
_QWEN2_PIXELS = (3136, 12845056)
_QWEN3_PIXELS = (65536, 16777216)
_INTERNVL_MAX_TILES = 12
_IDEFICS3_TILES_PER_EDGE = 4


def _probe(processor: ProcessorSpec, config: Any) -> tuple[str, ...]:
    """The family's processor run once on a square image: it must take it and put the image token that the
    config names into the text (else the model would find no images where the processor put them). Its note for
    the user where the checkpoint's processor files were not there (the class defaults stand in)."""
    from vramlab.core.tracing.vlm_traced import token_ids

    try:
        run = run_processor(processor.config, 1, 448, 448, 0, processor.settings)
        image = token_ids(config)["image"]
    except SetupError as e:
        raise NotTraceable(str(e)) from None
    if image not in run.row:
        raise NotTraceable(f"{run.processor} writes no image token with the config's id {image}")
    return tuple(n for n in run.notes if n.startswith((f"{run.processor}:", f"{run.processor}{DEFAULTS_NOTE}")))


def _patch(vc: Any) -> int:
    v = getattr(vc, "patch_size", 14)
    return _side(v) if isinstance(v, (int, list, tuple)) else 14


def _side(v: Any) -> int:
    return int(v[0]) if isinstance(v, (list, tuple)) else int(v)


def processor_from_config(cfg: Mapping[str, Any]) -> ProcessorSpec:
    """The image processor's rules for the config of a traced vision-language model."""
    mt = cfg.get("model_type")
    kind = TRACED_TOWERS.get(mt)
    vc = cfg.get("vision_config") or {}
    if kind is None or not isinstance(vc, Mapping):
        raise SetupError(f"{mt}: no processor rules for this vision-language model")
    try:
        patch = _side(vc.get("patch_size", 14))
        if kind == "qwen_vl":
            lo, hi = _QWEN3_PIXELS if mt == QWEN3_VL else _QWEN2_PIXELS
            return ProcessorSpec("qwen_vl", patch_size=patch, merge_size=int(vc.get("spatial_merge_size", 2)),
                                 temporal_patch_size=int(vc.get("temporal_patch_size", 2)), min_pixels=lo,
                                 max_pixels=hi, video_whole_clip=mt == QWEN3_VL)
        tile = _side(vc.get("image_size", 224))
        if kind == IDEFICS3:
            scale = int(cfg.get("scale_factor", 2))
            # SmolVLM's video processor resizes every frame to its max_image_size: the tower's side, as for images
            return ProcessorSpec(IDEFICS3, patch_size=patch, tile_size=tile,
                                 tokens_per_tile=(tile // patch) ** 2 // scale ** 2,
                                 longest_edge=_IDEFICS3_TILES_PER_EDGE * tile,
                                 video_frame=tile if mt == SMOLVLM else 0)
        if kind == INTERNVL:
            ratio = float(cfg.get("downsample_ratio", 0.5))
            tokens = round((tile // patch) ** 2 * ratio * ratio)
            return ProcessorSpec(INTERNVL, patch_size=patch, tile_size=tile, tokens_per_tile=tokens,
                                 max_tiles=_INTERNVL_MAX_TILES, cls_token=True)
        pins = cfg.get("image_grid_pinpoints") or ()
        return ProcessorSpec(LLAVA_NEXT, patch_size=patch, tile_size=tile, cls_token=True,
                             grid_pinpoints=tuple(tuple(int(x) for x in p) for p in pins))
    except (TypeError, ValueError) as e:
        raise SetupError(f"{mt}: the vision_config cannot be read for its processor ({e})") from None


def traceable_vlm(model_type: object) -> bool:
    """Whether a config of this top-level type is traced whole here (torch and transformers installed): the
    families with processor rules of their own (TRACED_TOWERS) and any other image-text-to-text family the
    installed transformers ships whose processor class runs here (:func:`processor_problem`)."""
    if not isinstance(model_type, str) or model_type in VISION_FAMILY_TYPES:
        return False
    vlm_types = transformers_vlm_types()  # read from transformers' source: no import for a config of another kind
    if model_type not in TRACED_TOWERS and vlm_types is not None and model_type not in vlm_types:
        return False
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    if model_type in TRACED_TOWERS:
        return True
    return processor_problem(model_type) is None


def traced_instead(cfg: Mapping[str, Any], settings: str = "") -> bool:
    """Whether the config of a vision family with a folder of its own, whose hand-written reading does not model
    its tower, is traced whole instead: where its images are made by another family's processor (its tower's, or
    the one its processor_config.json names: :func:`~vramlab.core.tracing.vlm_processor.processor_type`; a LLaVA
    wrapper around a Pixtral tower, Pixtral-12B, whose images PixtralProcessor makes), transformers ships an
    image-text-to-text class for its type, and that processor runs here. (A config of the family's own towers that
    its folder does not read stays its language model, with the folder's warning.)"""
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or mt not in VISION_FAMILY_TYPES:
        return False
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    try:
        other = processor_type(cfg, settings)
    except SetupError:  # transformers' processors do not import here: read as its language model, as before
        return False
    return other != mt and processor_problem(mt, other) is None


class NotTraceable(SetupError):
    """A family without processor rules of its own whose processor or class cannot answer here: its config is
    read as its language model only, with this reason in the warning."""


def why_not_traced(model_type: object) -> str:
    """The clause a text-only import of a multimodal config ends with: why its images cannot be answered here
    (its processor cannot run, or transformers has no image-text-to-text class for it); "" when unknown."""
    if not isinstance(model_type, str) or not model_type or model_type in VISION_FAMILY_TYPES:
        return ""
    try:
        problem = processor_problem(model_type)
    except ImportError:
        return ""
    return f" ({problem}), and --images is refused" if problem else ""


def processor_problem(model_type: str, processor: str | None = None) -> str | None:
    """Why the images of this family cannot be counted by its own processor here, or None when they can
    (an image-text-to-text family of the installed transformers whose processor class can be built).
    ``processor``: the model type whose processor makes its images, where it is not ``model_type``."""
    from transformers.models.auto import modeling_auto as ma

    if model_type not in ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return f"transformers has no image-text-to-text class for {model_type}"
    try:
        processor_classes(processor or model_type)
    except SetupError as e:
        return str(e)
    return None


def traced_vlm_spec(cfg: Mapping[str, Any], *, id: str, name: str, source: str,
                    dtype: DType | None, settings: str = "") -> tuple[ModelSpec, tuple[str, ...]]:
    """The spec of a vision-language config traced whole, and the warnings for the user. ``settings``: the
    checkpoint's processor files (:func:`~vramlab.core.sources.files.load_processor_files`), read by a
    family whose images its processor class counts."""
    import torch

    from vramlab.core.kinds import Kind
    from vramlab.core.sources.traced_config import canonical_text, config_from_dict
    from vramlab.core.tracing.vlm_traced import kind_of, tower_depth, transformers_class, vision_parts

    mt = cfg["model_type"]
    data = {k: v for k, v in cfg.items() if k not in VOLATILE_KEYS}
    try:
        config = config_from_dict(data)
        text = canonical_text(config)
        cls = transformers_class(config)
        with torch.device("meta"):
            model = cls._from_config(config)
    except SetupError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, AssertionError, RuntimeError) as e:
        error = NotTraceable if mt not in TRACED_TOWERS else SetupError  # the former: read as its language model
        raise error(f"{source}: transformers cannot build this {mt} config ({e})") from None
    try:
        tower_parts, projector_parts = vision_parts(model)
    except SetupError as e:
        if mt in TRACED_TOWERS:
            raise
        raise NotTraceable(str(e)) from None

    counts = {Kind.VISION_WEIGHTS: 0, Kind.PROJECTOR_WEIGHTS: 0, None: 0}
    for pname, p in model.named_parameters():
        counts[kind_of(pname, tower_parts, projector_parts)] += p.numel()
    total = sum(counts.values())
    try:
        fields = config_fields(config.text_config)
    except (AttributeError, ValueError, TypeError, RuntimeError) as e:  # a per-layer size (heterogeneous configs)
        error = NotTraceable if mt not in TRACED_TOWERS else SetupError
        raise error(f"{source}: the language model's sizes cannot be read ({' '.join(str(e).split())[:160]})") \
            from None
    vc = config.vision_config
    told: tuple[str, ...] = ()
    if mt in TRACED_TOWERS:
        processor = processor_from_config(cfg)
    else:  # the family's own processor class, run on the user's image size (core/tracing/vlm_processor.py)
        processor = ProcessorSpec("processor", patch_size=_patch(vc), config=text, settings=settings,
                                  run=run_processor)
        told = _probe(processor, config)
    try:
        width = int(getattr(vc, "embed_dim", 0) or vc.hidden_size)  # Qwen2-VL: hidden_size is the merger's output
        inter = int(getattr(vc, "intermediate_size", 0) or width * float(getattr(vc, "mlp_ratio", 4)))
        # a family's type traced instead of its folder (Pixtral-12B) is named by its tower, whose rules are not the
        # family's (its folder's rules would be read for the family's own type)
        vtype = str(getattr(vc, "model_type", "") or mt) if mt in VISION_FAMILY_TYPES else mt
        vision = VisionSpec(vtype, depth=tower_depth(config), hidden_size=width,
                            num_heads=int(getattr(vc, "num_attention_heads", 0) or getattr(vc, "num_heads", 1)),
                            intermediate_size=inter, out_hidden_size=fields["hidden_size"],
                            patch_size=processor.patch_size, processor=processor,
                            counted_tower=counts[Kind.VISION_WEIGHTS],
                            counted_projector=counts[Kind.PROJECTOR_WEIGHTS])
        spec = ModelSpec(id=id, name=name, family=mt, checkpoint_dtype=dtype or DType.BF16, source=source,
                         transformers_config=text, counted_params=total, vision=vision, **fields)
    except SetupError as e:
        raise SetupError(f"{source}: {e}") from None
    what = f"{mt}'s hand-written program does not model its {vtype} tower" if mt in VISION_FAMILY_TYPES else \
        f"{mt} has no hand-written program"
    warnings = (f"{what}: its estimate is traced from transformers' "
                f"{cls.__name__} whole (vision tower, projector and language model) at the images' geometry; "
                "the first estimate of a recipe and image size takes seconds, later ones come from the cache", *told)
    return spec, warnings
