"""LLaVA-1.5's real transformers class as the measured model (the reference for the estimate of
:mod:`vramlab.core.families.llava.program`): ``LlavaForConditionalGeneration`` built from the spec
(:func:`~vramlab.core.families.vlm_base.reference.build_model`) with the processor's batch, every image one
(channels, side, side) tile in fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from vramlab.core.families.registry import CLIP_VISION, LLAMA
from vramlab.core.families.vlm_base.reference import (
    VIT_LORA,
    VlmHFModel,
    build_family,
    check_vlm,
    images_only,
    running,
    vit_vision_config,
    with_attention,
)
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup


def hf_config(spec: ModelSpec, attention: Attention):  # noqa: ANN201
    """A transformers LLaVA config: CLIP vision tower, the two-linear GELU projector, a Llama language model."""
    import transformers as tf

    v = spec.vision
    text = dict(model_type=LLAMA, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tie_embeddings,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = vit_vision_config(v, CLIP_VISION)
    cfg = tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=v.image_token_id,
                         projector_hidden_act="gelu", vision_feature_layer=v.feature_layer,
                         vision_feature_select_strategy="default", tie_word_embeddings=spec.tie_embeddings)
    return with_attention(cfg, attention)


def check(spec: ModelSpec, setup: TrainingSetup) -> None:
    check_vlm(spec, setup)
    images_only(spec, setup, "LLaVA-1.5")


class LlavaHFModel(VlmHFModel):
    """The processor's (images, channels, side, side) pixels, fp32."""

    def pixel_inputs(self, setup: TrainingSetup, ids: torch.Tensor, device: torch.device,
                     real: bool) -> dict[str, torch.Tensor]:
        units = self.tokens.units
        if not units:
            return {}
        return {"pixel_values": self.square_pixels(setup.micro_batch * len(units), device, real)}


def build(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str = "cpu", real: bool = True,
          config: Any = None) -> VlmHFModel:
    return build_family(spec, setup, device, real, config, (check, hf_config), "LlavaForConditionalGeneration",
                        LlavaHFModel, "vision_tower", VIT_LORA)


guard = running  # the step's context: nothing of the family's own
