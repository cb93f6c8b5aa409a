"""Qwen2.5-VL's vision side from its ``config.json`` (``model_type: qwen2_5_vl``): the tower and the merger.

:func:`vramlab.core.sources.hf_config.hf_config_to_spec` reads the language model (a Qwen2 decoder) and, through
:func:`vramlab.core.families.piece`, calls :func:`vision_from_config` for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import QWEN2_5_VL
from vramlab.core.sources.files import is_count

# the projector's output width is not in vision_config: vision_config.out_hidden_size is the merger's output
PROJECTS_TO_TEXT = False

# Qwen2.5-VL's vision_config: keys that size the tower must be there; the rest have the released models' values
_QWEN25_VL_VISION_REQUIRED = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
_QWEN25_VL_VISION_DEFAULTS: dict[str, Any] = {
    "patch_size": 14, "temporal_patch_size": 2, "in_channels": 3, "spatial_merge_size": 2, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
}


def vision_from_config(cfg: Mapping[str, Any], text: Mapping[str, Any], source: str, warnings: list[str]) -> Any:
    """Qwen2.5-VL's vision tower and merger from ``vision_config`` (None without one). The processor's pixel
    limits live in preprocessor_config.json, which is not read: the released models' are used, and said so."""
    from vramlab.core.vision import ProcessorSpec, VisionSpec

    vc = cfg.get("vision_config")
    if vc is None:
        return None
    if not isinstance(vc, dict):
        raise SetupError(f"{source}: vision_config must be an object, got {vc!r}")
    missing = [k for k in _QWEN25_VL_VISION_REQUIRED if not is_count(vc.get(k))]
    if missing:
        raise SetupError(f"{source}: vision_config lacks {', '.join('vision_config.' + k for k in missing)}, "
                         "which size Qwen2.5-VL's vision tower")
    values: dict[str, Any] = {k: vc[k] for k in _QWEN25_VL_VISION_REQUIRED}
    for key, default in _QWEN25_VL_VISION_DEFAULTS.items():
        value = vc.get(key, vc.get("in_chans") if key == "in_channels" else None)
        values[key] = default if value is None else value
    if str(values["hidden_act"]).lower() != "silu":
        raise SetupError(f"{source}: vision_config.hidden_act {values['hidden_act']!r}: Qwen2.5-VL's tower is "
                         "modelled with SiLU")
    rope = text.get("rope_scaling") or text.get("rope_parameters") or cfg.get("rope_scaling") or {}
    section = rope.get("mrope_section", [16, 24, 24]) if isinstance(rope, dict) else [16, 24, 24]
    ids = {k: cfg.get(k, text.get(k)) for k in ("image_token_id", "video_token_id", "vision_start_token_id")}
    processor = ProcessorSpec("qwen_vl", patch_size=values["patch_size"], merge_size=values["spatial_merge_size"],
                              temporal_patch_size=values["temporal_patch_size"], min_pixels=3136,
                              max_pixels=12845056)
    warnings.append("the image processor's min_pixels / max_pixels (preprocessor_config.json) are not read: "
                    "Qwen2.5-VL's released 3136 / 12845056 are used; --max-pixels sets yours")
    try:
        return VisionSpec(QWEN2_5_VL, mrope_section=tuple(section), processor=processor,
                          **{k: v for k, v in ids.items() if is_count(v)}, **values)
    except (SetupError, TypeError) as e:
        raise SetupError(f"{source}: vision_config: {e}") from None
