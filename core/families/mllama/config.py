"""Llama 3.2 Vision's vision side from its ``config.json`` (``model_type: mllama``): the tower, the projector and
the language model's cross-attention layers, which the family's vision rules read
(:func:`vramlab.core.families.mllama.vision.vision_from_config`) with the rest of the config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramlab.core.families.mllama import vision

# the projector's output width is vision_config's own
PROJECTS_TO_TEXT = False


def vision_from_config(cfg: Mapping[str, Any], text: Mapping[str, Any], source: str, warnings: list[str]) -> Any:
    """The ``VisionSpec`` of an mllama config (its language model cannot be imported without it)."""
    return vision.vision_from_config(cfg, source, warnings)
