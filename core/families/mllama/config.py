"""Llama 3.2 Vision's vision side from its ``config.json`` (``model_type: mllama``): the tower, the projector and
the cross-attention layers as a :class:`vramlab.core.vision.VisionSpec`."""

from __future__ import annotations

from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import KIND_MLLAMA, MLLAMA
from vramlab.core.vision import ProcessorSpec, VisionSpec

# transformers' MllamaVisionConfig defaults for the keys a config may leave out
_DEFAULT_VISION = {"max_num_tiles": 4, "intermediate_layers_indices": [3, 7, 15, 23, 30],
                   "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]],
                   "num_channels": 3, "hidden_act": "gelu"}
_REQUIRED_VISION = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_global_layers", "image_size",
                    "patch_size")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _indices(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in value)


# the projector's output width is the language model's hidden size, read here from text_config itself
PROJECTS_TO_TEXT = False


def vision_from_config(cfg: Any, text: Any, source: str, warnings: list[str]) -> Any:
    """Llama 3.2 Vision's tower, projector and cross-attention layers from an ``mllama`` config.json. Its
    language model cannot be imported without them (its cross-attention layers attend to the tower), so a
    config that does not describe them is refused with the key that is missing or unreadable."""
    vc, tc = cfg.get("vision_config"), cfg.get("text_config")
    if not isinstance(vc, dict) or not isinstance(tc, dict):
        raise SetupError(f"{source}: an mllama config needs vision_config and text_config objects")
    heads = vc.get("attention_heads", vc.get("num_attention_heads"))
    for key in _REQUIRED_VISION:
        if not _count(vc.get(key)):
            raise SetupError(f"{source}: vision_config.{key} must be a positive whole number, got {vc.get(key)!r}")
    if not _count(heads):
        raise SetupError(f"{source}: vision_config.attention_heads must be a positive whole number, got {heads!r}")
    cross = tc.get("cross_attention_layers")
    if not _indices(cross):
        raise SetupError(f"{source}: text_config.cross_attention_layers must be a list of layer indices, "
                         f"got {cross!r}")
    layers_total = tc.get("num_hidden_layers")
    if _count(layers_total) and not all(0 <= i < layers_total for i in cross):
        raise SetupError(f"{source}: text_config.cross_attention_layers {cross} name layers outside the "
                         f"{layers_total} of num_hidden_layers")
    defaulted = [k for k in _DEFAULT_VISION if k not in vc]
    if defaulted:
        warnings.append(f"vision_config leaves {', '.join(defaulted)} to transformers' mllama defaults")
    get = {**_DEFAULT_VISION, **vc}.get
    tiles, layers, ratios = get("max_num_tiles"), get("intermediate_layers_indices"), get("supported_aspect_ratios")
    if not _count(tiles) or not _indices(layers) or not isinstance(ratios, list) or not ratios:
        raise SetupError(f"{source}: vision_config.max_num_tiles / intermediate_layers_indices / "
                         "supported_aspect_ratios are not readable")
    if get("hidden_act") != "gelu":
        raise SetupError(f"{source}: vision_config.hidden_act {get('hidden_act')!r} is not modelled (GELU is)")
    out_dim = vc.get("vision_output_dim", vc["hidden_size"] * (1 + len(layers)))
    if out_dim != vc["hidden_size"] * (1 + len(layers)):
        raise SetupError(f"{source}: vision_config.vision_output_dim {out_dim!r} is not hidden_size x "
                         f"(1 + {len(layers)} intermediate layers), which transformers' tower produces")
    size, patch = vc["image_size"], vc["patch_size"]
    try:
        processor = ProcessorSpec(KIND_MLLAMA, patch_size=patch, tile_size=size, max_tiles=tiles, cls_token=True)
        return VisionSpec(MLLAMA, depth=vc["num_hidden_layers"], global_depth=vc["num_global_layers"],
                          hidden_size=vc["hidden_size"], num_heads=heads, intermediate_size=vc["intermediate_size"],
                          out_hidden_size=tc.get("hidden_size", 4096), patch_size=patch,
                          in_channels=get("num_channels"), hidden_act="gelu", image_size=size,
                          intermediate_layers=tuple(layers), aspect_ratios=len(ratios),
                          cross_attention_layers=tuple(cross),
                          image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 128256)),
                          processor=processor)
    except (SetupError, TypeError) as e:
        raise SetupError(f"{source}: vision_config: {e}") from None
