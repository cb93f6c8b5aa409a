"""Llama 3.2 Vision's real transformers class as the measured model (the reference for
:mod:`vramlab.core.families.mllama.program`).

``build_mllama`` builds ``MllamaForConditionalGeneration`` from the spec with random weights (peft for LoRA: the
language model's targets by regex over its self- and cross-attention layers and MLPs, so that the tower's
same-named ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` are adapted only when ``vision_tuning`` says so),
freezes the tower and projector as ``vision_tuning`` says, and makes the processor's batch: token ids with
one ``<|image|>`` per image, ``pixel_values`` (fp32, batch x images x max_tiles x channels x side x side; the
processor pads every image to ``max_tiles`` tiles), ``aspect_ratio_ids``, ``aspect_ratio_mask`` and the
``cross_attention_mask`` (batch x sequence x images x max_tiles, int64) as ``MllamaProcessor`` returns them.
"""

from __future__ import annotations

from typing import Any

import torch

from vramlab.core.checks import SetupError
from vramlab.core.families.mllama.vision import check_mllama_model, check_mllama_setup, feature_dim
from vramlab.core.families.vlm_base.reference import (
    VlmHFModel,
    built_dtype,
    check_vlm,
    lm_target_regex,
    running,
    with_attention,
    with_lora,
    wrapped,
)
from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention, Method
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.tracing.hf import (
    BuildPlan,
    HFModel,
    enable_checkpointing,
    moves_that_change_nothing_are_skipped,
)
from vramlab.core.tracing.vlm import freeze_language_model

# the LoRA names of the tower's layers (local and global encoders)
TOWER_LORA = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.fc1", "mlp.fc2")


def hf_config(spec: ModelSpec, attention: Attention):  # noqa: ANN201
    """A transformers MllamaConfig equivalent to ``spec``."""
    import transformers as tf

    v = spec.vision
    check_mllama_model(spec)
    tiles = v.processor.max_tiles
    # the supported aspect ratios only size the tile embeddings (their count); the released list for 4 tiles
    ratios = [[w, h] for w in range(1, tiles + 1) for h in range(1, tiles + 1) if w * h <= tiles]
    if len(ratios) != v.aspect_ratios:
        ratios = [[1, 1]] * v.aspect_ratios
    text = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
                cross_attention_layers=list(v.cross_attention_layers), tie_word_embeddings=spec.tie_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
                bos_token_id=0, eos_token_id=None, pad_token_id=None)
    vision = dict(hidden_size=v.hidden_size, hidden_act=v.hidden_act, num_hidden_layers=v.depth,
                  num_global_layers=v.global_depth, attention_heads=v.num_heads, num_channels=v.in_channels,
                  intermediate_size=v.intermediate_size, vision_output_dim=feature_dim(v),
                  image_size=v.image_size, patch_size=v.patch_size, max_num_tiles=tiles,
                  intermediate_layers_indices=list(v.intermediate_layers), supported_aspect_ratios=ratios)
    cfg = tf.MllamaConfig(text_config=text, vision_config=vision, image_token_index=v.image_token_id)
    return with_attention(cfg, attention)


def _target_regex(spec: ModelSpec, setup: TrainingSetup) -> str:
    """peft's targets: the language model's self- and cross-attention layers and MLPs, both encoders' layers."""
    names = "|".join(n.replace(".", r"\.") for n in TOWER_LORA)
    tower = rf".*vision_model\.(?:transformer|global_transformer)\.layers\.\d+\.(?:{names})"
    return lm_target_regex(spec, setup, tower, layers="self_attn|cross_attn|mlp")


class MllamaHFModel(VlmHFModel):
    """The Mllama model with the builder's ``forward(ids, labels) -> loss``; ``make_batch`` adds the images."""

    def __init__(self, inner: torch.nn.Module, plan: BuildPlan, tokens: Any) -> None:
        HFModel.__init__(self, inner, plan)
        self.tokens = tokens
        self._images = {}
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        # the tower's and the projector's forward allocations are vision activations
        for module in (base.model.vision_model, base.model.multi_modal_projector):
            module.register_forward_pre_hook(self._enter_vision)
            module.register_forward_hook(self._leave_vision)
        self._vision_cm: list[Any] = []

    def _enter_vision(self, _mod: Any, _args: Any) -> None:
        cm = context.region(Kind.VISION_ACTIVATIONS)
        cm.__enter__()
        self._vision_cm.append(cm)

    def _leave_vision(self, _mod: Any, _args: Any, _out: Any) -> None:
        self._vision_cm.pop().__exit__(None, None, None)

    @staticmethod
    def parameter_kind(name: str) -> Kind | None:
        name = f".{name}"
        if ".multi_modal_projector." in name:
            return Kind.PROJECTOR_WEIGHTS
        return Kind.VISION_WEIGHTS if ".vision_model." in name else None

    def make_batch(self, setup: TrainingSetup, device: torch.device, real: bool) -> dict[str, torch.Tensor]:
        """The collator's batch as MllamaProcessor makes it (one ``<|image|>`` per image before the text)."""
        v = self.plan.spec.vision
        units = list(self.tokens.units)
        tiles, side, b = v.processor.max_tiles, v.image_size, setup.micro_batch
        row = [v.image_token_id] * len(units) + [0] * setup.seq_len
        self._images = {}
        with context.region(Kind.INPUTS):
            ids = torch.tensor([row] * b, dtype=torch.long, device=device)
            labels = ids.clone()
            mask = torch.ones(b, len(row), dtype=torch.long, device=device)
            if units:
                make = torch.randn if real else torch.empty
                self._images["pixel_values"] = make((b, len(units), tiles, v.in_channels, side, side),
                                                    dtype=torch.float32, device=device)
                ids_ = [_aspect_ratio_id(u.resized, side, tiles) for u in units]
                self._images["aspect_ratio_ids"] = torch.tensor([ids_] * b, dtype=torch.long, device=device)
                self._images["aspect_ratio_mask"] = torch.tensor(
                    [[[1] * u.tiles + [0] * (tiles - u.tiles) for u in units]] * b, dtype=torch.long, device=device)
                # every text token after an image attends to its tiles (the processor's mask from each <|image|>)
                cross = torch.zeros(b, len(row), len(units), tiles, dtype=torch.long, device=device)
                for i, u in enumerate(units):
                    cross[:, i:, i, :u.tiles] = 1
                self._images["cross_attention_mask"] = cross
        return {"input_ids": ids, "labels": labels, "attention_mask": mask, **self._images}


def _aspect_ratio_id(resized: tuple[int, int], side: int, tiles: int) -> int:
    """The processor's aspect ratio id: 1 + the index of (rows, columns) among the supported ratios."""
    ratios = [(w, h) for w in range(1, tiles + 1) for h in range(1, tiles + 1) if w * h <= tiles]
    rows, cols = resized[0] // side, resized[1] // side
    return ratios.index((rows, cols)) + 1 if (rows, cols) in ratios else 1


def check(spec: ModelSpec, setup: TrainingSetup) -> None:
    check_vlm(spec, setup)
    check_mllama(spec, setup)


def check_mllama(spec: ModelSpec, setup: TrainingSetup) -> None:
    check_mllama_model(spec)
    check_mllama_setup(spec, setup)
    if setup.frames:
        raise SetupError(f"{spec.name}: Llama 3.2 Vision takes images, not video frames")


def build(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str = "cpu", real: bool = True,
          config: Any = None) -> MllamaHFModel:
    check(spec, setup)
    with moves_that_change_nothing_are_skipped():
        return build_mllama(spec, setup, device, real, config)


def build_mllama(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str, real: bool,
                 config: Any = None) -> MllamaHFModel:
    from transformers import MllamaForConditionalGeneration

    check_mllama(spec, setup)
    cfg = config if config is not None else hf_config(spec, setup.attention)
    if setup.weight_dtype.is_quantized:  # every nn.Linear but the head as bitsandbytes stores it (tracing.hf):
        # transformers' quantizer names no module of this class to keep (no _keep_in_fp32_modules), so the
        # tower, the projector and the cross-attention layers are quantized with the rest
        from vramlab.core.tracing.hfconfig import CAUSAL, Task
        from vramlab.core.tracing.hfquant import load_quantized

        model = load_quantized(Task(CAUSAL, cfg, MllamaForConditionalGeneration), cfg, setup, device)
    else:
        with torch.device(device):
            model = MllamaForConditionalGeneration._from_config(cfg, dtype=built_dtype(setup))
    model.config.use_cache = False
    tune = setup.vision_tuning
    if setup.uses_lora:
        model = with_lora(model, setup, _target_regex(spec, setup), device)
    elif setup.method is Method.FREEZE:
        freeze_language_model(model, setup)
    for name, p in model.named_parameters():
        kind = MllamaHFModel.parameter_kind(name)
        if kind is None or "lora_" in name:
            continue
        p.requires_grad = (tune == "full") or (kind is Kind.PROJECTOR_WEIGHTS and tune == "projector")
    if setup.grad_ckpt:  # a text-only batch (check_mllama_setup): reentrant checkpointing of every decoder layer
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        enable_checkpointing(base, reentrant=setup.ckpt_reentrant)
        if not model.get_input_embeddings().weight.requires_grad:
            base.enable_input_require_grads()
    return wrapped(model, spec, setup, device, real, MllamaHFModel)


guard = running  # the step's context: nothing of the family's own


__all__ = ["MllamaHFModel", "build", "build_mllama", "check", "check_mllama", "guard", "hf_config"]
