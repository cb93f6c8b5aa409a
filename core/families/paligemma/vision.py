"""PaliGemma's vision rules (pure Python): SigLIP's tower without its head and the one-linear projector, by
:class:`vramlab.core.vision.VisionSpec`'s fields (see :mod:`vramlab.core.families.vlm_base.vision`).

``PaliGemmaProcessor`` resizes every image to the tower's ``image_size`` square and writes one ``<image>``
token per patch: (image_size / patch_size)² tokens an image (256 at 224 px), no pooling, no crops.
"""

from __future__ import annotations

from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.families.vlm_base.vision import (
    check_tile,
    no_language_extra,
    no_setup_notes,
    siglip_tower_params,
    vit_block_params,
    vit_lora_params_per_rank,
)

READS = ("image_size",)  # SigLIP's last hidden state is the projector's input (no feature layer)
AUTOCAST = True  # its step under CUDA autocast is modelled (exact against transformers' class)
QUANTIZED = True  # its quantized load is emulated (its step exact against transformers' class)
SHARDED = True  # ZeRO-3 / FSDP: its tower's blocks are units as in the model's _no_split_modules
# the RMSNorms transformers 5.25 decorates use_kernel_forward_from_hub("RMSNorm") (the Hub kernels swap them:
# core/spec/hub_kernels.py): none, Gemma's offset norms are not decorated
HUB_NORMS = ""
CLS_POSITION = False
language_extra_params = no_language_extra
setup_notes = no_setup_notes
block_params = vit_block_params
tower_params = siglip_tower_params
lora_params_per_rank = vit_lora_params_per_rank


def check(v: Any) -> None:
    check_tile(v)
    p, side = v.processor, v.image_size // v.patch_size
    if p.kind != "siglip_fixed" or p.tile_size != v.image_size or p.patch_size != v.patch_size:
        raise SetupError(f"PaliGemma's processor resizes every image to the tower's {v.image_size} px tile "
                         f"(siglip_fixed, tile_size {v.image_size}, patch_size {v.patch_size})")
    if p.tokens_per_tile != side * side:
        raise SetupError(f"PaliGemma writes one image token per patch: {side * side} an image, not "
                         f"{p.tokens_per_tile}")
    if p.pan_and_scan_max_crops:
        raise SetupError("PaliGemma's processor has no pan-and-scan crops")


def projector_params(v: Any) -> int:
    """PaliGemmaMultiModalProjector: one Linear(vision hidden, projection_dim) with its bias."""
    return v.hidden_size * v.out_hidden_size + v.out_hidden_size



def check_setup(spec: Any, setup: Any) -> None:
    """The language model the program and the reference build: Gemma's (PaliGemma 1). PaliGemma 2's Gemma 2
    (sandwich norms, logit softcapping, a sliding-window mask beside the full one from token_type_ids) is not
    modelled by the hand-written program."""
    if spec.norms_per_layer == 4 or spec.attn_logit_softcap or spec.final_logit_softcap or spec.sliding_window:
        raise SetupError(f"{spec.name}: PaliGemma 2's Gemma 2 language model (sandwich norms, softcapping, "
                         "sliding-window layers) is not modelled; PaliGemma with a Gemma language model is")
    if spec.vision.image_token_id >= spec.vocab_size:  # PaliGemmaModel then clones the ids to replace it
        raise SetupError(f"{spec.name}: an image token id ({spec.vision.image_token_id}) outside the vocabulary "
                         f"({spec.vocab_size}) is not modelled")
    if not spec.gemma_norm or spec.qk_norm or spec.is_moe or spec.activation.value != "gelu_tanh":
        raise SetupError(f"{spec.name}: PaliGemma is modelled with a Gemma language model (Gemma's RMSNorm and "
                         "scaled embeddings, tanh-GELU MLP, no q/k norms)")
