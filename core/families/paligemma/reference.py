"""PaliGemma's real transformers class as the measured model (the reference for the estimate of
:mod:`vramlab.core.families.paligemma.program`).

``PaliGemmaForConditionalGeneration`` is built from the spec by
:func:`vramlab.core.families.vlm_base.reference.build_model`; this module gives it its transformers config and
its batch, what ``PaliGemmaProcessor`` hands a trainer: ids with (image_size / patch_size)² ``<image>`` tokens
per image, ``pixel_values`` of (images, 3, image_size, image_size) in fp32, and
``token_type_ids`` (0 on the prefix, the images and the prompt; 1 on the suffix the loss is taken on).
transformers 5.25 turns ``token_type_ids`` into ``block_sequence_ids`` (bidirectional over the prefix, causal
over the suffix), which makes ``create_causal_mask`` materialise a (batch, 1, seq, seq) mask whatever the
attention implementation (SDPA then gets it instead of ``is_causal``).

Only a Gemma language model (PaliGemma 1) is built here; PaliGemma 2's Gemma 2 is refused (:func:`check`).
"""

from __future__ import annotations

from typing import Any

import torch

from vramlab.core.families.paligemma.vision import check_setup
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
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup


def hf_config(spec: ModelSpec, attention: Attention):  # noqa: ANN201
    """A transformers ``PaliGemmaConfig``: SigLIP without its pooling head, the linear projector, Gemma (the
    sub-configs' model types are PaliGemmaConfig's defaults: siglip_vision_model and gemma)."""
    import transformers as tf

    v = spec.vision
    text = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                max_position_embeddings=spec.max_position_embeddings, hidden_act="gelu_pytorch_tanh",
                tie_word_embeddings=spec.tie_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = vit_vision_config(v, vision_use_head=False)
    cfg = tf.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=v.image_token_id,
                             projection_dim=v.out_hidden_size, hidden_size=spec.hidden_size,
                             vocab_size=spec.vocab_size, tie_word_embeddings=spec.tie_embeddings)
    return with_attention(cfg, attention)


def check(spec: ModelSpec, setup: TrainingSetup) -> None:
    check_vlm(spec, setup)
    images_only(spec, setup, "PaliGemma")
    check_setup(spec, setup)


class PaliGemmaHFModel(VlmHFModel):
    """The processor's ``pixel_values`` (every image one tile, fp32) and ``token_type_ids`` (0 on the image
    tokens, 1 on the text here: the prompt's share of the prefix changes the mask's values, not its size)."""

    def pixel_inputs(self, setup: TrainingSetup, ids: torch.Tensor, device: torch.device,
                     real: bool) -> dict[str, torch.Tensor]:
        return self.tiles_and_token_types(setup.micro_batch * len(self.tokens.units), ids, device, real,
                                          on_images=0)


def build(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str = "cpu", real: bool = True,
          config: Any = None) -> VlmHFModel:
    return build_family(spec, setup, device, real, config, (check, hf_config), "PaliGemmaForConditionalGeneration",
                        PaliGemmaHFModel, "vision_tower", VIT_LORA, construction(real))


guard = running  # the step's context: nothing of the family's own
