"""What the vision rules of several families share (pure Python): the parameters of a ViT encoder layer as
CLIP, SigLIP and Mllama's tower build it (two LayerNorms, q/k/v/out projections, fc1, fc2), and the rank-one
LoRA parameters of its six linears.

A family's ``vision`` piece (``core/families/<family>/vision.py``) answers
:class:`vramlab.core.vision.VisionSpec` for its ``model_type``; every rules module gives the same names and takes
the VisionSpec as its argument (never importing :mod:`vramlab.core.vision`, which asks it):

* ``READS``: the family-specific VisionSpec fields it reads (the others are left out of its dict);
  ``CLS_POSITION``: whether its fixed-size tower adds a CLS position to each image's patches;
* ``AUTOCAST``: whether the estimate models its step under CUDA autocast (held to transformers' classes under
  the emulated autocast); ``QUANTIZED``: whether its quantized load (bitsandbytes) is emulated and estimated;
  ``SHARDED``: whether its program gathers the FSDP units of the model's ``_no_split_modules`` (ZeRO-3 / FSDP);
* ``check(v)``: its fields refused with a reason; ``check_setup(spec, setup)``: what transformers cannot train;
  ``setup_notes(spec, setup)``: what the estimate of a setup should say of the family;
* ``block_params``, ``tower_params``, ``projector_params``, ``language_extra_params(v, spec)``,
  ``lora_params_per_rank``: the parameter counts, held to transformers' classes on the meta device.
"""

from __future__ import annotations

from typing import Any

from vramlab.core.checks import SetupError, check_int


def vit_layer_params(d: int, i: int, attn_bias: bool = True) -> int:
    """A ViT encoder layer: two LayerNorms, q/k/v/out (with biases where ``attn_bias``), fc1 and fc2 (biases)."""
    return 4 * d + 4 * (d * d + (d if attn_bias else 0)) + (i * d + i) + (d * i + d)


def vit_layer_lora(d: int, i: int) -> int:
    """LoRA parameters per rank on a ViT layer's q/k/v/out projections, fc1 and fc2."""
    return 4 * (d + d) + (d + i) + (i + d)


def vit_block_params(v: Any) -> int:
    """``block_params`` of a CLIP or SigLIP tower: :func:`vit_layer_params` at its widths."""
    return vit_layer_params(v.hidden_size, v.intermediate_size)


def vit_lora_params_per_rank(v: Any) -> int:
    """``lora_params_per_rank`` of a CLIP or SigLIP tower: :func:`vit_layer_lora` in each of its layers."""
    return vit_layer_lora(v.hidden_size, v.intermediate_size) * v.depth


def siglip_tower_params(v: Any) -> int:
    """``tower_params`` of SiglipVisionModel without its head: Conv2d with bias, positions, post_layernorm, the
    layers."""
    d = v.hidden_size
    conv = d * v.in_channels * v.patch_size ** 2 + d
    return conv + v.positions * d + 2 * d + v.depth * vit_block_params(v)


def check_tile(v: Any) -> None:
    """A fixed-size tower: its input side is a whole number of patches."""
    check_int("image_size", v.image_size, v.patch_size, 32_768, "vision image_size")
    if v.image_size % v.patch_size:
        raise SetupError(f"vision image_size {v.image_size} is not a multiple of patch_size {v.patch_size}")


def no_setup_check(spec: Any, setup: Any) -> None:
    """A family whose training setups need nothing beyond the shared vision checks."""


def no_setup_notes(spec: Any, setup: Any) -> list[str]:
    """A family without notes of its own on a setup."""
    return []


def no_language_extra(v: Any, spec: Any) -> int:
    """A token-merging family: its language model is the text spec's, nothing more."""
    return 0
