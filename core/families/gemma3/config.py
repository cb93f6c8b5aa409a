"""Gemma 3's vision side from its ``config.json`` (``model_type: gemma3``): the SigLIP tower and the projector.

:func:`vramlab.core.sources.hf_config.hf_config_to_spec` reads the language model from ``text_config`` and
calls :func:`vision_from_config` (found through :func:`vramlab.core.families.piece`) for the rest. A tower that
is not modelled (another tower type, SigLIP's pooling head kept, another activation) or a size key absent leaves
the language model alone, with a warning that names the key; a size key of the wrong type is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import GEMMA3, SIGLIP_VISION
from vramlab.core.families.vlm_base.config import fixed_tile_tower, unmodelled
from vramlab.core.sources.files import is_count

# SiglipVisionConfig's size keys: transformers' defaults (a 224 px base tower) are not Gemma 3's, so each must
# be there (google/gemma-3-*-it's config.json writes them all)
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
            "patch_size")
PAN_AND_SCAN_MAX_CROPS = 4  # Gemma3ImageProcessor's pan_and_scan_max_num_crops
# the projector's output width is not in vision_config: the language model's hidden size (set once it is read)
PROJECTS_TO_TEXT = True


def vision_from_config(cfg: Mapping[str, Any], text: Mapping[str, Any], source: str,
                       warnings: list[str]) -> Any:
    """The ``VisionSpec`` of a Gemma 3 config, or None (with a warning) where it is not modelled."""
    vc = cfg.get("vision_config")
    if vc is None:
        return None
    if not isinstance(vc, dict):
        raise SetupError(f"{source}: vision_config must be an object, got {vc!r}")
    bad = [k for k in REQUIRED if k in vc and (not is_count(vc[k]) or vc[k] == 0)]
    if bad:
        raise SetupError(f"{source}: vision_config.{bad[0]} must be a positive whole number, got {vc[bad[0]]!r}")
    tokens = cfg.get("mm_tokens_per_image", 256)
    if not is_count(tokens) or tokens == 0:
        raise SetupError(f"{source}: mm_tokens_per_image must be a positive whole number, got {tokens!r}")
    checks = (("vision_config.model_type", vc.get("model_type", SIGLIP_VISION), SIGLIP_VISION,
               "a SigLIP vision tower"),
              ("vision_config.vision_use_head", vc.get("vision_use_head", True), False, "no pooling head"),
              ("vision_config.hidden_act", vc.get("hidden_act", "gelu_pytorch_tanh"), "gelu_pytorch_tanh",
               "SigLIP's tanh GELU"))
    reasons = unmodelled(checks, vc, REQUIRED)
    if reasons:
        warnings.append(f"Gemma 3's vision tower is not modelled for this config: {'; '.join(reasons)}")
        return None
    return fixed_tile_tower(GEMMA3, vc, source=source, hidden_act="gelu_pytorch_tanh",
                            image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 262_144)),
                            processor={"tokens_per_tile": tokens, "pan_and_scan_max_crops": PAN_AND_SCAN_MAX_CROPS})
