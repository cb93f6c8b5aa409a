"""Qwen2.5-VL's real transformers class as the measured model (the reference for the estimate of
:mod:`vramlab.core.families.qwen2_5_vl.program`).

``build`` builds ``Qwen2_5_VLForConditionalGeneration`` from the spec (:func:`vlm_base.reference.build_model
<vramlab.core.families.vlm_base.reference.build_model>`) and makes its batch: token ids with the processor's
image placeholders, ``pixel_values`` (fp32, patches x channels*frames*pixels) and ``image_grid_thw`` exactly as
the image processor shapes them (:mod:`vramlab.core.vision`). transformers' vision_utils helpers (position
ids, cumulative sequence lengths, window index) read the grid: they run on real tensors (:func:`guard`).
"""

from __future__ import annotations

from typing import Any

import torch

from vramlab.core.families.vlm_base.reference import (
    VlmHFModel,
    build_family,
    check_vlm,
    running,
    with_attention,
)
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.tracing.vlm import realized_helpers

_HELPERS = ("get_vision_attention_seqlens", "get_vision_position_ids", "get_vision_window_index")
TOWER_LORA = r".*visual\.blocks\.\d+\.(?:attn\.qkv|attn\.proj|mlp\.gate_proj|mlp\.up_proj|mlp\.down_proj)"


def hf_config(spec: ModelSpec, attention: Attention):  # noqa: ANN201
    """A transformers Qwen2.5-VL config equivalent to ``spec`` (language model and vision tower)."""
    import transformers as tf

    v = spec.vision
    act = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[spec.activation.value]
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": list(v.mrope_section)}
    text = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
                hidden_act=act, tie_word_embeddings=spec.tie_embeddings, rope_parameters=rope,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_heads=v.num_heads, out_hidden_size=v.out_hidden_size, patch_size=v.patch_size,
                  temporal_patch_size=v.temporal_patch_size, in_channels=v.in_channels,
                  spatial_merge_size=v.spatial_merge_size, window_size=v.window_size,
                  fullatt_block_indexes=list(v.fullatt_block_indexes), hidden_act=v.hidden_act)
    cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=v.image_token_id,
                              video_token_id=v.video_token_id, vision_start_token_id=v.vision_start_token_id,
                              tie_word_embeddings=spec.tie_embeddings)
    return with_attention(cfg, attention)


check = check_vlm


class Qwen2_5VLHFModel(VlmHFModel):
    """The batch's pixels as patches (fp32) and each image's and the video's (t, h, w) grid."""

    def pixel_inputs(self, setup: TrainingSetup, ids: torch.Tensor, device: torch.device,
                     real: bool) -> dict[str, torch.Tensor]:
        v = self.plan.spec.vision
        units, video, b = list(self.tokens.units), self.tokens.video, setup.micro_batch

        def pixels(n: int) -> torch.Tensor:
            if real:
                return torch.randn(n, v.patch_features, dtype=torch.float32, device=device)
            return torch.empty(n, v.patch_features, dtype=torch.float32, device=device)

        out: dict[str, torch.Tensor] = {}
        if units:
            out["pixel_values"] = pixels(b * sum(u.patches for u in units))
            out["image_grid_thw"] = torch.tensor([list(u.grid) for _ in range(b) for u in units],
                                                 dtype=torch.long, device=device)
        if video is not None:
            out["pixel_values_videos"] = pixels(b * video.patches)
            out["video_grid_thw"] = torch.tensor([list(video.grid)] * b, dtype=torch.long, device=device)
        return out


def build(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str = "cpu", real: bool = True,
          config: Any = None) -> VlmHFModel:
    return build_family(spec, setup, device, real, config, (check, hf_config), "Qwen2_5_VLForConditionalGeneration",
                        Qwen2_5VLHFModel, "visual", TOWER_LORA)


def guard(setup: TrainingSetup) -> Any:
    """The step's context (:func:`running`), with the vision_utils helpers that read the grid run on real values."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as mq

    return running(setup, realized_helpers(mq, _HELPERS))
