"""The config reading shared by the families whose vision tower is a ViT at one fixed tile size (LLaVA's CLIP,
Gemma 3's SigLIP): what of a ``vision_config`` the tower's program does not model, and the tower's VisionSpec."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vramlab.core.checks import SetupError


def unmodelled(checks: Iterable[tuple[str, Any, Any, str]], vc: Mapping[str, Any], required: Iterable[str],
               also: Iterable[str] = ()) -> list[str]:
    """Why the config is not the modelled tower: each ``(key, value, modelled value, what it is)`` of ``checks``
    that differs, then ``also``, then the ``required`` size keys ``vc`` lacks (empty: it is the modelled one)."""
    reasons = [f"{key} {value!r} (modelled: {what}, {want!r})" for key, value, want, what in checks if value != want]
    reasons += also
    missing = [k for k in required if k not in vc]
    if missing:
        reasons.append(f"vision_config lacks {', '.join('vision_config.' + k for k in missing)}")
    return reasons


def fixed_tile_tower(model_type: str, vc: Mapping[str, Any], *, source: str, hidden_act: str, image_token_id: Any,
                     processor: Mapping[str, Any], **extra: Any) -> Any:
    """The VisionSpec of a fixed-tile tower sized by ``vc`` (its projector's output width is set once the language
    model is read); ``processor``: the ``siglip_fixed`` processor's rules besides the patch and tile sizes."""
    from vramlab.core.vision import ProcessorSpec, VisionSpec

    size, patch = vc["image_size"], vc["patch_size"]
    try:
        return VisionSpec(model_type, depth=vc["num_hidden_layers"], hidden_size=vc["hidden_size"],
                          num_heads=vc["num_attention_heads"], intermediate_size=vc["intermediate_size"],
                          out_hidden_size=1, patch_size=patch, in_channels=vc.get("num_channels", 3),
                          hidden_act=hidden_act, image_size=size, image_token_id=image_token_id,
                          processor=ProcessorSpec("siglip_fixed", patch_size=patch, tile_size=size, **processor),
                          **extra)
    except (SetupError, TypeError) as e:
        raise SetupError(f"{source}: vision_config: {e}") from None
