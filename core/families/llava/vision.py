"""LLaVA-1.5's vision rules (pure Python): CLIP's tower and the two-linear projector, by
:class:`vramlab.core.vision.VisionSpec`'s fields (see :mod:`vramlab.core.families.vlm_base.vision`)."""

from __future__ import annotations

from typing import Any

from vramlab.core.checks import check_int
from vramlab.core.families.vlm_base.vision import (
    check_tile,
    no_language_extra,
    no_setup_check,
    no_setup_notes,
    vit_block_params,
    vit_lora_params_per_rank,
)

# CLIP's input side and the hidden state the projector reads (vision_feature_layer)
READS = ("image_size", "feature_layer")
AUTOCAST = True  # its step under CUDA autocast is modelled
QUANTIZED = True  # its quantized load is emulated
SHARDED = True  # ZeRO-3 / FSDP: its tower's blocks are units as in the model's _no_split_modules
# the RMSNorms transformers 5.25 decorates use_kernel_forward_from_hub("RMSNorm") (the Hub kernels swap them:
# core/spec/hub_kernels.py): the language model's, as its text family's (CLIP's LayerNorms are not decorated)
HUB_NORMS = "the language model's RMSNorms"
CLS_POSITION = True  # CLIP's class embedding
language_extra_params = no_language_extra
check_setup = no_setup_check
setup_notes = no_setup_notes
block_params = vit_block_params
lora_params_per_rank = vit_lora_params_per_rank


def check(v: Any) -> None:
    check_tile(v)
    check_int("feature_layer", v.feature_layer, -v.depth - 1, v.depth, "vision_feature_layer")


def tower_params(v: Any) -> int:
    """CLIPVisionModel: CLS, Conv2d (no bias), positions, pre/post LayerNorms, the layers."""
    d = v.hidden_size
    conv = d * v.in_channels * v.patch_size ** 2
    return d + conv + v.positions * d + 4 * d + v.depth * block_params(v)


def projector_params(v: Any) -> int:
    """LlavaMultiModalProjector: linear_1, GELU, linear_2 (biases)."""
    d, o = v.hidden_size, v.out_hidden_size
    return d * o + o + o * o + o
