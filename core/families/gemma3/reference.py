"""Gemma 3's vision-language class as the measured model (the reference for
:mod:`vramlab.core.families.gemma3.program`).

``Gemma3ForConditionalGeneration`` is built from the spec by
:func:`vramlab.core.families.vlm_base.reference.build_model`; this module gives it its transformers config and
its batch. The batch is what ``Gemma3Processor`` hands a trainer:
token ids with 256 image tokens per image (and per pan-and-scan crop), ``pixel_values`` of (images, 3, 896,
896) in fp32, and ``token_type_ids`` (1 on image tokens). transformers 5.24 reads ``token_type_ids`` to let
each image's tokens attend to each other both ways (``create_masks_for_vision_model``): with them, the
language model gets two materialised (batch, 1, seq, seq) boolean masks, one for the full-attention layers and
one for the sliding-window layers, instead of SDPA's ``is_causal``.

The text model's RoPE parameters, sliding window and ``query_pre_attn_scalar`` change values, not sizes, and
are set to transformers' defaults (every layer type's mask and table is built whatever the window).
"""

from __future__ import annotations

from typing import Any

import torch

from vramlab.core.families.registry import SIGLIP_VISION
from vramlab.core.families.vlm_base.reference import (
    VIT_LORA,
    VlmHFModel,
    build_family,
    check_vlm,
    construction,
    images_only,
    running,
    vit_vision_config,
    with_attention,
)
from vramlab.core.spec.model import Activation, ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup

_ACT = {Activation.GELU_TANH: "gelu_pytorch_tanh", Activation.GELU: "gelu", Activation.SILU: "silu"}


def hf_config(spec: ModelSpec, attention: Attention):  # noqa: ANN201
    """A transformers ``Gemma3Config``: SigLIP tower without its pooling head, the projector, Gemma 3 text."""
    import transformers as tf

    v = spec.vision
    text = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                max_position_embeddings=spec.max_position_embeddings, hidden_activation=_ACT[spec.activation],
                query_pre_attn_scalar=spec.head_dim, tie_word_embeddings=spec.tie_embeddings,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = vit_vision_config(v, SIGLIP_VISION, vision_use_head=False)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=v.processor.tokens_per_tile,
                          image_token_index=v.image_token_id, tie_word_embeddings=spec.tie_embeddings)
    return with_attention(cfg, attention)


def check(spec: ModelSpec, setup: TrainingSetup) -> None:
    check_vlm(spec, setup)
    images_only(spec, setup, "Gemma 3")


class Gemma3HFModel(VlmHFModel):
    """The processor's ``pixel_values`` (every image and crop as one 896 px tile, fp32) and ``token_type_ids``."""

    def pixel_inputs(self, setup: TrainingSetup, ids: torch.Tensor, device: torch.device,
                     real: bool) -> dict[str, torch.Tensor]:
        tiles = setup.micro_batch * sum(u.tiles for u in self.tokens.units)
        return self.tiles_and_token_types(tiles, ids, device, real, on_images=1)


def build(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str = "cpu", real: bool = True,
          config: Any = None) -> VlmHFModel:
    return build_family(spec, setup, device, real, config, (check, hf_config), "Gemma3ForConditionalGeneration",
                        Gemma3HFModel, "vision_tower", VIT_LORA, construction(real))


guard = running  # the step's context: nothing of the family's own
