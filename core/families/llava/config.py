"""LLaVA-1.5's vision side from its ``config.json`` (``model_type: llava``): the CLIP tower and the projector.

:func:`vramlab.core.sources.hf_config.hf_config_to_spec` reads the language model from ``text_config`` and,
through :func:`vramlab.core.families.piece`, calls :func:`vision_from_config` for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import CLIP_VISION, LLAVA
from vramlab.core.families.vlm_base.config import fixed_tile_tower, unmodelled
from vramlab.core.sources.files import is_count

# the projector's output width is not in vision_config: the language model's hidden size (set once it is read)
PROJECTS_TO_TEXT = True

# LLaVA-1.5's vision_config (CLIPVisionConfig): the keys that size the tower must be there
_LLAVA_VISION_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "image_size", "patch_size")


def vision_from_config(cfg: Mapping[str, Any], text: Mapping[str, Any], source: str,
                      warnings: list[str]) -> Any:
    """LLaVA-1.5's CLIP tower and projector from ``vision_config`` and the wrapper's keys. None, with a warning
    naming the key, where the tower is not modelled (another tower, several feature layers, the CLS kept,
    another projector) or a size key is absent: the language model alone is imported, as for any multimodal
    config. A size key of the wrong type is refused."""
    vc = cfg.get("vision_config")
    if vc is None:
        return None
    if not isinstance(vc, dict):
        raise SetupError(f"{source}: vision_config must be an object, got {vc!r}")
    bad = [k for k in _LLAVA_VISION_REQUIRED if k in vc and not is_count(vc[k])]
    if bad:
        raise SetupError(f"{source}: vision_config.{bad[0]} must be a positive whole number, got {vc[bad[0]]!r}")
    tower = vc.get("model_type", CLIP_VISION)
    checks = (("vision_config.model_type", tower, CLIP_VISION, "a CLIP vision tower"),
              ("vision_feature_select_strategy", cfg.get("vision_feature_select_strategy", "default"), "default",
               "the CLS position dropped"),
              ("projector_hidden_act", cfg.get("projector_hidden_act", "gelu"), "gelu", "a GELU projector"),
              ("multimodal_projector_bias", cfg.get("multimodal_projector_bias", True), True, "projector biases"),
              ("vision_config.hidden_act", vc.get("hidden_act", "quick_gelu"), "quick_gelu", "CLIP's quick GELU"))
    layer = cfg.get("vision_feature_layer", -2)
    one_layer = () if isinstance(layer, int) and not isinstance(layer, bool) else \
        (f"vision_feature_layer {layer!r} (modelled: one feature layer)",)
    reasons = unmodelled(checks, vc, _LLAVA_VISION_REQUIRED, also=one_layer)
    if reasons:
        warnings.append(f"LLaVA's vision tower is not modelled for this config: {'; '.join(reasons)}")
        return None
    size, patch = vc["image_size"], vc["patch_size"]
    return fixed_tile_tower(LLAVA, vc, source=source, hidden_act="quick_gelu", feature_layer=layer,
                            image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 32000)),
                            processor={"tokens_per_tile": (size // patch) ** 2, "cls_token": True})
