"""Llama 3.2 Vision (transformers' ``mllama``): the numbers of its vision side, in pure Python.

The model is the cross-attention shape of a vision-language model. The tower (``MllamaVisionModel``) cuts an
image into up to ``max_tiles`` tiles of ``image_size`` pixels (the processor pads every image to
``max_tiles`` tiles), embeds each tile's patches with a Conv2d, adds gated aspect-ratio tile embeddings, a CLS
position and gated position embeddings, pads each tile's ``(image_size / patch_size)² + 1`` positions to a
multiple of 8 and runs a local encoder of ``depth`` layers and a gated global encoder of ``global_depth``
layers over all tiles of an image at once. The last state and the local layers listed in
``intermediate_layers`` are concatenated (``hidden_size x (1 + len(intermediate_layers))`` features per
position) and projected by one Linear to the text width. The language model gets one ``<|image|>`` token
per image; its layers listed in ``cross_attention_layers`` are gated cross-attention layers whose keys and
values come from the projected states of every tile's positions (the padding removed).

Parameter counts here are held to transformers' ``MllamaForConditionalGeneration`` on the meta device.
"""

from __future__ import annotations

from typing import Any

from vramlab.core.checks import SetupError, check_int
from vramlab.core.families.registry import KIND_MLLAMA
from vramlab.core.families.vlm_base.vision import check_tile, no_setup_notes, vit_layer_lora, vit_layer_params

# the VisionSpec fields this family reads beyond the shared ones (image_size: the tile's side)
READS = ("image_size", "global_depth", "intermediate_layers", "aspect_ratios", "cross_attention_layers")
AUTOCAST = True  # its step under CUDA autocast is modelled
QUANTIZED = True  # its quantized load is emulated
SHARDED = True  # ZeRO-3 / FSDP: its tower's blocks are units as in the model's _no_split_modules
QUANTIZED_AUTOCAST = False  # QLoRA under autocast: 0.75-1.6 % low against transformers' class (each alone is exact)
# the RMSNorms transformers 5.25 decorates use_kernel_forward_from_hub("RMSNorm") (the Hub kernels swap them:
# core/spec/hub_kernels.py): none, MllamaTextRMSNorm is not decorated
HUB_NORMS = ""
CLS_POSITION = True


def check(v: Any) -> None:
    """The mllama fields of a VisionSpec: refused with a reason when they cannot describe the tower."""
    p = v.processor
    if p.kind != KIND_MLLAMA:
        raise SetupError(f"an mllama tower needs the mllama image processor (got {p.kind!r})")
    check_tile(v)
    if p.tile_size != v.image_size or p.patch_size != v.patch_size:
        raise SetupError(f"the processor's tile {p.tile_size} px / patch {p.patch_size} must be the tower's "
                         f"image_size {v.image_size} / patch_size {v.patch_size}")
    check_int("max_tiles", p.max_tiles, 1, 64, "max_num_tiles")
    check_int("global_depth", v.global_depth, 0, 256, "vision num_global_layers")
    check_int("aspect_ratios", v.aspect_ratios, 1, 4096, "supported aspect ratios")
    if not v.intermediate_layers:
        raise SetupError("an mllama tower needs intermediate_layers_indices")
    if any(not 0 <= i < v.depth for i in v.intermediate_layers):
        raise SetupError(f"vision intermediate_layers_indices must lie in 0..{v.depth - 1}")
    if not v.cross_attention_layers:
        raise SetupError("an mllama model needs cross_attention_layers")
    if len(set(v.cross_attention_layers)) != len(v.cross_attention_layers) or min(v.cross_attention_layers) < 0:
        raise SetupError("cross_attention_layers must be distinct layer indices")


def check_mllama_model(spec: Any) -> None:
    """The text side agrees with the vision side (a cross-attention layer is one of the model's layers)."""
    v = spec.vision
    if max(v.cross_attention_layers) >= spec.num_layers:
        raise SetupError(f"{spec.name}: cross_attention_layers name layer {max(v.cross_attention_layers)}, "
                         f"the language model has {spec.num_layers}")
    if v.out_hidden_size != spec.hidden_size:
        raise SetupError(f"{spec.name}: the projector's output {v.out_hidden_size} is not the text width "
                         f"{spec.hidden_size}")


def check_mllama_setup(spec: Any, setup: Any) -> None:
    """What transformers cannot train: with reentrant gradient checkpointing (``ckpt_reentrant``) a
    cross-attention layer gets the vision states as a keyword argument, which the checkpoint neither detaches
    nor saves; its recompute in backward back-propagates into the tower's graph, and the second such layer
    fails ("Trying to backward through the graph a second time"; enable_input_require_grads makes even a
    frozen tower's output require grad)."""
    if setup.grad_ckpt and setup.ckpt_reentrant and setup.images:
        raise SetupError(f"{spec.name}: transformers' Llama 3.2 Vision with reentrant gradient checkpointing "
                         "fails in backward once images are given (the vision states reach every "
                         "cross-attention layer as a keyword argument); drop --grad-ckpt-reentrant (transformers' "
                         "default, non-reentrant, trains) or --grad-ckpt")


check_setup = check_mllama_setup
setup_notes = no_setup_notes


def feature_dim(v: Any) -> int:
    """``vision_output_dim``: the last state and every listed intermediate state, concatenated."""
    return v.hidden_size * (1 + len(v.intermediate_layers))


def tile_positions(v: Any) -> tuple[int, int]:
    """(positions of one tile with its CLS, the same padded to a multiple of 8)."""
    n = v.positions
    return n, n + (-n) % 8


def block_params(v: Any) -> int:
    """MllamaVisionEncoderLayer (local): LayerNorms, q/k/v/o (no biases), fc1, fc2."""
    return vit_layer_params(v.hidden_size, v.intermediate_size, attn_bias=False)


def tower_params(v: Any) -> int:
    """``MllamaVisionModel``: Conv2d patch embedding (no bias), CLS, gated position embedding with its tile
    table, two gated aspect-ratio embeddings, two LayerNorms, the local and the gated global encoder."""
    d, tiles, rows = v.hidden_size, v.processor.max_tiles, v.aspect_ratios + 1
    n = v.positions
    conv = d * v.in_channels * v.patch_size ** 2
    position = 1 + n * d + rows * tiles * n * d
    aspect = 2 * (rows * tiles * d + 1)
    return (conv + d + position + aspect + 4 * d + v.depth * block_params(v)
            + v.global_depth * (block_params(v) + 2))


def projector_params(v: Any) -> int:
    """One Linear from the concatenated states to the text width, with bias."""
    return feature_dim(v) * v.out_hidden_size + v.out_hidden_size


def language_extra_params(v: Any, spec: Any) -> int:
    """The language model beyond the text spec's layers: 8 more embedding rows, each cross-attention layer's
    q/k norms and two gates."""
    return 8 * spec.hidden_size + len(v.cross_attention_layers) * (2 * spec.head_dim + 2)


# what TRL's preference trainers cannot run on this family (core/spec/vlm_objectives.py asks): TRL 1.16.0's
# DataCollatorForVisionPreference returns the processor's output for the prompts with the prompt + completion ids
# put in, so its cross_attention_mask is prompt-long; MllamaModel.forward slices that mask to the sequence (it never
# extends it) and the cross-attention's (prompt, tiles) mask cannot be added to the (sequence, tiles) scores
PREFERENCE_REFUSED = ("TRL 1.16's vision preference collator gives Llama 3.2 Vision a cross_attention_mask as long "
                      "as the prompt, which its cross-attention cannot apply to the prompt and completion")
# TRL 1.16.0's GRPOTrainer hands the processor's outputs to _get_per_token_logps_and_entropies, whose parameters hold
# no aspect_ratio_ids, aspect_ratio_mask or cross_attention_mask (a TypeError), and _compute_loss passes the pixels
# without them (MllamaModel.forward: "`aspect_ratio_ids` must be provided if `pixel_values` is provided")
GRPO_REFUSED = ("TRL 1.16's GRPOTrainer passes Llama 3.2 Vision its pixel_values without the aspect_ratio_ids, "
                "aspect_ratio_mask and cross_attention_mask its forward needs (\"`aspect_ratio_ids` must be provided "
                "if `pixel_values` is provided\")")


def freeze_extra_params(v: Any, spec: Any, first: int, embed: bool) -> int:
    """What ``--method freeze`` trains beyond the text spec's layers from layer ``first`` on: each trained
    cross-attention layer's q/k norms and two gates, and the embedding's 8 more rows where it trains."""
    cross = sum(1 for i in v.cross_attention_layers if i >= first)
    return cross * (2 * spec.head_dim + 2) + (8 * spec.hidden_size if embed else 0)


def lora_params_per_rank(v: Any) -> int:
    """LoRA on the tower: q/k/v/o_proj, fc1 and fc2 of every local and global layer."""
    return vit_layer_lora(v.hidden_size, v.intermediate_size) * (v.depth + v.global_depth)
