"""Qwen2.5-VL's vision rules (pure Python): the windowed ViT's and the merger's parameters, by
:class:`vramlab.core.vision.VisionSpec`'s fields (see :mod:`vramlab.core.families.vlm_base.vision`)."""

from __future__ import annotations

from typing import Any

from vramlab.core.families.vlm_base.vision import no_language_extra, no_setup_check

# the VisionSpec fields this family reads beyond the shared ones
READS = ("temporal_patch_size", "spatial_merge_size", "window_size", "fullatt_block_indexes", "mrope_section",
         "video_token_id", "vision_start_token_id")
AUTOCAST = True  # its step under CUDA autocast is modelled
QUANTIZED = True  # its quantized load is emulated
SHARDED = True  # ZeRO-3 / FSDP: its tower's blocks are units as in the model's _no_split_modules
# the RMSNorms transformers 5.25 decorates use_kernel_forward_from_hub("RMSNorm") (the Hub kernels swap them:
# core/spec/hub_kernels.py): one class, Qwen2_5_VLRMSNorm, in the language model, the vision blocks and the merger
HUB_NORMS = "its RMSNorms (the language model's, the vision blocks' and the merger's)"
CLS_POSITION = False
language_extra_params = no_language_extra
check_setup = no_setup_check


def check(v: Any) -> None:
    """Nothing beyond the shared checks."""


def block_params(v: Any) -> int:
    """A vision block: two RMSNorms, the fused qkv and proj (biases), the gated MLP (biases)."""
    d, i = v.hidden_size, v.intermediate_size
    return 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * (i * d + i) + (d * i + d)


def tower_params(v: Any) -> int:
    """The Conv3d patch embedding (no bias) and the blocks."""
    return v.patch_features * v.hidden_size + v.depth * block_params(v)


def projector_params(v: Any) -> int:
    """The merger: RMSNorm, two linears over the merged patches (biases)."""
    m = v.merged_size
    return v.hidden_size + m * m + m + m * v.out_hidden_size + v.out_hidden_size


def lora_params_per_rank(v: Any) -> int:
    """LoRA on every block's qkv, proj, gate/up/down projections."""
    d, i = v.hidden_size, v.intermediate_size
    return ((d + 3 * d) + (d + d) + 2 * (d + i) + (i + d)) * v.depth


def setup_notes(spec: Any, setup: Any) -> list[str]:
    """The tower's attention is modelled as transformers' SDPA path where it trains."""
    if setup.vision_tuning != "frozen" and setup.attention.value == "sdpa":
        return ["the vision tower's attention is modelled as transformers' SDPA path (one call per window, "
                "the outputs concatenated); flash_attention_2's varlen kernel keeps one patches x width "
                "activation per block fewer"]
    return []
