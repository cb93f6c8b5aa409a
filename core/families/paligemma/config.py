"""PaliGemma's vision side from its ``config.json`` (``model_type: paligemma``): the SigLIP tower, the linear
projector and the processor's fixed tile.

The language model is ``text_config``'s, read by the text readers (Gemma's for PaliGemma 1). What the
hand-written program cannot run exactly is refused in one line naming the key: PaliGemma 2's Gemma 2 language
model, another tower type, SigLIP's pooling head kept, another activation, a projection width that is not the
language model's, a size key absent (transformers' SigLIP defaults are a base tower, not PaliGemma's).

Found as ``vision_from_config(cfg, text, source, warnings)`` through :func:`vramlab.core.families.piece`, where
the config reader asks a family's ``config`` piece for its tower.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import GEMMA, KIND_SIGLIP_FIXED, PALIGEMMA, SIGLIP_VISION
from vramlab.core.sources.files import is_count

# SiglipVisionConfig's size keys whose defaults are not PaliGemma's (google/paligemma-*'s config.json writes
# them); image_size is left to SiglipVisionConfig's default, 224, as google/paligemma-3b-pt-224 leaves it
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size")
SIGLIP_IMAGE_SIZE = 224  # SiglipVisionConfig's image_size
IMAGE_TOKEN_INDEX = 256_000  # PaliGemmaConfig's image_token_index
PROJECTION_DIM = 2048  # PaliGemmaConfig's projection_dim
# the projector's output width is the config's projection_dim (held equal to the language model's width here)
PROJECTS_TO_TEXT = False


# the keys of text_config this family reads itself (the text reader leaves them to it)
TEXT_KEYS = ("num_image_tokens",)

def vision_from_config(cfg: Mapping[str, Any], text: Mapping[str, Any], source: str, warnings: list[str]) -> Any:
    """The ``VisionSpec`` of a PaliGemma config; a config the program cannot run exactly is refused."""
    from vramlab.core.vision import ProcessorSpec, VisionSpec

    vc = cfg.get("vision_config")
    if not isinstance(vc, dict):
        raise SetupError(f"{source}: vision_config must be an object, got {vc!r}")
    for key in (*REQUIRED, "image_size", "num_channels"):
        if key in vc and (not is_count(vc[key]) or vc[key] == 0):
            raise SetupError(f"{source}: vision_config.{key} must be a positive whole number, got {vc[key]!r}")
    for key, default in (("projection_dim", PROJECTION_DIM), ("image_token_index", IMAGE_TOKEN_INDEX)):
        if not is_count(cfg.get(key, default)):
            raise SetupError(f"{source}: {key} must be a whole number, got {cfg[key]!r}")
    text_type = text.get("model_type", GEMMA)
    if text_type != GEMMA:
        raise SetupError(f"{source}: text_config.model_type {text_type!r}: PaliGemma is modelled with a Gemma "
                         "language model (PaliGemma 2's Gemma 2 is not)")
    missing = [k for k in REQUIRED if k not in vc]
    width, proj = text.get("hidden_size"), cfg.get("projection_dim", PROJECTION_DIM)
    reasons = [f"{key} {value!r} (modelled: {want!r})" for key, value, want in (
        ("vision_config.model_type", vc.get("model_type", SIGLIP_VISION), SIGLIP_VISION),
        ("vision_config.vision_use_head", vc.get("vision_use_head", True), False),
        ("vision_config.hidden_act", vc.get("hidden_act", "gelu_pytorch_tanh"), "gelu_pytorch_tanh"),
        ("projection_dim", proj, width if width is not None else proj)) if value != want]
    if missing:
        reasons.append(f"vision_config lacks {', '.join('vision_config.' + k for k in missing)}")
    if reasons:
        raise SetupError(f"{source}: PaliGemma's vision side is not modelled for this config: {'; '.join(reasons)}")
    size, patch = vc.get("image_size", SIGLIP_IMAGE_SIZE), vc["patch_size"]
    side = size // patch
    noted = text.get("num_image_tokens")  # PaliGemmaConfig's note on its text config: (image_size / patch)²
    if noted is not None and noted != side * side:
        raise SetupError(f"{source}: text_config.num_image_tokens {noted!r} is not (image_size / patch_size)² = "
                         f"{side * side}, the tokens transformers' class makes of an image")
    try:
        processor = ProcessorSpec(KIND_SIGLIP_FIXED, patch_size=patch, tile_size=size, tokens_per_tile=side * side)
        return VisionSpec(PALIGEMMA, depth=vc["num_hidden_layers"], hidden_size=vc["hidden_size"],
                          num_heads=vc["num_attention_heads"], intermediate_size=vc["intermediate_size"],
                          out_hidden_size=proj, patch_size=patch, in_channels=vc.get("num_channels", 3),
                          hidden_act="gelu_pytorch_tanh", image_size=size,
                          image_token_id=cfg.get("image_token_index", IMAGE_TOKEN_INDEX), processor=processor)
    except (SetupError, TypeError) as e:
        raise SetupError(f"{source}: vision_config: {e}") from None
