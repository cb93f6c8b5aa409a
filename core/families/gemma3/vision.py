"""Gemma 3's vision rules (pure Python): SigLIP's tower without its head and the average-pooling projector, by
:class:`vramlab.core.vision.VisionSpec`'s fields (see :mod:`vramlab.core.families.vlm_base.vision`)."""

from __future__ import annotations

import math
from typing import Any

from vramlab.core.checks import SetupError, check_int
from vramlab.core.families.vlm_base.vision import (
    check_tile,
    no_language_extra,
    no_setup_check,
    no_setup_notes,
    siglip_tower_params,
    vit_block_params,
    vit_lora_params_per_rank,
)

READS = ("image_size",)  # SigLIP's last hidden state is the projector's input (no feature layer)
AUTOCAST = True  # its step under CUDA autocast is modelled
QUANTIZED = True  # its quantized load is emulated
SHARDED = True  # ZeRO-3 / FSDP: its tower's blocks are units as in the model's _no_split_modules
# the RMSNorms transformers 5.25 decorates use_kernel_forward_from_hub("RMSNorm") (the Hub kernels swap them:
# core/spec/hub_kernels.py): none, Gemma 3's offset norms are not decorated
HUB_NORMS = ""
CLS_POSITION = False
language_extra_params = no_language_extra
check_setup = no_setup_check
setup_notes = no_setup_notes
block_params = vit_block_params
tower_params = siglip_tower_params
lora_params_per_rank = vit_lora_params_per_rank


def check(v: Any) -> None:
    check_tile(v)
    check_int("feature_layer", v.feature_layer, -v.depth - 1, v.depth, "vision_feature_layer")
    # the projector average-pools the patch grid to tokens_per_tile
    side, tokens = v.image_size // v.patch_size, v.processor.tokens_per_tile
    per_side = math.isqrt(tokens)
    if tokens < 1 or per_side * per_side != tokens or side % per_side:
        raise SetupError(f"mm_tokens_per_image {tokens} must be a square whose side divides the "
                         f"{side} patches per side")


def projector_params(v: Any) -> int:
    """Gemma3MultiModalProjector: RMSNorm and the (d, o) projection weight."""
    return v.hidden_size + v.hidden_size * v.out_hidden_size
